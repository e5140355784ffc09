"""The differ judges a long trace in batches of episodes (`keytrace.analysis.diff.
BATCH_EPISODES`): the report must not depend on where the batches are cut.

The trace is real traffic through the stock vLLM 0.33.0 scheduler on two engines (rerouted
turns: routing misses and cold-routing tokens), with GPU-cache drops and a small CPU tier
(evictions), on the small hybrid geometry (its MTP group misses: mismatches), so every part
of a report that crosses a batch boundary is exercised: chains to requests judged in an earlier batch, store history before
a batch, causes on another engine, the lost-token account, positions of detailed episodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import BATCH_EPISODES, diff  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.report.jsonout import to_jsonable  # noqa: E402
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload  # noqa: E402


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("batches") / "wl"
    spec = WorkloadSpec(
        geometry="small",
        seed=5,
        conversations=12,
        turns=(2, 3),
        reroute_rate=0.4,
        cpu_chunks=60,
        gpu_flush_steps=15,
    )
    run_workload(spec, str(d))
    return d


def _report(d: Path, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = to_jsonable(diff(open_trace(str(d)), **kw))
    return out


def test_the_trace_exercises_what_batches_cut(traffic: Path) -> None:
    r = _report(traffic, all_episodes=True)
    counts = r["counts"]
    assert counts.get("mismatch", 0) >= 1 and counts.get("explained", 0) >= 1
    assert counts.get("hit", 0) >= 1 and counts.get("cold", 0) >= 1
    assert sum(counts.values()) >= 30  # batches of 7 below: five or more
    categories = {row["category"] for row in r["lost"]["rows"]}
    assert {"short", "offload", "cold_routing"} <= categories
    causes = {c["cause"] for e in r["episodes"] for c in e["needed"]}
    assert {"other_engine", "evicted", "never_offered"} <= causes
    # episodes on a chain whose earlier requests are judged in an earlier batch of 7
    assert any(e["chain"] and e["episode"] > 7 * 2 for e in r["episodes"])


@pytest.mark.parametrize("size", [1, 7, 64])
def test_every_batch_size_gives_the_same_report(traffic: Path, size: int) -> None:
    whole = _report(traffic, all_episodes=True, batch_episodes=BATCH_EPISODES)
    assert _report(traffic, all_episodes=True, batch_episodes=size) == whole


def test_shortfalls_only_and_a_selection_are_the_same_in_batches(traffic: Path) -> None:
    assert _report(traffic, batch_episodes=5) == _report(traffic)
    whole = _report(traffic, all_episodes=True)
    req = next(e["req_id"] for e in whole["episodes"] if e["verdict"] == "mismatch")
    picked = _report(traffic, request=req, all_episodes=True, batch_episodes=3)
    assert picked == _report(traffic, request=req, all_episodes=True)
    assert {e["req_id"] for e in picked["episodes"]} == {req}
