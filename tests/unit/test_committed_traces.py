"""Every released schema version's committed trace still reads and diffs the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from keytrace.analysis.diff import diff
from keytrace.cli import main
from keytrace.format.reader import open_trace

DATA = Path(__file__).resolve().parents[1] / "data"


def test_v1_trace_reads_and_diffs(capsys: pytest.CaptureFixture[str]) -> None:
    # Recorded by tools/regen_test_data.py from the real scheduler: small geometry, 1,030
    # tokens. E = round_down(1,029, 64) = 1,024; the MTP group's peek chunk 64 would end at
    # 1,040 > 1,030, so lookup needs 61-63 and the store kept 62, 63 (+ the unkeyable 64).
    trace = open_trace(str(DATA / "v1"))
    assert trace.header["vllm_version"] == "0.33.0"
    # no load rows: the resend loaded nothing
    assert sorted(trace.kinds) == ["episode", "lookup", "step", "store"]
    report = diff(trace)
    v = report.first_mismatch
    assert v is not None
    assert (v.E, v.external_tokens, v.binding_group, v.terminal.chunk, v.terminal.cause) == (
        1024,
        0,
        2,
        61,
        "never_offered",
    )
    assert (
        main(
            [
                "diff",
                str(DATA / "v1" / "store.parquet"),
                str(DATA / "v1" / "lookup.parquet"),
                str(DATA / "v1" / "episode.parquet"),
            ]
        )
        == 1
    )
    assert "store wrote 62–63 near there" in capsys.readouterr().out
