"""Sweep tables: length specs, and CSV/Parquet output whose leading rows hold nulls."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from keytrace.analysis.sweep import SweepRow, parse_lengths
from keytrace.report.table import write_rows


def test_parse_lengths() -> None:
    assert parse_lengths("10:14") == [10, 11, 12, 13, 14]
    assert parse_lengths("10:20:5,7, 1_000") == [10, 15, 20, 7, 1000]
    assert parse_lengths("1,,2") == [1, 2] and parse_lengths("5:5") == [5]
    for bad, message in (
        ("", "no lengths given"),
        (" , ", "no lengths given"),
        ("a", "bad length 'a': use N, N,M or START:STOP[:STEP]"),
        ("5:1", "bad range '5:1': need start <= stop and step > 0"),
        ("1:5:0", "bad range '1:5:0': need start <= stop and step > 0"),
    ):
        with pytest.raises(ValueError) as e:
            parse_lengths(bad)
        assert str(e.value) == message


def test_write_rows_with_null_leading_columns(tmp_path: Path) -> None:
    hits = [
        SweepRow(n, 8192, 1, 1024, 1024, "hit", None, None, None, 0.1) for n in range(1030, 1130)
    ]
    miss = SweepRow(1153, 8192, 1, 1152, 0, "mismatch", 2, 69, "never_offered", 0.1)
    rows = [*hits, miss]  # 100 rows without a binding group before the first with one
    write_rows(rows, csv_path=str(tmp_path / "s.csv"), parquet_path=str(tmp_path / "s.parquet"))
    df = pl.read_parquet(tmp_path / "s.parquet")
    assert (
        df.height == 101
        and df["binding_group"].to_list()[-1] == 2
        and df["cause"].null_count() == 100
    )
    assert (tmp_path / "s.csv").read_text().splitlines()[
        -1
    ] == "1153,8192,1,1152,0,mismatch,2,69,never_offered,0.1"


def test_a_length_is_at_least_one_token() -> None:
    for bad in ("0", "0:8", "5,0"):
        with pytest.raises(ValueError, match="bad length 0: a prompt has at least 1 token"):
            parse_lengths(bad)


@pytest.mark.parametrize("quiet", [False, True])
def test_sweep_says_how_many_lengths_mismatch(
    quiet: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One summary line after the table, and with --quiet instead of it: exit 1 always
    comes with the line that says why."""
    import keytrace.vllm.lab.sweep as lab
    from keytrace.cli import main

    def fake(geo: object, lengths: list[int], **kw: object) -> list[SweepRow]:
        miss = SweepRow(1028, 512, 1, 1024, 0, "mismatch", 2, 64, "never_offered", 0.1)
        return [miss] + [
            SweepRow(n, 512, 1, 1024, 1024, "hit", None, None, None, 0.1) for n in lengths[1:]
        ]

    monkeypatch.setattr(lab, "run_sweep", fake)
    argv = ["sweep", "--geometry", "small", "--lengths", "1028:1036:4", "--no-progress"]
    assert main(argv + (["--quiet"] if quiet else [])) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "1 of 3 lengths mismatch: binding group 2, cause never_offered"
    assert len(out) == (1 if quiet else 5)  # the header, three rows and the line
