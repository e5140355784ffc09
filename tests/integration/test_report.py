"""`keytrace report` on a real-scheduler recording of the stock 17,975-token miss: the
Markdown (geometry, episode, evidence, failing-length rule, minimal case), the plot, the
sweep table, the regression test and the chunk map; exit 2 when there is nothing to report."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import builtin  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.vllm.lab.replay import replay  # noqa: E402


def test_report_of_the_17975_miss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "t"
    replay(builtin("dsv4"), [17_975], 17_975, trace_dir=d)
    out = tmp_path / "r"
    assert main(["report", str(d), "-o", str(out), "--sweep-points", "16"]) == 1
    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert md.startswith("# KV offload store/lookup mismatch: SWA, MTP group 2, never_offered")
    assert "| 2 | sliding_window | 64 | 64 | 128 | yes |" in md
    assert "| r2 | 17,975 | 0 | 17,920 | 17,920 | 0 |" in md
    assert "terminal key chunk 277 (tokens 17,728–17,792) looked up as MISS" in md
    # 16 lengths over two periods of A = 256, every 32 tokens: residues 55 and 23 fail
    assert "**mismatch iff P mod 256 in {23..55}: holds for all 16 swept lengths**" in md
    assert "2 groups [g0 mla" in md and " MTP]" in md
    fixture = [p for p in out.iterdir() if p.name.startswith("test_keytrace_recorded_17975_")]
    assert len(fixture) == 1 and f"[`{fixture[0].name}`]" in md
    compile(fixture[0].read_text(), fixture[0].name, "exec")
    standalone = [p for p in out.iterdir() if p.name.startswith("test_offload_regression_17975_")]
    assert len(standalone) == 1 and f"[`{standalone[0].name}`]" in md
    assert "EXPECTED_EXTERNAL_TOKENS = 17920" in standalone[0].read_text()
    for name in ("sweep.png", "sweep.csv", "chunkmap.html"):
        assert (out / name).stat().st_size > 0
    assert (out / "minimal-trace").is_dir()
    assert f"report      {out / 'report.md'}" in printed
    # a non-empty folder is refused; so is a trace without a mismatch
    assert main(["report", str(d), "-o", str(out)]) == 2
    hit = tmp_path / "hit"
    replay(builtin("dsv4"), [18_000], 18_000, trace_dir=hit)
    assert main(["report", str(hit), "-o", str(tmp_path / "r2"), "--no-minimize"]) == 2
    assert "no mismatch" in capsys.readouterr().err


def test_report_with_a_candidate_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--fix sweeps the same lengths again with the fix: eagle_proof_key closes every
    failing one at E and breaks none."""
    d = tmp_path / "t"
    replay(builtin("dsv4"), [17_975], 17_975, trace_dir=d)
    out = tmp_path / "r"
    args = ["report", str(d), "-o", str(out), "--sweep-points", "16", "--no-minimize"]
    assert main([*args, "--fix", "eagle_proof_key"]) == 1
    printed = capsys.readouterr().out
    line = "with fix eagle_proof_key: 4 of 4 failing lengths hit (4 reach E), no new mismatch among 16 lengths"
    assert f"  fix       {line}" in printed
    md = (out / "report.md").read_text()
    assert "## Candidate fix `eagle_proof_key`" in md
    assert "**4 of 4 failing lengths hit** (4 reach E), no new mismatch." in md
    assert "is green with it: `KEYTRACE_FIX=eagle_proof_key python -m pytest test_keytrace_" in md
    assert (out / "sweep-fix.csv").stat().st_size > 0
