"""Verdicts that hold on real traffic: every shortfall episode of seeded, realistic workloads on
the real vLLM scheduler is looked up again in isolation (keytrace.vllm.lab.oracle), and the
differ's verdict must agree: mismatch exactly when the isolated lookup is still short of E.

Workloads: both geometries, stock vLLM 0.33.0 and each injected historical store bug; two
engines with rerouting, a small CPU tier (evictions), GPU prefix-cache drops with
preemption, store acknowledgements three steps late (in-flight stores, HIT_PENDING,
deferrals), async scheduling, conversations, shared system prompts and resends.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from tests.alarm_checks import SETTINGS, assert_alarm_agrees
from tests.conftest import require_vllm
from tests.downgrade import downgrade, without_v2_facts

require_vllm()

from keytrace.analysis import frames  # noqa: E402
from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.analysis.geometry import BUILTIN  # noqa: E402
from keytrace.analysis.results import DiffReport  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.live.registry import alarms  # noqa: E402
from keytrace.vllm.lab.oracle import check  # noqa: E402
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload  # noqa: E402
from keytrace.vllm.mods.catalog import INJECTIONS  # noqa: E402

GEO_GROUPS = {name: geo.groups for name, geo in BUILTIN.items()}

CONFIGS = [
    (geometry, inject, seed, None)
    for geometry in ("dsv4", "small")
    for inject in (None, *sorted(INJECTIONS))
    for seed in (11, 12)
] + [
    # capacity and routing pressure on stock vLLM: many explained shortfalls
    (geometry, None, 21, cpu)
    for geometry in ("dsv4", "small")
    for cpu in (48, 96, 160)
]
# vLLM's tiered manager: the CPU tier as the primary over a disk tier (fs, files in a
# temporary folder the two engines share) or the in-memory example tier, small enough that
# lookups promote from the tier, promotions evict, and some requests never fit or stall
TIERED = [
    (geometry, tier, seed, cpu)
    for geometry, cpus in (("small", (16, 24, 40)), ("dsv4", (40, 80)))
    for tier in ("fs", "example")
    for seed in (1, 2)
    for cpu in cpus
]
SEEN: dict[str, Counter[str]] = {
    "verdicts": Counter(),
    "causes": Counter(),
    "traffic": Counter(),
    "tiered": Counter(),
}


def _recorded_and_checked(
    spec: WorkloadSpec, d: str, caplog: pytest.LogCaptureFixture
) -> tuple[list[Any], list[str]]:
    """Run ``spec`` into ``d`` with the live alarm on, look every shortfall up again in
    isolation, and require the differ to agree with each; the cases and the alarm's
    write-only warnings."""
    caplog.set_level(logging.WARNING, logger="keytrace")
    res = run_workload(spec, d, alarm=SETTINGS)
    warnings = [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]
    cases = check(d, res.prompts)
    bad = [c.describe() for c in cases if not c.agree]
    assert bad == [], "\n".join(bad)
    return cases, warnings


@pytest.mark.parametrize(("geometry", "inject", "seed", "cpu"), CONFIGS)
def test_differ_agrees_with_isolated_lookups(
    geometry: str,
    inject: str | None,
    seed: int,
    cpu: int | None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = str(tmp_path / "trace")
    spec = WorkloadSpec(geometry=geometry, seed=seed, inject=inject)
    if cpu is not None:
        spec = dataclasses.replace(
            spec, cpu_chunks=cpu * len(GEO_GROUPS[geometry]) // 3, reroute_rate=0.4
        )
    cases, warnings = _recorded_and_checked(spec, d, caplog)
    SEEN["verdicts"].update(c.verdict for c in cases)
    SEEN["causes"].update(f"{c.verdict}:{c.cause}" for c in cases)
    # the traffic had what the verdicts must survive
    trace = open_trace(d)
    steps = trace.collect("step")
    events = Counter(trace.collect("store")["event"].cast(pl.String).to_list())
    results = Counter(frames.lookups(trace).collect()["result"].to_list())
    SEEN["traffic"].update(
        {
            "engines": len({p.source["instance"] for p in trace.parts}) == 2,
            "preempted": int(steps["preempted"].sum()),
            "evicted": events["evicted"],
            "hit_pending": results["HIT_PENDING"],
            "deferred": int(frames.episodes(trace).collect()["X"].is_null().sum()),
            "shortfalls": len(cases),
        }
    )
    # and the operator's account adds up to the prompt tokens, per engine, exactly
    report = diff(trace)
    lost = report.lost
    assert lost is not None
    per_engine = Counter[str]()
    for row in lost.rows:
        per_engine[row.engine] += row.tokens
    assert dict(per_engine) == lost.prompt_tokens
    assert_v1_form_agrees(d, report, tmp_path)
    # the live alarm, run while recording, said the same as the differ, episode by episode
    assert_alarm_agrees(d, alarms(), warnings)


@pytest.mark.parametrize(("geometry", "tier", "seed", "cpu"), TIERED)
def test_differ_agrees_with_isolated_lookups_on_tiers(
    geometry: str,
    tier: str,
    seed: int,
    cpu: int,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same check on a tiered manager (keytrace.vllm.lab.oracle: a second isolated
    lookup on a fresh tiered manager with the recorded primary capacity), and the live
    alarm field by field."""
    d = str(tmp_path / "trace")
    spec = WorkloadSpec(
        geometry=geometry, seed=seed, tiers=(tier,), cpu_chunks=cpu, conversations=12
    )
    cases, warnings = _recorded_and_checked(spec, d, caplog)
    report = diff(open_trace(d))
    assert report.lost is not None
    per_engine = Counter[str]()
    for row in report.lost.rows:
        per_engine[row.engine] += row.tokens
    assert dict(per_engine) == report.lost.prompt_tokens
    SEEN["tiered"].update(
        {
            "shortfalls": len(cases),
            "tier causes": sum(1 for c in cases if c.tiered_external is not None),
            "promotion evictions": open_trace(d)
            .frame("tier")
            .filter(pl.col("event").cast(pl.String) == "promotion_evicted")
            .select(pl.len())
            .collect()
            .item(),
        }
    )
    SEEN["tiered"].update(f"verdict {c.verdict}" for c in cases)
    assert_alarm_agrees(d, alarms(), warnings)


def assert_v1_form_agrees(d: str, report: DiffReport, tmp_path: Path) -> None:
    """The recording written as v1 gives the verdicts of the same facts written as v2, and
    the facts only v2 holds never turn a v1 mismatch into anything else."""
    downgrade(d, str(tmp_path / "v1"))
    without_v2_facts(d, str(tmp_path / "v2-as-v1-saw"))
    old = diff(open_trace(str(tmp_path / "v1")))
    same = diff(open_trace(str(tmp_path / "v2-as-v1-saw")))
    assert [dataclasses.asdict(v) for v in old.episodes] == [
        dataclasses.asdict(v) for v in same.episodes
    ]
    assert (old.verdict, old.counts, old.lost) == (same.verdict, same.counts, same.lost)
    sharper = {(v.req_id, v.episode): v for v in report.episodes}
    for v in old.episodes:
        if v.verdict == "mismatch":
            w = sharper[(v.req_id, v.episode)]
            assert w.verdict == "mismatch" and w.terminal is not None and v.terminal is not None
            assert (w.terminal.group_id, w.terminal.chunk) == (
                v.terminal.group_id,
                v.terminal.chunk,
            )


def test_enough_was_checked() -> None:
    # runs after the parametrized cases above (file order): the bar
    if len(SEEN["traffic"]) == 0:
        pytest.skip("the oracle cases did not run in this session")
    t = SEEN["traffic"]
    print(f"\noracle: {t['shortfalls']} shortfall episodes, verdicts {dict(SEEN['verdicts'])}")
    print(f"causes: {dict(SEEN['causes'])}")
    print(f"traffic: {dict(t)}")
    assert t["shortfalls"] >= 300
    assert t["engines"] == len(CONFIGS)  # every workload ran on two engines
    tiered = SEEN["tiered"]
    print(f"tiered: {dict(tiered)}")
    assert tiered["shortfalls"] >= 300 and tiered["promotion evictions"] > 0
    assert min(t["preempted"], t["evicted"], t["hit_pending"], t["deferred"]) > 0
    assert SEEN["verdicts"]["mismatch"] >= 100 and SEEN["verdicts"]["explained"] >= 100
