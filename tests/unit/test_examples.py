"""The runnable examples run and say what they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.isolation import clean_env

ROOT = Path(__file__).resolve().parents[2]


def test_synthetic_example_is_a_mismatch(tmp_path: Path) -> None:
    out = tmp_path / "kt"
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "synthetic_trace.py"), str(out)],
        capture_output=True,
        text=True,
        env=clean_env(),  # as a user runs it: nothing exported
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    d = subprocess.run(
        [sys.executable, "-m", "keytrace.cli", "diff", str(out)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert d.returncode == 1, d.stderr
    assert "binding group 1 (SWA), terminal chunk 4 (MISS)" in d.stdout
