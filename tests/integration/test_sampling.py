"""Consistent sampling (``KEYTRACE_SAMPLE``) on the real vLLM scheduler: the same seeded
workload recorded in full and sampled; the sampled trace's verdicts equal the full trace's
on the sampled chains, field by field, and a chain is never cut in half.

Workloads from the oracle's set (tests/integration/test_oracle.py): stock vLLM with a small
CPU tier and rerouting between two engines, an injected historical store bug, and a tiered
manager over an fs tier. System prompts are many and the fraction large, so that each
trace holds some chains and misses others.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from tests.alarm_checks import SETTINGS, assert_alarm_agrees
from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.live.registry import alarms, live_totals  # noqa: E402
from keytrace.report.jsonout import to_jsonable  # noqa: E402
from keytrace.report.text import render_diff  # noqa: E402
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload  # noqa: E402

FRACTION = 0.5
SPECS = {
    "evictions+routing": WorkloadSpec(
        geometry="small", seed=21, system_prompts=8, cpu_chunks=32, reroute_rate=0.4
    ),
    "injected store bug": WorkloadSpec(
        geometry="dsv4", seed=11, system_prompts=8, inject="no_eagle_plus1"
    ),
    "tiered fs": WorkloadSpec(
        geometry="small",
        seed=2,
        system_prompts=6,
        tiers=("fs",),
        cpu_chunks=24,
        conversations=12,
    ),
}
UNSTABLE = ("instance", "instance_id", "engine_id", "episode")
"""Fields that number recorders and events in process order, and the engine ids vLLM draws
at random (two runs differ)."""


def _by_request(report: Any) -> dict[str, list[dict[str, Any]]]:
    """Each request's judged episodes in order, without the fields two runs number apart."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for v in report.episodes:
        row = dataclasses.asdict(v)
        for name in UNSTABLE:
            row.pop(name)
        out[v.req_id].append(row)
    return dict(out)


def _keys_by_request(d: str) -> dict[str, set[bytes]]:
    """Every key each request offered to the store path (an eviction's keys are other
    requests': it names the request whose store made room)."""
    trace = open_trace(d)
    keys: dict[str, set[bytes]] = defaultdict(set)
    stores = trace.collect("store").filter(
        pl.col("req_id").is_not_null() & (pl.col("event").cast(pl.String) != "evicted")
    )
    for req, key in stores.select(pl.col("req_id").cast(pl.String), "key").iter_rows():
        if key is not None:
            keys[req].add(key)
    return dict(keys)


def _record(
    spec: WorkloadSpec,
    d: Path,
    sample: float | None,
    mp: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> tuple[str, Counter[str]]:
    """Record ``spec`` into ``d`` with the live alarm on; the trace and what the alarm
    judged during the run (episodes by verdict), having checked that it judged what the
    trace holds, episode by episode and field by field (`tests.alarm_checks`)."""
    if sample is None:
        mp.delenv("KEYTRACE_SAMPLE", raising=False)
    else:
        mp.setenv("KEYTRACE_SAMPLE", str(sample))
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="keytrace")
    run_workload(spec, str(d), alarm=SETTINGS)  # a recording session starts a new alarm
    warned = [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]
    report = assert_alarm_agrees(str(d), alarms(), warned)
    judged = Counter(live_totals()[0])
    assert judged == Counter(report.counts)
    return str(d), judged


@pytest.mark.parametrize("name", sorted(SPECS))
def test_sampled_verdicts_equal_full_verdicts_on_the_sampled_chains(
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = SPECS[name]
    full_dir, judged_full = _record(spec, tmp_path / "full", None, monkeypatch, caplog)
    sampled_dir, judged_sampled = _record(spec, tmp_path / "sampled", FRACTION, monkeypatch, caplog)
    # the live alarm judged what each trace keeps (`_record`), so under sampling the
    # sampled chains' episodes only
    assert 0 < sum(judged_sampled.values()) < sum(judged_full.values())
    full = diff(open_trace(full_dir), all_episodes=True)
    sampled = diff(open_trace(sampled_dir), all_episodes=True)
    assert sampled.sample == FRACTION and full.sample is None
    assert open_trace(sampled_dir).header["sample"] == FRACTION
    assert not sampled.evidence_incomplete, sampled.warnings
    got, want = _by_request(sampled), _by_request(full)
    # some chains in, some out: a test of the filter, not of an empty or a whole trace
    assert 0 < len(got) < len(want), (len(got), len(want))
    assert set(got) <= set(want)
    for req, episodes in got.items():
        assert len(episodes) == len(want[req]), req
        for i, (a, b) in enumerate(zip(episodes, want[req], strict=True)):
            differ = {k: (a[k], b[k]) for k in a if a[k] != b[k] and k != "needed"}
            differ.update(
                (f"needed[{j}]", (x, y))
                for j, (x, y) in enumerate(zip(a["needed"], b["needed"], strict=False))
                if x != y
            )
            assert a == b, f"{req} episode {i}: (sampled, full) differ in {differ}"
    # what the verdicts were: the sample holds shortfalls, not only clean hits
    verdicts = {e["verdict"] for eps in got.values() for e in eps}
    assert verdicts - {"hit", "cold"}, verdicts
    # the report says what the trace is, and what a verdict on it covers
    text = io.StringIO()
    render_diff(sampled, text)
    assert f"sampled trace (KEYTRACE_SAMPLE={FRACTION:g})" in text.getvalue()
    assert to_jsonable(sampled)["sample"] == FRACTION
    # the rows of a request the sampler left out are not built: no step, store or load
    # row names one (a store row of no request is an unsampled chain's first key of a group;
    # an eviction names whichever request's store made room, its keys are a sampled chain's)
    trace = open_trace(sampled_dir)
    for kind in ("step", "store", "load"):
        rows = trace.frame(kind)
        if kind == "store":
            rows = rows.filter(pl.col("event").cast(pl.String) != "evicted")
        named = set(rows.collect()["req_id"].cast(pl.String).drop_nulls())
        assert named <= set(got), (kind, sorted(named - set(got))[:5])
    assert set(trace.collect("step")["req_id"].cast(pl.String)) == set(got)
    # and no chain is cut: a request that shares a key with a sampled one is sampled
    keys = _keys_by_request(full_dir)
    sampled_keys = set().union(*(keys.get(r, set()) for r in got))
    for req, ks in keys.items():
        if ks & sampled_keys:
            assert req in got, f"{req} shares keys with a sampled chain and was not sampled"


def test_the_startup_line_says_the_trace_is_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    from keytrace.vllm.hook.plugin import startup_line

    monkeypatch.setenv("KEYTRACE_SAMPLE", "0.01")
    line = startup_line("/tmp/kt", None)
    assert line.startswith("keytrace: recording offload keys to /tmp/kt (cap ")
    assert "sampling 0.01 of prefix chains" in line
