"""`keytrace sweep` through the CLI on the real scheduler: table, files, plot, --from, --inject."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.cli import main  # noqa: E402


def test_sweep_table_files_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "sweep",
            "--lengths",
            "17970:17990:5",
            "--csv",
            str(tmp_path / "s.csv"),
            "--parquet",
            str(tmp_path / "s.parquet"),
            "--plot",
            str(tmp_path / "s"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1  # some length mismatched
    # 17,970..17,980 have P mod 256 in 1..63: mismatch; 17,985 and 17,990 hit
    df = pl.read_parquet(tmp_path / "s.parquet")
    assert df["verdict"].to_list() == ["mismatch"] * 3 + ["hit"] * 2
    assert df.filter(pl.col("verdict") == "mismatch")["terminal_chunk"].to_list() == [277, 277, 277]
    assert "  17,975   8,192   1   17,920         0 mismatch       2     277  never_offered" in out
    assert (tmp_path / "s.csv").read_text().count("\n") == 6
    assert (tmp_path / "s.png").stat().st_size > 1000 and (
        tmp_path / "s.svg"
    ).read_text().startswith("<?xml")


def test_sweep_from_trace_and_inject(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = Path(__file__).resolve().parents[1] / "data" / "v1"  # small geometry, recorded
    assert main(["sweep", "--from", str(data), "--lengths", "1024", "--quiet"]) == 0
    assert (
        main(
            [
                "sweep",
                "--from",
                str(data),
                "--lengths",
                "1024",
                "--inject",
                "pre48911",
                "--parquet",
                str(tmp_path / "i.parquet"),
                "--quiet",
            ]
        )
        == 1
    )
    row = pl.read_parquet(tmp_path / "i.parquet").row(0, named=True)
    assert (row["verdict"], row["binding_group"], row["terminal_chunk"]) == (
        "mismatch",
        2,
        60,
    )  # derived in test_diff_real.py
    assert main(["sweep", "--lengths", "9:1"]) == 2
    assert "bad range" in capsys.readouterr().err


def test_sweep_compare_a_fix_with_stock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # small: A = 64, MTP chunk 16; P mod 64 in 1..15 fails on stock: 1,028, 1,032, 1,036
    args = ["sweep", "--geometry", "small", "--lengths", "1020:1044:4", "--quiet"]
    plot = ["--plot", str(tmp_path / "cmp")]
    assert main([*args[:-1], "--fix", "eagle_proof_key", "--compare", *plot]) == 0
    out = capsys.readouterr().out
    assert (
        "with fix eagle_proof_key: 3 of 3 failing lengths hit (3 reach E), no new mismatch "
        "among 7 lengths" in out
    )
    # the table has stock vLLM's outcome next to the fix's
    assert "   1,028     512   1    1,024     1,024 hit              0 mismatch" in out
    # the plot: stock vLLM's sweep with the fix's external tokens drawn over it
    svg = (tmp_path / "cmp.svg").read_text()
    assert "<!-- external tokens with fix eagle_proof_key -->" in svg
    assert "3 of 7 lengths mismatch; with fix eagle_proof_key: 0 -->" in svg
    assert main([*args, "--fix", "mtp_left_chunk", "--compare"]) == 1
    assert "with fix mtp_left_chunk: 0 of 3 failing lengths hit" in capsys.readouterr().out
    assert main([*args, "--compare"]) == 2  # --compare without a fix


def test_a_full_attention_mtp_group_is_served_one_chunk_below_its_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DeepSeek-V3-like MLA with an MTP draft group on the real scheduler: vLLM serves an
    identical resend one chunk below its last keyed chunk (the drafter's popped peek,
    `keytrace.judge.rules.peek_cap`) and keytrace expects exactly that: E = external, hit,
    exit 0 (before: E at the store boundary, a mismatch with no cause on every length)."""
    code = main(
        [
            "sweep",
            "--geometry",
            "dsv3",
            "--lengths",
            "1000:1024:12",
            "--parquet",
            str(tmp_path / "s.parquet"),
        ]
    )
    capsys.readouterr()
    df = pl.read_parquet(tmp_path / "s.parquet")
    assert code == 0 and df["verdict"].to_list() == ["hit"] * 3
    # 1,000 and 1,012 key 15 chunks of 64 (served 896); 1,024 keys 16 (served 960)
    assert df["external"].to_list() == df["E"].to_list() == [896, 896, 960]


def test_the_sweep_says_when_its_rules_are_unverified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `keytrace diff`'s first line: MLA + MTP under DCP (legacy hashes: its popped
    peek was never checked by the oracle) gets the note once, above the table; MLA alone
    under DCP, verified by the shipped runs, none."""
    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path))  # the shipped runs alone
    for geometry, noted in (("dsv3", True), ("dsv3_mla", False)):
        code = main(["sweep", "--geometry", geometry, "--dcp", "2", "--lengths", "300,500"])
        out = capsys.readouterr().out.splitlines()
        assert code == 0
        notes = [x for x in out if x.startswith("note: verdicts apply rules not verified")]
        if noted:
            assert len(notes) == 1 and out[0] == notes[0]
            assert "decode context parallelism and a full-attention EAGLE/MTP" in notes[0]
        else:
            assert notes == [] and out[0].lstrip().startswith("length")
