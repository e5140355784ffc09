"""Generated traces of many engines (`tools/gen_trace.py`, run as a user would run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fleet_trace(
    out: Path, *, rows: int, engines: int, planted: int, seed: int, misroute: float = 0.0
) -> Path:
    """Write a generated fleet trace to ``out`` (its planted mismatches beside it, in
    ``out.planted.json``) and return ``out``."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gen_trace.py"),
            str(out),
            *("--rows", str(rows), "--engines", str(engines), "--planted", str(planted)),
            *("--seed", str(seed), "--misroute", str(misroute)),
        ],
        check=True,
        capture_output=True,
    )
    return out
