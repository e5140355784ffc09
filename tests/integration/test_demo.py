"""`keytrace demo` runs the whole loop on the real scheduler and says what it found."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from tests.conftest import require_vllm
from tests.isolation import foreign_lines, run_keytrace_clean

require_vllm()

from keytrace.cli import main  # noqa: E402


def test_demo_whole_loop(tmp_path: Path) -> None:
    # a fresh process in a clean environment, as a user runs it: nothing exported (vLLM
    # resolves its platform and configures its logging at its first import)
    out = tmp_path / "demo"
    r = run_keytrace_clean("demo", "--out", str(out), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    # only keytrace's own lines on stderr: vLLM's and torch's start-up chatter is routed away
    assert foreign_lines(r.stderr) == [], r.stderr
    assert len(r.stderr.splitlines()) <= 10, r.stderr
    text = r.stdout
    blocks = text.split("\n== ")
    assert blocks[1].startswith("injected pre48911: 18,877 tokens -> 0 external tokens")
    assert "MISMATCH" in blocks[1] and "binding group 2 (SWA, MTP), terminal chunk 292" in blocks[1]
    assert (
        blocks[2].startswith("stock: 18,877 tokens -> 18,688 external tokens")
        and "AGREE" in blocks[2]
    )
    assert (
        blocks[3].startswith("stock: 17,975 tokens -> 0 external tokens")
        and "terminal chunk 277" in blocks[3]
    )
    files = set(os.listdir(out))
    assert {"sweep.csv", "sweep.png", "sweep.svg", "chunkmap-dsv4-17975-stock.html"} <= files
    import vllm  # the plot names the vLLM the demo ran on

    assert f"stock vLLM {vllm.__version__}, dsv4: " in (out / "sweep.svg").read_text()
    assert "chunk map   chunkmap-dsv4-17975-stock.html" in text
    page = (out / "chunkmap-dsv4-17975-stock.html").read_text()
    assert '"terminal":{"group":2,"chunk":277' in page
    fixture = [f for f in files if f.startswith("test_keytrace_") and f.endswith(".py")]
    assert len(fixture) == 1
    compile((out / fixture[0]).read_text(), fixture[0], "exec")
    # 63 lengths: every mismatch satisfies the stock rule (P mod 256 in [1, 63])
    with open(out / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 63
    for row in rows:
        assert (row["verdict"] == "mismatch") == (1 <= int(row["length"]) % 256 <= 63), row
    bad = sum(row["verdict"] == "mismatch" for row in rows)
    assert (
        f"sweep of stock vLLM: {bad} of 63 lengths mismatch, binding group 2 (SWA, MTP), "
        "cause never_offered" in text
    )
    # the next steps name commands that exist, on the demo's own 17,975 trace
    assert f"keytrace report {out}/trace-dsv4-17975-stock -o report --fix eagle_proof_key" in text


def test_demo_refuses_a_non_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
