"""Prefill checkpoints exported inside a chunk (vLLM's Mamba2 layers) on the real scheduler.

The ``nemotron_h`` preset's Mamba specs ask for ``num_prefill_checkpoint_blocks = 1`` and
alignment 1, as ``mamba_mixer2.py`` does: vLLM's scheduler then runs the final prefill
chunk through to the prompt's end instead of stopping it at the last block boundary M,
and the backend exports the state at M from inside it. The core keeps, and hands the
connector, the state at M all the same: the recurrent rules hold as written
(`keytrace.judge.rules.prefill_checkpoint_of`, ``block``). With a hash unit below the
block the checkpoint is the partial tail instead, and no state is kept at its block
start (``tail``): not judged. 0.33.0 runs in this process, 0.34.0 from its sdist in a
fresh interpreter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.analysis.geometry import NEMOTRON_H, Geometry  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.judge.rules import CHECKPOINT_BLOCK, prefill_checkpoint_of  # noqa: E402
from keytrace.vllm.hook.patches import recording  # noqa: E402
from keytrace.vllm.lab.harness import Harness  # noqa: E402
from tests.integration.vllm_builds import DEFAULT_CACHE, run_python  # noqa: E402

pytestmark = pytest.mark.vllm

ENV_034 = {"VLLM_CACHE_ROOT": str(DEFAULT_CACHE / "vllm-cache-0.34")}


def _sends(geometry: Geometry, d: Path, n: int, sends: int = 2) -> dict[str, Any]:
    """``sends`` identical prompts of ``n`` tokens, the GPU prefix cache dropped after each,
    recorded into ``d``: what each scheduled per step, and what each resend loaded."""
    with recording(str(d)):
        h = Harness(geometry, max_prompt_tokens=n)
        steps, served = [], []
        for _ in range(sends):
            rid = h.submit_tokens(h.tokens(n, chain=0))
            mine = []
            while h.scheduler.has_requests():
                out = h.step()
                if rid in out.num_scheduled_tokens:
                    mine.append(out.num_scheduled_tokens[rid])
            steps.append(mine)
            served.append(h.observations[rid].external_tokens)
            h.reset_gpu_prefix_cache()
    h.close()
    return {"steps": steps, "served": served}


def test_the_checkpoint_is_exported_inside_the_chunk_and_its_state_served(tmp_path: Path) -> None:
    """700 tokens in steps of 512: vLLM runs [512, 700) in one step (no stop at M = 640),
    keeps the state at 640 all the same, and the resend loads it: a hit at E = 640, on
    rules the oracle verified for prefill checkpoints."""
    got = _sends(NEMOTRON_H, tmp_path / "t", 700)
    assert got["steps"][0] == [512, 188]  # a split prefill would be [512, 128, 60]
    assert got["served"] == [0, 640]
    trace = open_trace(str(tmp_path / "t"))
    rec = trace.header["recurrent"]
    assert set(rec["groups"]) == {"0", "1", "2", "3"}
    for spec in rec["groups"].values():
        assert spec["num_prefill_checkpoint_blocks"] == 1
        assert spec["prefill_checkpoint_alignment"] == 1
    assert prefill_checkpoint_of(trace.header) == CHECKPOINT_BLOCK
    report = diff(trace, all_episodes=True)
    assert [(v.verdict, v.E) for v in report.episodes] == [("cold", None), ("hit", 640)]
    assert report.rules is not None
    rules = report.rules.as_json()
    assert rules["trust"] == "verified"
    assert rules["needs"] == ["recurrent", "recurrent+checkpoint"]


def test_a_checkpoint_that_ends_no_chunk_is_dropped_as_a_split_state_is(tmp_path: Path) -> None:
    """760 tokens in chunks of two blocks: the exported state at M = 704 ends no 128-token
    chunk, and vLLM stores none (docs/findings.md, "Recurrent state groups"): the resends
    load 0 every time on 0.33.0, and keytrace names the state the store never kept."""
    got = _sends(NEMOTRON_H.with_(blocks_per_chunk=2), tmp_path / "t", 760, sends=3)
    assert got["steps"][0] == [512, 248]
    assert got["served"] == [0, 0, 0]
    report = diff(open_trace(str(tmp_path / "t")), all_episodes=True)
    verdicts = [(v.verdict, v.E) for v in report.episodes]
    assert verdicts == [("cold", None), ("mismatch", 640), ("mismatch", 640)]
    first = report.episodes[1]
    assert first.binding_group == 0 and first.terminal is not None
    assert first.terminal.chunk == 4 and first.terminal.cause == "no_checkpoint"


def test_a_checkpoint_at_a_partial_tail_keeps_no_state_below_it_and_is_not_judged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a 16-token hash unit the checkpoint is the tail T = 688, exported from inside
    [512, 700): no chunk ends at its block start 640, so no state is kept there, and vLLM
    0.33.0's partial window, anchored on the complete hit that needs it, loads nothing
    (docs/findings.md). keytrace records it and gives no verdict."""
    caplog.set_level(logging.WARNING, logger="keytrace")
    got = _sends(NEMOTRON_H.with_(prefix_match_unit=16), tmp_path / "t", 700)
    assert got["steps"][0] == [512, 188]  # a split prefill would stop at 640 and at 688
    assert got["served"] == [0, 0]
    report = diff(open_trace(str(tmp_path / "t")), all_episodes=True)
    assert report.rules is not None
    rules = report.rules.as_json()
    assert rules["trust"] == "uncovered"
    assert "prefill checkpoints exported at a partial tail" in rules["uncovered"][0]


SENDS_034 = """
import json, tempfile
from pathlib import Path
import vllm
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import NEMOTRON_H
from keytrace.format.reader import open_trace
from tests.integration.test_prefill_checkpoints import _sends

out = {"version": vllm.__version__}
for name, geo, n in (
    ("block", NEMOTRON_H, 700),
    ("bpc2", NEMOTRON_H.with_(blocks_per_chunk=2), 760),
    ("tail", NEMOTRON_H.with_(prefix_match_unit=16), 700),
):
    with tempfile.TemporaryDirectory() as d:
        got = _sends(geo, Path(d), n)
        report = diff(open_trace(d), all_episodes=True)
        got["verdicts"] = [(v.verdict, v.E) for v in report.episodes]
        got["rules"] = report.rules.as_json()
        out[name] = got
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sends_034() -> dict[str, Any]:
    """The three cases above on vLLM 0.34.0's own code, in one fresh interpreter."""
    r = run_python(SENDS_034, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0"
    return found


def test_on_0_34_a_checkpoint_at_a_block_boundary_is_judged_as_on_0_33(
    sends_034: dict[str, Any],
) -> None:
    block, bpc2 = sends_034["block"], sends_034["bpc2"]
    assert block["steps"][0] == [512, 188] and block["served"] == [0, 640]
    assert block["verdicts"] == [["cold", None], ["hit", 640]]
    assert block["rules"]["trust"] == "verified"
    assert block["rules"]["needs"] == ["recurrent", "recurrent+checkpoint"]
    assert bpc2["steps"][0] == [512, 248] and bpc2["served"] == [0, 0]
    assert bpc2["verdicts"] == [["cold", None], ["mismatch", 640]]


def test_on_0_34_a_checkpoint_at_a_partial_tail_is_served_and_not_judged(
    sends_034: dict[str, Any],
) -> None:
    """0.34.0 anchors the partial window on the full-attention prefix and serves the tail
    without the state at its block start; still not judged (no oracle run covers it)."""
    tail = sends_034["tail"]
    assert tail["steps"][0] == [512, 188] and tail["served"] == [0, 688]
    assert tail["rules"]["trust"] == "uncovered"


def test_the_oracle_and_the_alarm_agree_with_the_differ_on_prefill_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A workload of the oracle's checkpoint layouts (`verify.CHECKPOINT_LAYOUTS`, chunks of
    two blocks) on vLLM 0.33.0: the live alarm gives every episode the differ's fields, and
    every shortfall looked up again alone on a fresh scheduler agrees with the differ."""
    from keytrace.live.registry import alarms, forget_alarms
    from keytrace.vllm.lab.oracle import check
    from keytrace.vllm.lab.workload import WorkloadSpec, run_workload
    from tests.alarm_checks import SETTINGS, assert_alarm_agrees

    forget_alarms()
    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "t")
    spec = WorkloadSpec(
        geometry="nemotron_h", seed=901, conversations=10, cpu_chunks=30, blocks_per_chunk=2
    )
    result = run_workload(spec, d, alarm=SETTINGS)
    warned = [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]
    report = assert_alarm_agrees(d, alarms(), warned)
    assert report.rules is not None and report.rules.as_json()["trust"] == "verified"
    cases = check(d, result.prompts)
    assert len(cases) >= 5 and [c for c in cases if not c.agree] == []
    # the chunk-of-two-blocks class among them: a state that ends no chunk, never stored
    assert any(c.verdict == "mismatch" for c in cases)
