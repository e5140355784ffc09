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
    header = open_trace(d).header
    print(json.dumps({
        "version": vllm.__version__,
        "served": h.observations[rid].external_tokens,
        "partial": header["supports_partial_tail"],
        "anchor": header["recurrent"]["partial_anchor"],
    }))
"""


def test_on_0_34_the_header_records_the_full_attention_anchor() -> None:
    r = run_python(RESEND_034, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0" and found["partial"] is True
    assert found["anchor"] == "fa_prefix"  # _lookup_partial_tail_hit
    assert found["served"] == 688  # the last hash boundary before the last token


RESEND_JUDGED_034 = """
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
    report = diff(open_trace(d), all_episodes=True)
    print(json.dumps({
        "version": vllm.__version__,
        "served": h.observations[rid].external_tokens,
        "verdicts": [(v.verdict, v.E) for v in report.episodes],
        "rules": report.rules.as_json(),
    }))
"""


def test_on_0_34_a_resend_that_hits_its_partial_tail_agrees() -> None:
    r = run_python(RESEND_JUDGED_034, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0" and found["served"] == 688
    assert found["verdicts"] == [["cold", None], ["hit", 688]]
    assert found["rules"]["trust"] == "verified"
    assert found["rules"]["needs"] == ["recurrent", "recurrent+partial"]


def test_the_oracle_and_the_alarm_agree_with_the_differ_on_partial_tails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A workload of the oracle's partial-tail layout on vLLM 0.33.0: the live alarm gives
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
        seed=1,
        conversations=10,
        cpu_chunks=30,
        blocks_per_chunk=1,
        prefix_match_unit=16,
    )
    result = run_workload(spec, d, alarm=SETTINGS)
    report = assert_alarm_agrees(d, alarms(), [])
    assert report.rules is not None and report.rules.as_json()["trust"] == "verified"
    cases = check(d, result.prompts)
    assert len(cases) >= 15 and [c for c in cases if not c.agree] == []
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
