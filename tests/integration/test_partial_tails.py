"""Partial tails on a recurrent hybrid (a hash unit below the block) on the real scheduler.

With ``supports_partial_tail`` vLLM's connector stores, beside the complete chunks, every
group's key at a producer's tail boundary T (a multiple of the hash unit inside a block),
and its lookup probes the hash boundaries past the complete-chunk hit from the right.
Where that window starts differs between releases (the header's ``partial_anchor``):
vLLM 0.33.0 anchors it on the complete hit, which needs an aligned recurrent state;
0.34.0 on the larger of that hit and the full-attention prefix. 0.33.0 runs in this
process, 0.34.0 from its sdist in a fresh interpreter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from tests.integration.vllm_builds import DEFAULT_CACHE, run_python  # noqa: E402

pytestmark = pytest.mark.vllm

ENV_034 = {"VLLM_CACHE_ROOT": str(DEFAULT_CACHE / "vllm-cache-0.34")}

RESEND_034 = """
import json, tempfile
import vllm
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import RECURRENT
from keytrace.format.reader import open_trace
from keytrace.vllm.hook.patches import recording
from keytrace.vllm.lab.harness import Harness

with tempfile.TemporaryDirectory() as d:
    with recording(d):
        h = Harness(RECURRENT.with_(prefix_match_unit=16), max_prompt_tokens=700)
        h.submit_tokens(h.tokens(700, chain=0))
        h.run_until_idle(give_up=True)
        h.reset_gpu_prefix_cache()
        rid = h.submit_tokens(h.tokens(700, chain=0))
        h.run_until_idle(give_up=True)
    h.close()
    trace = open_trace(d)
    header = trace.header
    report = diff(trace, all_episodes=True)
    print(json.dumps({
        "version": vllm.__version__,
        "served": h.observations[rid].external_tokens,
        "partial": header["supports_partial_tail"],
        "anchor": header["recurrent"]["partial_anchor"],
        "verdicts": [(v.verdict, v.E) for v in report.episodes],
        "rules": report.rules.as_json(),
    }))
"""


@pytest.fixture(scope="module")
def resend_034() -> dict[str, object]:
    """One 700-token prompt stored and resent on vLLM 0.34.0's own code, recorded and
    judged in a fresh interpreter (one start-up of 0.34.0 serves both tests below)."""
    r = run_python(RESEND_034, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return found


def test_on_0_34_the_header_records_the_full_attention_anchor(
    resend_034: dict[str, object],
) -> None:
    found = resend_034
    assert found["version"] == "0.34.0" and found["partial"] is True
    assert found["anchor"] == "fa_prefix"  # _lookup_partial_tail_hit
    assert found["served"] == 688  # the last hash boundary before the last token


def test_on_0_34_a_resend_that_hits_its_partial_tail_agrees(
    resend_034: dict[str, object],
) -> None:
    found = resend_034
    assert found["version"] == "0.34.0" and found["served"] == 688
    assert found["verdicts"] == [["cold", None], ["hit", 688]]
    rules = found["rules"]
    assert isinstance(rules, dict)
    assert rules["trust"] == "verified"
    assert rules["needs"] == ["recurrent", "recurrent+partial"]


@pytest.mark.parametrize(
    ("seed", "cpu_chunks", "unit"),
    [
        (1, 30, 16),
        # a shortfall at a tail whose probe found group 0's key and missed group 2's
        (4, 30, 16),
        # a complete E whose binding scan ended at a probe of another tail (no chunk)
        (5, 30, 16),
        # the oracle's plan, seed 1702: a shortfall at a tail (E 928) whose block start was
        # the episode's GPU prefix (S 896), which the isolated lookup must stand in for
        (1702, 60, 32),
    ],
)
def test_the_oracle_and_the_alarm_agree_with_the_differ_on_partial_tails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int, cpu_chunks: int, unit: int
) -> None:
    """A workload of the oracle's partial-tail layouts on vLLM 0.33.0: the live alarm gives
    every episode the differ's fields, and every shortfall, those below a partial E among
    them, looked up again alone on a fresh scheduler agrees with the differ."""
    from keytrace.live.registry import alarms, forget_alarms
    from keytrace.vllm.lab.oracle import check
    from keytrace.vllm.lab.workload import WorkloadSpec, run_workload
    from tests.alarm_checks import SETTINGS, assert_alarm_agrees

    forget_alarms()
    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "t")
    spec = WorkloadSpec(
        geometry="recurrent",
        seed=seed,
        conversations=10,
        cpu_chunks=cpu_chunks,
        blocks_per_chunk=1,
        prefix_match_unit=unit,
    )
    result = run_workload(spec, d, alarm=SETTINGS)
    report = assert_alarm_agrees(d, alarms(), [])
    assert report.rules is not None and report.rules.as_json()["trust"] == "verified"
    cases = check(d, result.prompts)
    assert len(cases) >= 5 and [c for c in cases if not c.agree] == []
    partial = [c for c in cases if c.E is not None and c.E % 64]
    assert partial and all(c.verdict == "explained" for c in partial)
    # a partial E is judged as a hit where vLLM served it
    assert [v for v in report.episodes if v.verdict == "hit" and v.E and v.E % 64]


WORKLOAD_034 = """
import json, tempfile
import vllm
from keytrace.live.registry import alarms
from keytrace.vllm.lab.oracle import check
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload
from tests.alarm_checks import SETTINGS, assert_alarm_agrees

with tempfile.TemporaryDirectory() as d:
    spec = WorkloadSpec(geometry="recurrent", seed=2, conversations=10, cpu_chunks=30,
                        blocks_per_chunk=1, prefix_match_unit=16)
    result = run_workload(spec, d, alarm=SETTINGS)
    report = assert_alarm_agrees(d, alarms(), [])
    cases = check(d, result.prompts)
    print(json.dumps({
        "version": vllm.__version__,
        "anchor": report.header["recurrent"]["partial_anchor"],
        "trust": report.rules.as_json()["trust"],
        "cases": [(c.verdict, c.E, c.agree) for c in cases],
        "partial_hits": sum(1 for v in report.episodes if v.verdict == "hit" and v.E and v.E % 64),
    }))
"""


def test_on_0_34_the_oracle_and_the_alarm_agree_with_the_differ_on_partial_tails() -> None:
    """The same on vLLM 0.34.0's own code, whose window is anchored on the full-attention
    prefix: the alarm field by field, every shortfall by the oracle."""
    r = run_python(WORKLOAD_034, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0" and found["anchor"] == "fa_prefix"
    assert found["trust"] == "verified"
    assert len(found["cases"]) >= 10 and all(agree for _, _, agree in found["cases"])
    assert found["partial_hits"] > 0


W1_SENDS = """
import json, tempfile
import vllm
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import RECURRENT
from keytrace.format.reader import open_trace
from keytrace.vllm.hook.patches import recording
from keytrace.vllm.lab.harness import Harness

with tempfile.TemporaryDirectory() as d:
    with recording(d):
        h = Harness(RECURRENT.with_(prefix_match_unit=16, cpu_chunks=18), max_prompt_tokens=700)
        served = []
        for n, chain in ((700, 0), (700, 0), (65, 1), (700, 0)):
            rid = h.submit_tokens(h.tokens(n, chain=chain))
            h.run_until_idle(give_up=True)
            served.append(h.observations[rid].external_tokens)
            h.reset_gpu_prefix_cache()
    h.close()
    report = diff(open_trace(d), all_episodes=True)
    last = report.episodes[-1]
    print(json.dumps({
        "version": vllm.__version__,
        "served": served,
        "last": [last.verdict, last.E, last.binding_group,
                 last.terminal.cause if last.terminal else None],
    }))
"""
# A 700-token prompt (tail T = 688, its block at 640) stored, resent (it loads the
# full-attention chunks and every group's key at 688, which refreshes them on the CPU
# tier's LRU; the recurrent states at 640 are looked up, never loaded, so they stay the
# oldest), then a 65-token prompt of another chain on a CPU tier of 18 chunks (its 4 keys
# evict the 3 oldest: those states), then the 700 again.


def test_on_0_33_a_tail_needs_the_aligned_state_its_resends_never_refresh() -> None:
    """vLLM 0.33.0 anchors the partial window on the complete hit, which needs the
    recurrent state at the tail's block start: evicted, the third send loads nothing though
    every key a hit at 688 loads is resident (docs/findings.md, W1). keytrace: E = 640 (the
    state's boundary; the window never reached 688, so no tail of it is intended),
    explained by the eviction, as the oracle would: isolation puts the state back."""
    r = run_python(W1_SENDS)
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"].startswith("0.33")
    assert found["served"] == [0, 688, 0, 0]
    assert found["last"] == ["explained", 640, 0, "evicted"]


def test_on_0_34_the_same_tail_is_served_from_the_full_attention_prefix() -> None:
    """The same sends on 0.34.0's own code: the window is anchored on the full-attention
    prefix (640), so the third send loads the tail at 688 without the evicted state."""
    r = run_python(W1_SENDS, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0"
    assert found["served"] == [0, 688, 0, 688]
    assert found["last"] == ["hit", 688, None, None]
