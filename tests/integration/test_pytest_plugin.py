"""``pytest --keytrace DIR`` (keytrace.vllm.hook.pytest_plugin), in a pytest of its own: inert
without the flag; with it, one trace folder per test, a keytrace section in a failing test's
report, one summary line. (vLLM's own suite through the plugin: tools/vllm_suite.py
--record plugin, run by .ci/run.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.vllm.hook.pytest_plugin import folder_name  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import sys

from keytrace.analysis.geometry import DSV4, SMALL
from keytrace.vllm.lab.harness import Harness


def test_recorder_not_loaded():
    assert "keytrace.vllm.hook.patches" not in sys.modules, "the plugin loaded the recorder"


def test_stock_miss_fails():
    h = Harness(DSV4, max_prompt_tokens=18_000)
    result = h.scenario(17_975)  # store, reset the GPU prefix cache, look up again
    h.close()
    assert result.external_tokens > 0, "the second request should have loaded from the CPU"


def test_small_agrees():
    h = Harness(SMALL)
    assert h.scenario(1000).external_tokens > 0
    h.close()


def test_no_scheduler():
    assert 1 + 1 == 2
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_cases.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    env.update(PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_cases.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )


def test_inert_without_the_flag(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "-k", "recorder_not_loaded or no_scheduler")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "2 passed" in r.stdout and "keytrace:" not in r.stdout


def test_one_trace_per_test_and_the_verdict_of_a_failing_test(tmp_path: Path) -> None:
    out = tmp_path / "kt"
    r = _pytest(tmp_path, "--keytrace", str(out), "-k", "not recorder_not_loaded")
    # outcomes are the test's own: one failure (its assert), two passes
    assert r.returncode == 1 and "1 failed, 2 passed" in r.stdout, r.stdout[-3000:]
    assert "AssertionError: the second request should have loaded from the CPU" in r.stdout
    nodes = {
        name: f"test_cases.py::{name}"
        for name in ("test_stock_miss_fails", "test_small_agrees", "test_no_scheduler")
    }
    folders = {name: out / folder_name(node) for name, node in nodes.items()}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f.name for n, f in folders.items() if n != "test_no_scheduler"
    )
    assert folder_name(nodes["test_small_agrees"]).startswith("test_cases.py-test_small_agrees-")
    # each folder is a complete trace of its own test, judged as `keytrace diff` would
    miss = diff(open_trace(str(folders["test_stock_miss_fails"])))
    assert miss.first_mismatch is not None
    assert miss.first_mismatch.evidence() == (2, 277, "never_offered")
    assert diff(open_trace(str(folders["test_small_agrees"]))).first_mismatch is None
    # the failing test's report carries the verdict and its first mismatch
    section = r.stdout[r.stdout.index("keytrace ---") :]
    assert "MISMATCH: request " in section and "binding group 2 (SWA, MTP)" in section
    assert f"(keytrace diff {folders['test_stock_miss_fails']})" in section
    assert (
        f"keytrace: 2 of 3 tests recorded a trace under {out} " in r.stdout
        and "0 recorder failures); 1 failing test(s) diffed: 1 MISMATCH" in r.stdout
    )
