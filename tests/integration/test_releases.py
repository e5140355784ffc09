"""keytrace on the vLLM users run: another release's own code (0.31.0 loads, records and
names the 17,975-token miss; 0.29.0 and 0.30.0 are refused with the exact reason), and the
installed 0.33.0 code under source-build version strings (records, diffs and doctors as the
release does, with vllm_verified: false). Each case runs in a fresh interpreter
(vllm_builds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from tests.integration.vllm_builds import capability_table, doctor, run_python  # noqa: E402

pytestmark = pytest.mark.vllm

RECORD_17975 = """
import json, sys
from keytrace.analysis.geometry import DSV4
from keytrace.vllm.lab.replay import replay
r = replay(DSV4, [17_975], 17_975, trace_dir={out!r})
print(json.dumps({{"verdict": r.verdict, "group": r.binding_group, "chunk": r.terminal_chunk,
                  "cause": r.cause, "external": r.external_tokens, "E": r.expected_E}}))
"""

STOCK_17975 = {
    "verdict": "mismatch",
    "group": 2,
    "chunk": 277,
    "cause": "never_offered",
    "external": 0,
    "E": 17_920,
}
"""The upstream 17,975-token case on stock vLLM (docs/findings.md): MTP group 2's chunk
277 is needed and never stored."""


def _record_17975(tmp_path: Path, **where: str) -> tuple[dict[str, object], Path]:
    out = tmp_path / "t"
    r = run_python(RECORD_17975.format(out=str(out)), **where)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), out


def _first_mismatch(trace_dir: Path) -> tuple[int | None, int | None, str | None]:
    report = diff(open_trace(str(trace_dir)))
    return next(v for v in report.episodes if v.verdict == "mismatch").evidence()


def test_0_31_records_and_names_the_17975_miss(tmp_path: Path) -> None:
    found, trace_dir = _record_17975(tmp_path, release="0.31.0")
    assert found == STOCK_17975
    header = open_trace(str(trace_dir)).header
    assert (header["vllm_version"], header["vllm_verified"]) == ("0.31.0", True)
    assert header["cache_hit_alignment_tokens"] is None  # 0.31.0 has no such field
    assert _first_mismatch(trace_dir) == (2, 277, "never_offered")


LOAD_1000 = """
import json
from keytrace.analysis.geometry import HYBRID
from keytrace.vllm.lab.harness import Harness
with Harness(HYBRID, max_prompt_tokens=1000) as h:
    r = h.scenario(1000)
    print(json.dumps({"external": r.external_tokens, "loads": h.worker.loads_issued}))
"""


def test_0_31_loads_what_it_stored() -> None:
    """0.31.0's load jobs have no ``sync`` field (every load is asynchronous there): the
    harness loads the resend's 960 tokens (15 full-attention chunks of 64) from its CPU
    tier as on later releases."""
    r = run_python(LOAD_1000, release="0.31.0")
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["external"] == 960 and found["loads"] > 0


def test_doctor_on_0_31_records_and_refuses_what_it_lacks() -> None:
    code, found = doctor(release="0.31.0")
    caps = capability_table(found)
    assert code == 0 and found["vllm"]["version"] == "0.31.0" and found["vllm"]["verified"]
    assert found["vllm"]["path"].endswith("vllm-0.31.0-src/vllm")
    assert caps["record"] and caps["alarm"] and caps["metrics"] and caps["harness"]
    # 0.31.0's store mask is 0.33.0's, byte for byte; the other fixes replace code it lacks
    assert caps["inject:pre48911"] and caps["fix:mtp_left_chunk"]
    reasons = {c["name"]: c["reason"] for c in found["capabilities"]}
    assert reasons["fix:window_minus_one"] == (
        "hook point vllm.distributed.kv_transfer.kv_connector.v1.offloading.config."
        "get_sliding_window_size_in_chunks is missing"
    )
    assert (
        "OffloadingConnectorScheduler._build_store_jobs differs from the code keytrace "
        in (reasons["fix:eagle_proof_key"])
    )


@pytest.mark.parametrize("release", ["0.29.0", "0.30.0"])
def test_doctor_refuses_releases_without_key_positions(release: str) -> None:
    code, found = doctor(release=release)
    record = next(c for c in found["capabilities"] if c["name"] == "record")
    assert code == 2 and not found["can_record"] and found["vllm"]["version"] == release
    assert record["reason"].startswith(
        "ReqContext.get_offload_key_position (vLLM 0.31.0+) is missing"
    )


PLUGIN_REFUSES = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from keytrace.vllm.hook import patches
print("installed:", patches.install({out!r}))
"""


def test_recording_on_0_29_patches_nothing_and_says_why(tmp_path: Path) -> None:
    r = run_python(PLUGIN_REFUSES.format(out=str(tmp_path / "t")), release="0.29.0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "installed: False" in r.stdout
    [line] = [x for x in r.stdout.splitlines() if x.startswith("keytrace: cannot hook")]
    assert line.startswith(
        "keytrace: cannot hook installed vLLM 0.29.0 (ReqContext.get_offload_key_position "
        "(vLLM 0.31.0+) is missing"
    )
    assert not (tmp_path / "t").exists()


SOURCE_BUILD = "0.33.1.dev3+g96039d055.d20261201"
"""Three commits after the v0.33.0 tag, dirty tree (the other spellings setuptools_scm
makes, rc tags and platform labels, are parsed in tests/unit/test_support.py)."""


def test_a_source_build_records_and_judges_as_the_release(tmp_path: Path) -> None:
    version = SOURCE_BUILD
    found, trace_dir = _record_17975(tmp_path, version=version)
    assert found == STOCK_17975
    header = open_trace(str(trace_dir)).header
    assert (header["vllm_version"], header["vllm_verified"]) == (version, False)
    assert _first_mismatch(trace_dir) == (2, 277, "never_offered")


def test_doctor_on_a_source_build_is_the_release_s(tmp_path: Path) -> None:
    code, release = doctor()
    code_sb, built = doctor(version=SOURCE_BUILD)
    assert (code, code_sb) == (0, 0)
    assert (built["vllm"]["kind"], built["vllm"]["verified"]) == ("source build", False)
    assert capability_table(built) == capability_table(release)
    assert all(capability_table(built).values())


def test_a_platform_build_of_the_release_runs_the_harness(tmp_path: Path) -> None:
    """``0.33.0+cpu`` is 0.33.0's code: verified, the harness runs, the verdict is 0.33.0's."""
    found, trace_dir = _record_17975(tmp_path, version="0.33.0+cpu")
    assert found == STOCK_17975
    assert open_trace(str(trace_dir)).header["vllm_verified"] is True
