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
    # (the true range is 1..63: the ends are said to be as sampled)
    assert (
        "**mismatch iff P mod 256 in {23..55} as sampled (residues 0..22 and 56..86 were not "
        "swept: a range may reach into them): holds for all 16 swept lengths**"
    ) in md
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


def test_report_of_a_stalled_request_on_a_tiered_manager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiered livelock (547 tokens, 13 chunks at once, a 12-chunk CPU tier over an fs
    tier): the report replays it at CPU tier sizes 11-14, with and without the candidate
    fix, and writes the manager-level test for vLLM's tiering suite."""
    from keytrace.vllm.lab.config import tiered

    d = tmp_path / "t"
    geo = tiered(builtin("small").with_(cpu_chunks=12), ("fs",))
    replay(geo, [547], 547, trace_dir=d)
    out = tmp_path / "r"
    assert main(["report", str(d), "-o", str(out), "--fix", "promotion_pins_prefix"]) == 1
    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert md.startswith("# KV offload livelock: a request on a tiered manager")
    assert "a 12-chunk CPU tier over a `fs` tier" in md
    rows = (out / "capacity.csv").read_text().splitlines()
    assert rows[0] == "cpu_chunks,verdict,external,fixed_verdict,fixed_external"
    got = {int(r.split(",")[0]): r.split(",")[1:] for r in rows[1:]}
    assert sorted(got) == [11, 12, 13, 14]
    assert got[12][:2] == ["stalled", "0"] and got[12][2] == "explained"
    assert got[13] == ["hit", "512", "hit", "512"] and got[14][0] == "hit"
    standalone = [p for p in out.iterdir() if p.name.startswith("test_offload_regression_547_")]
    assert len(standalone) == 1 and "NUM_PRIMARY_CHUNKS = 12" in standalone[0].read_text()
    assert "cpu    12 stalled, 0 external; with the fix explained" in printed
