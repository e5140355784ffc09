"""Regenerate tests/data/v<SCHEMA_VERSION>/ from the real recorder on the real scheduler.

Run once per schema version (the committed trace of an older version is never rewritten):

    python tools/regen_test_data.py

It records the `small` geometry at 1,030 prompt tokens (a stock vLLM 0.33.0 miss: the
MTP group's peek chunk is not keyable) and compacts it to one file per row kind.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from keytrace.analysis.geometry import SMALL
from keytrace.format.compact import compact
from keytrace.format.schema import SCHEMA_VERSION
from keytrace.vllm.lab.sweep import run_one


def main() -> int:
    out = os.path.join(os.path.dirname(__file__), "..", "tests", "data", f"v{SCHEMA_VERSION}")
    out = os.path.normpath(out)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw")
        row = run_one(SMALL, 1030, keep_dir=raw)
        print(
            f"recorded: verdict {row.verdict}, E {row.E}, external {row.external}", file=sys.stderr
        )
        shutil.rmtree(out, ignore_errors=True)
        result = compact([raw], out)
    for kind, rows in result.rows.items():
        print(f"{kind:8} {rows:6} rows -> {result.files[kind]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
