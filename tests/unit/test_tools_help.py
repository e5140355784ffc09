"""Every tool in tools/ answers ``--help`` with its usage and exit 0, and does nothing else
(a tool that regenerates committed files must not run on ``--help``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
NEED_VLLM_TO_IMPORT = {"fuzz_evicting.py"}
"""Tools that import the lab (vLLM) before parsing: their help is checked where vLLM is."""


@pytest.mark.parametrize("tool", sorted(p.name for p in TOOLS.glob("*.py")))
def test_help_exits_0_with_usage(tool: str, tmp_path: Path) -> None:
    if tool in NEED_VLLM_TO_IMPORT:
        pytest.importorskip("vllm")
    before = sorted(p.name for p in TOOLS.parent.joinpath("tests", "data").iterdir())
    run = subprocess.run(
        [sys.executable, str(TOOLS / tool), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:")
    assert sorted(p.name for p in TOOLS.parent.joinpath("tests", "data").iterdir()) == before
