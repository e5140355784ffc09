"""KEYTRACE_REQUIRE_VLLM=1 turns "vLLM not importable" skips into failures (CI sets it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUNNER = """
import sys
sys.modules["vllm"] = None   # this interpreter has no vLLM
import pytest
sys.exit(pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider", "--rootdir", sys.argv[2]]))
"""

TEST = """
from tests.conftest import require_vllm

def test_needs_vllm():
    require_vllm()
"""


def _run(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "test_needs.py"
    f.write_text(TEST)
    env = {k: v for k, v in os.environ.items() if k != "KEYTRACE_REQUIRE_VLLM"}
    if require is not None:
        env["KEYTRACE_REQUIRE_VLLM"] = require
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", RUNNER, str(f), str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_skips_without_the_variable(tmp_path: Path) -> None:
    r = _run(tmp_path, None)
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout


def test_fails_with_the_variable(tmp_path: Path) -> None:
    r = _run(tmp_path, "1")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout
    assert "KEYTRACE_REQUIRE_VLLM=1" in r.stdout
