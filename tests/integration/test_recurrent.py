"""Recurrent state groups (Mamba, gated DeltaNet) on the real scheduler.

vLLM offloads a recurrent group's state as one checkpoint where a request computed it
(the core's boundary hand-offs in ``align`` cache mode: its last block boundary, a
junction it computed through) and looks it up with a window of one chunk. keytrace judges
that setting (no decode context parallelism or with it, retention 0, no drafter or one
with lookahead hashes, partial tails: tests/integration/test_partial_tails.py), verified by
the oracle per release; the rest is recorded and gets no verdict
(`keytrace.judge.trust.uncovered`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import RECURRENT, Geometry, synthetic_header  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.live.registry import AlarmSettings, forget_alarms  # noqa: E402
from keytrace.vllm.hook.patches import recording  # noqa: E402
from keytrace.vllm.lab.harness import Harness  # noqa: E402

BPC2 = RECURRENT.with_(blocks_per_chunk=2)
"""Chunks of two blocks: a recurrent state is stored only at a multiple of the chunk
(``_build_aligned_boundary_store_jobs``), and a prompt's last state sits at
``(P - 1) // 64 * 64``."""
PARTIAL = RECURRENT.with_(prefix_match_unit=16)
"""A hash unit below the 64-token block: vLLM's partial tails on."""


def _prime_and_resend(
    geometry: Geometry, d: Path, n: int, caplog: pytest.LogCaptureFixture
) -> tuple[int, list]:
    forget_alarms()  # also: the once-per-process 'not judged' warning
    with caplog.at_level(logging.WARNING, logger="keytrace"):
        with recording(d, AlarmSettings(warn=True, keep_judged=True)) as recs:
            h = Harness(geometry, max_prompt_tokens=n)
            h.submit_tokens(h.tokens(n, chain=0))
            h.run_until_idle(give_up=True)
            h.reset_gpu_prefix_cache()
            rid = h.submit_tokens(h.tokens(n, chain=0))
            h.run_until_idle(give_up=True)
            listeners = [r.listener for r in recs]
        h.close()
    return h.observations[rid].external_tokens, listeners


def test_a_state_that_ends_no_chunk_is_never_kept_and_keytrace_names_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # GIVEN a 760-token prompt stored, then resent: its last state (at 704) is no multiple
    # of the 128-token chunk, so vLLM stored none, while full attention stored 5 chunks
    external, listeners = _prime_and_resend(BPC2, tmp_path / "t", 760, caplog)
    assert external == 0  # vLLM's own answer: the resend loads nothing
    # THEN the live alarm judges the engine and warns
    assert listeners != [None]
    warned = [r.getMessage() for r in caplog.records if "mismatch" in r.getMessage().lower()]
    assert warned and "no_checkpoint" in " ".join(warned)
    # AND the header records what decides a recurrent group's checkpoints
    header = open_trace(str(tmp_path / "t")).header
    rec = header["recurrent"]
    assert rec["mamba_cache_mode"] == "align" and rec["mamba_block_size"] == 64
    assert rec["mamba_align_size"] == 128  # the unit a hit is rounded down to
    assert rec["partial_tail_block_size"] == 0 and rec["hash_block_size"] == 64
    assert set(rec["groups"]) == {"0", "1", "2"}
    assert [g["requires_cow_source"] for g in header["groups"]] == [True, True, True, False]
    synthetic = synthetic_header(BPC2)
    for got, want in zip(header["groups"], synthetic["groups"], strict=True):
        for key in ("kind", "spec_class", "window_chunks", "requires_cow_source", "manager_cls"):
            assert got[key] == want[key], key
    # AND keytrace diff names the group, the chunk and why, on rules the oracle verified
    assert main(["diff", "--json", str(tmp_path / "t")]) == 1
    report = json.loads(capsys.readouterr().out)
    first = report["first_mismatch"]
    assert report["rules"]["trust"] == "verified" and report["rules"]["needs"] == ["recurrent"]
    assert first["E"] == 640 and first["external_tokens"] == 0 and first["binding_group"] == 0
    assert first["terminal"]["chunk"] == 4 and first["terminal"]["cause"] == "no_checkpoint"
    assert main(["diff", str(tmp_path / "t")]) == 1
    assert capsys.readouterr().out.startswith("MISMATCH: request ")


def test_a_state_on_a_chunk_end_is_kept_and_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # 700 tokens: the last state (at 640) ends a chunk and the resend loads it
    external, _ = _prime_and_resend(BPC2, tmp_path / "t", 700, caplog)
    assert external == 640
    assert main(["diff", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.startswith("AGREE")


def test_partial_tails_are_recorded_at_their_boundary_and_judged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """With partial tails on, a resend of 700 tokens loads up to the last hash boundary
    before its last token, 688, past the last chunk end (640). The recorder writes the
    boundary's lookups and stores as rows at their position, for every group (no chunk:
    688 ends none); keytrace judges it by the partial-tail rules (`keytrace.judge.partial`):
    E = 688, a hit, on rules the oracle verified for partial tails."""
    from keytrace.analysis import frames
    from keytrace.analysis.geometry import geometry_from_header

    external, listeners = _prime_and_resend(PARTIAL, tmp_path / "t", 700, caplog)
    assert external == 688  # vLLM's own answer
    assert listeners != [None]  # the live alarm judges the engine
    assert not [r for r in caplog.records if "does not judge this engine" in r.getMessage()]
    trace = open_trace(str(tmp_path / "t"))
    header = trace.header
    assert header["supports_partial_tail"] is True and header["tokens_per_hash"] == 16
    assert header["recurrent"]["partial_tail_block_size"] == 64
    # vLLM 0.33.0's inline partial search: the window starts at the complete hit
    assert header["recurrent"]["partial_anchor"] == "complete"
    assert geometry_from_header(header).prefix_match_unit == 16  # replay rebuilds it
    stores = trace.collect("store").to_dicts()
    at_688 = {(s["group_id"], s["event"]) for s in stores if s["end_token"] == 688}
    assert {(g, "completed") for g in range(4)} <= at_688
    assert all(s["chunk_idx"] is None for s in stores if s["end_token"] == 688)
    rows = frames.lookups(trace).collect().to_dicts()
    resend = max(row["s"] for row in rows)
    hits = {row["gid"] for row in rows if row["s"] == resend and row["end_token"] == 688}
    assert hits == {0, 1, 2, 3}  # each group's own lookup row, under its own id
    assert main(["diff", "--json", "--all", str(tmp_path / "t")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rules"]["trust"] == "verified"
    assert report["rules"]["needs"] == ["recurrent", "recurrent+partial"]
    last = report["episodes"][-1]
    assert (last["verdict"], last["E"], last["external_tokens"]) == ("hit", 688, 688)
    assert main(["diff", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.startswith("AGREE")


def test_the_lab_commands_say_no_verdict_where_no_rule_describes_the_geometry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sweep", "--geometry", "recurrent", "--lengths", "700", "--no-progress"]
    assert main([*argv, "--retention-interval", "512"]) == 2
    out = capsys.readouterr()
    *table, summary = out.out.splitlines()
    assert "no_verdict" in out.out and not any("mismatch" in line for line in table)
    assert summary == "0 of 1 length mismatch (1 length not judged: no rules for this geometry)"
    assert "no verdict: geometry recurrent" in out.err
    assert main(argv) == 0  # the rules describe it: judged
    assert " hit" in capsys.readouterr().out
    assert main([*argv, "--prefix-match-unit", "16"]) == 0  # partial tails: judged too
    assert " hit" in capsys.readouterr().out


def test_the_oracle_and_the_alarm_agree_with_the_differ_on_recurrent_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round of `keytrace doctor --verify`'s recurrent layouts (chunks of one and two
    blocks, a CPU and a tiered manager): every shortfall looked up again alone on a fresh
    scheduler agrees with the differ, and the live alarm counts every verdict the same.
    (Its DCP layouts: tests/integration/test_dcp.py.)"""
    from keytrace.vllm.hook.support import vllm_info
    from keytrace.vllm.lab.verify import RECURRENT_LAYOUTS, verify

    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path / "cache"))
    out = verify(layouts=False, dcp=False, retention=False, seeds=1, keep=False, min_episodes=1)
    assert out.episodes >= 30 and out.disagreements == [], out.disagreements
    mtp = [g for g, *_ in RECURRENT_LAYOUTS if g == "recurrent_mtp"]
    if (vllm_info().version or "").startswith(("0.31", "0.32", "0.33")):
        # no lookahead hashes before 0.34.0: the MTP layouts are recorded and not judged
        assert out.workloads == len(RECURRENT_LAYOUTS) - len(mtp)
        assert len(out.skipped) == len(mtp)
        assert all("without lookahead hashes" in s for s in out.skipped), out.skipped
        assert out.covers == ["recurrent"]
    else:
        assert out.workloads == len(RECURRENT_LAYOUTS) and not out.skipped
        assert out.covers == ["recurrent", "recurrent+lookahead"]
    mismatches = sum(r.episodes.get("mismatch", 0) for r in out.runs)
    assert mismatches > 0  # chunks of two blocks: states that end no chunk


def test_the_report_writes_the_vllm_only_test_that_runs_the_core(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A recurrent group's states come from vLLM's core, so the report's vLLM-only test
    for a recurrent finding runs the core (a real ``Scheduler``; red inside vLLM's own
    tree: tests/integration/test_standalone_recurrent.py), beside the keytrace test, and
    report.md says what it runs."""
    _prime_and_resend(BPC2, tmp_path / "t", 760, caplog)
    out = tmp_path / "report"
    argv = ["report", str(tmp_path / "t"), "-o", str(out), "--no-minimize", "--no-progress"]
    assert main(argv) == 1
    names = [p.name for p in out.iterdir()]
    (standalone,) = [n for n in names if n.startswith("test_offload_regression_760_")]
    assert [n for n in names if n.startswith("test_keytrace_recorded_760_")]
    text = (out / standalone).read_text()
    assert "Scheduler(" in text and "EXPECTED_EXTERNAL_TOKENS = 640\n" in text
    md = (out / "report.md").read_text()
    assert "No vLLM-only test" not in md and "it runs the core: a real `Scheduler`" in md
    assert "no_checkpoint" in md.splitlines()[0]


def _send_capped(cap: int) -> None:
    """A 700-token prompt on the partial-tail geometry (its tail boundary T = 688) whose
    request asks ``max_offload_tokens`` = ``cap``, run to the end."""
    h = Harness(PARTIAL, max_prompt_tokens=700)
    try:
        h.submit_tokens(h.tokens(700, chain=0), kv_transfer_params={"max_offload_tokens": cap})
        h.run_until_idle(give_up=True)
    finally:
        h.close()


def test_a_scheduler_error_passes_through_the_recorder_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.33.0 and 0.34.0 stop the scheduler on a request whose ``max_offload_tokens``
    falls below its partial-tail boundary (docs/findings.md; vllm#52397, open): an
    ``AssertionError`` in ``build_connector_meta``, which ends a server's engine core.
    Recording on, the same error reaches the caller from vLLM's own line, nothing is
    caught or counted as keytrace's, and what was recorded before it reads back."""
    from keytrace.analysis import frames

    with (
        caplog.at_level(logging.WARNING, logger="keytrace"),
        pytest.raises(AssertionError) as raised,
        recording(tmp_path / "t") as recs,
    ):
        _send_capped(100)
    frame = raised.traceback[-1]
    assert frame.name == "_build_partial_tail_store_jobs"
    assert "boundary <= max_boundary" in str(frame.statement)
    assert recs and all(r.failures == 0 for r in recs)
    assert not [r for r in caplog.records if "recording failed" in r.getMessage()]
    trace = open_trace(str(tmp_path / "t"))
    assert trace.header["supports_partial_tail"] is True
    episodes = frames.episodes(trace).collect()
    assert episodes.height == 1 and episodes["N"].to_list() == [700]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="vLLM 0.33.0/0.34.0: a max_offload_tokens below the partial-tail boundary fails "
    "`assert boundary <= max_boundary` in _build_partial_tail_store_jobs (vllm#52397, open)",
)
def test_a_store_cap_below_the_partial_tail_keeps_the_scheduler_running() -> None:
    # the request asked that at most 100 tokens be stored: a correct store path stores
    # no 688-token tail (and complete chunks up to 64 at most), and schedules on
    _send_capped(100)
