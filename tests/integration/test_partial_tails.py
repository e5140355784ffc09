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
