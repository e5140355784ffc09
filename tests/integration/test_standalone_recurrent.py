"""The standalone vLLM regression for recurrent findings (`keytrace.report.standalone`, the
recurrent template) inside vLLM's own test trees: generated from traces recorded on the
installed vLLM (0.33.0), copied unchanged into
tests/v1/kv_connector/unit/offloading_connector/ of 0.33.0's sdist (run on the installed
vLLM) and of 0.34.0's (run on its own code), without keytrace on the test's import path.

Red on stock vLLM, both releases, for each reportable recurrent class (docs/findings.md):

- chunks of two blocks, a prompt whose last state ends no chunk (``recurrent``, 760 tokens,
  and ``nemotron_h``'s prefill checkpoints, 760 tokens): ``assert 0 >= 640``;
- decode context parallelism 2, the fuzzer's shrunk case (one recurrent group and full
  attention, budget 128, 193 tokens): ``assert 0 >= 128``.

Green where vLLM serves the resend (the same geometries at 700 tokens, whose state ends a
chunk), and red again when the control's reset drops the CPU tier too: the test fails
for the right reason, and only for it. Prefill checkpoints at a partial tail (``nemotron_h``, hash unit
16) have no verdict, so `keytrace report` writes no test for them; the template on that
trace's plan shows the release difference (0.33.0 loads 0, 0.34.0 the tail).

All files of a release run in one pytest process (each test builds its own scheduler).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import NEMOTRON_H, RECURRENT, Geometry, GroupGeom  # noqa: E402
from keytrace.analysis.plan import plan_from_trace  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.report.standalone import (  # noqa: E402
    regression_name,
    render_vllm_regression,
    unsupported,
)
from keytrace.vllm.lab.replay import replay  # noqa: E402
from tests.integration.vllm_builds import release_sources  # noqa: E402

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
from vllm_sdist import CONFCUTDIR, OFFLOADING_SUITE, hf_home, prepare  # noqa: E402
from vllm_suite import LAB_PLATFORM  # noqa: E402

pytestmark = pytest.mark.vllm

DCP_SHRUNK = Geometry(
    name="fuzz_dcp",
    groups=(GroupGeom("mamba", 64), GroupGeom("full_attention", 64)),
    max_num_batched_tokens=128,
    max_model_len=16_384,
    cpu_chunks=20_000,
    dcp=2,
)
"""`keytrace fuzz --recurrent --seed 1`'s shrunk case: one recurrent group and full
attention, DCP 2 (full-attention chunks of 128 tokens), budget 128."""


@dataclass(frozen=True)
class Case:
    geometry: Geometry
    length: int
    verdict: str
    """keytrace's verdict on the recorded trace."""
    red: tuple[str, ...]
    """Releases the generated test must fail on (the assertion: `message`)."""
    message: str = ""
    drop_cpu_tier: bool = False
    """Edit the generated file so its reset drops the CPU tier too (a broken test: what
    the prompt stored is gone)."""


CASES = {
    "bpc2_760": Case(
        RECURRENT.with_(blocks_per_chunk=2), 760, "mismatch", ("0.33.0", "0.34.0"), "0 >= 640"
    ),
    "checkpoints_bpc2_760": Case(
        NEMOTRON_H.with_(blocks_per_chunk=2), 760, "mismatch", ("0.33.0", "0.34.0"), "0 >= 640"
    ),
    "dcp2_193": Case(DCP_SHRUNK, 193, "mismatch", ("0.33.0", "0.34.0"), "0 >= 128"),
    "bpc2_700": Case(RECURRENT.with_(blocks_per_chunk=2), 700, "hit", ()),
    "dcp2_700": Case(RECURRENT.with_(dcp=2), 700, "hit", ()),
    "bpc2_700_cpu_tier_dropped": Case(
        RECURRENT.with_(blocks_per_chunk=2),
        700,
        "hit",
        ("0.33.0", "0.34.0"),
        "0 >= 640",
        drop_cpu_tier=True,
    ),
    "checkpoint_tail_700": Case(
        NEMOTRON_H.with_(prefix_match_unit=16), 700, "no_verdict", ("0.33.0",), "0 >= 640"
    ),
}

GPU_RESET = "assert scheduler.reset_prefix_cache()"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Case name -> (file name, text), each rendered from its recorded trace."""
    out = {}
    for name, case in CASES.items():
        d = tmp_path_factory.mktemp(name) / "trace"
        assert replay(case.geometry, [case.length], case.length, trace_dir=d).verdict == (
            case.verdict
        )
        plan = plan_from_trace(open_trace(str(d)))
        assert unsupported(plan) is None
        text = render_vllm_regression(plan, evidence=f"recorded: {case.verdict}")
        assert "keytrace" not in "".join(
            line for line in text.splitlines() if line.startswith(("import", "from"))
        )
        if case.drop_cpu_tier:
            assert GPU_RESET in text
            text = text.replace(
                GPU_RESET, "assert scheduler.reset_prefix_cache(reset_connector=True)"
            )
        file_name = regression_name(plan, text).replace(".py", f"_{name}.py")
        out[name] = (file_name, text)
    return out


def _run_in_vllm(
    release: str, tree: Path, files: dict[str, tuple[str, str]], tmp: Path, sources: bool
) -> dict[str, tuple[str, str]]:
    """Run every generated file in ``tree``'s offloading suite folder in one pytest process;
    case name -> (outcome, failure text). ``sources``: the tree's own ``vllm/`` is imported
    (0.34.0), with keytrace's lab platform row (0.34.0 refuses an x86 CPU without
    triton-cpu while it builds any ``VllmConfig``; no kernel runs here)."""
    folder = tree / OFFLOADING_SUITE
    junit = tmp / "junit.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", HF_HOME=str(hf_home(tmp / "hf")))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *(f"{OFFLOADING_SUITE}/{f}" for f, _ in files.values()),
        f"--confcutdir={CONFCUTDIR}",
        f"--junitxml={junit}",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if sources:
        (tmp / "kt_lab_platform.py").write_text(LAB_PLATFORM)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tmp)])
        cmd += ["-p", "kt_lab_platform"]
    version = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert version.stdout.split()[-1:] == [release], version.stdout + version.stderr
    for file_name, text in files.values():
        (folder / file_name).write_text(text)
    try:
        r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for file_name, _ in files.values():
            (folder / file_name).unlink()
    assert junit.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    by_file = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        error = case.find("error")
        outcome = "failed" if failure is not None else "error" if error is not None else "passed"
        text = failure if failure is not None else error
        by_file[str(case.get("classname")).rsplit(".", 1)[-1]] = (
            outcome,
            "" if text is None else f"{text.get('message')}\n{text.text}",
        )
    return {
        name: by_file.get(f.removesuffix(".py"), ("missing", r.stdout[-3000:]))
        for name, (f, _) in files.items()
    }


@pytest.fixture(scope="module")
def outcomes(
    generated: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, tuple[str, str]]]:
    """Release -> case name -> (outcome, failure text)."""
    tree, _ = prepare()
    src = release_sources("0.34.0")
    return {
        "0.33.0": _run_in_vllm("0.33.0", tree, generated, tmp_path_factory.mktemp("run033"), False),
        "0.34.0": _run_in_vllm("0.34.0", src, generated, tmp_path_factory.mktemp("run034"), True),
    }


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_red_exactly_where_vllm_loads_less_than_e(
    name: str, release: str, outcomes: dict[str, dict[str, tuple[str, str]]]
) -> None:
    case = CASES[name]
    outcome, text = outcomes[release][name]
    if release in case.red:
        assert outcome == "failed", text
        assert f"assert {case.message}" in text, text
    else:
        assert outcome == "passed", text
