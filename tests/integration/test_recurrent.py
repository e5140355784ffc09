"""Recurrent state groups (Mamba, gated DeltaNet) on the real scheduler: recorded, and
judged by nothing until keytrace has rules for them (issue 39).

vLLM offloads a recurrent group's state as a checkpoint at chosen boundaries (the core's
boundary hand-offs in ``align`` cache mode), not chunk by chunk, and looks it up with a
window of one chunk. keytrace's store/lookup rules describe attention groups; on a trace
with a recurrent group they would judge another model, so the differ, the reporters, the
lab commands and the live alarm claim no verdict, while the trace records everything.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import RECURRENT, synthetic_header  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.live.registry import AlarmSettings, forget_alarms  # noqa: E402
from keytrace.vllm.hook import hooks  # noqa: E402
from keytrace.vllm.hook.patches import recording  # noqa: E402
from keytrace.vllm.lab.harness import Harness  # noqa: E402

BPC2 = RECURRENT.with_(blocks_per_chunk=2)
"""Chunks of two blocks: a recurrent state is stored only at a multiple of the chunk
(``_build_aligned_boundary_store_jobs``), and a prompt's last state sits at
``(P - 1) // 64 * 64``."""


def _prime_and_resend(d: Path, n: int, caplog: pytest.LogCaptureFixture) -> tuple[int, list]:
    forget_alarms()
    hooks._UNJUDGED_SAID = False
    with caplog.at_level(logging.WARNING, logger="keytrace"):
        with recording(d, AlarmSettings(warn=True, keep_judged=True)) as recs:
            h = Harness(BPC2, max_prompt_tokens=n)
            h.submit_tokens(h.tokens(n, chain=0))
            h.run_until_idle(give_up=True)
            h.reset_gpu_prefix_cache()
            rid = h.submit_tokens(h.tokens(n, chain=0))
            h.run_until_idle(give_up=True)
            listeners = [r.listener for r in recs]
        h.close()
    return h.observations[rid].external_tokens, listeners


def test_a_recurrent_trace_is_recorded_and_gets_no_verdict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # GIVEN a 760-token prompt stored, then resent: its last state (at 704) is no multiple
    # of the 128-token chunk, so vLLM stored none, while full attention stored 5 chunks
    external, listeners = _prime_and_resend(tmp_path / "t", 760, caplog)
    assert external == 0  # vLLM's own answer: the resend loads nothing
    # THEN the live alarm does not judge the engine, and says so once; recording goes on
    assert listeners == [None]
    said = [r for r in caplog.records if "does not judge this engine" in r.getMessage()]
    assert len(said) == 1 and "recurrent state groups 0, 1, 2" in said[0].getMessage()
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
    # AND keytrace diff claims no verdict: exit 2, its first line says why
    assert main(["diff", str(tmp_path / "t")]) == 2
    out = capsys.readouterr()
    assert out.out.startswith("NO VERDICT: keytrace has no rules for what this trace holds")
    assert "MISMATCH" not in out.out and "AGREE" not in out.out
    assert "no verdict" in out.err
    assert main(["diff", "--json", str(tmp_path / "t")]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "no_verdict" and report["first_mismatch"] is None
    assert report["rules"]["trust"] == "uncovered"
    assert report["rules"]["uncovered"] == ["recurrent state groups 0, 1, 2"]
    assert main(["diff", "--by", "engine", str(tmp_path / "t")]) == 2
    assert "AGREE" not in capsys.readouterr().out


def test_no_agree_where_vllm_hits_either(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # 700 tokens: the last state (at 640) is on a chunk boundary and the resend loads it
    external, _ = _prime_and_resend(tmp_path / "t", 700, caplog)
    assert external == 640
    assert main(["diff", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().out.startswith("NO VERDICT")


def test_the_lab_commands_say_no_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--geometry", "recurrent", "--lengths", "700", "--no-progress"]) == 2
    out = capsys.readouterr()
    assert "no_verdict" in out.out and "mismatch" not in out.out
    assert "no verdict: geometry recurrent" in out.err


def test_partial_tails_are_recorded_at_their_boundary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --prefix-match-unit 16 below the 64-token block, vLLM's partial tails are on:
    a resend of 700 tokens loads up to the last hash boundary before its last token,
    688, past the last chunk end (640). The recorder writes the boundary's lookups and
    stores as rows at their position (no chunk: 688 ends no chunk), for every group."""
    from keytrace.analysis import frames
    from keytrace.analysis.geometry import geometry_from_header
    from keytrace.vllm.lab.replay import replay

    partial = RECURRENT.with_(prefix_match_unit=16)
    r = replay(partial, [700], 700, trace_dir=tmp_path / "t")
    assert r.external_tokens == 688  # vLLM's own answer
    trace = open_trace(str(tmp_path / "t"))
    header = trace.header
    assert header["supports_partial_tail"] is True and header["tokens_per_hash"] == 16
    assert header["recurrent"]["partial_tail_block_size"] == 64
    assert geometry_from_header(header).prefix_match_unit == 16  # replay rebuilds it
    stores = trace.collect("store").to_dicts()
    at_688 = {(s["group_id"], s["event"]) for s in stores if s["end_token"] == 688}
    assert {(g, "completed") for g in range(4)} <= at_688
    assert all(s["chunk_idx"] is None for s in stores if s["end_token"] == 688)
    last = frames.lookups(trace).collect().to_dicts()
    resend = max(row["s"] for row in last)
    hits = {row["gid"] for row in last if row["s"] == resend and row["end_token"] == 688}
    assert hits == {0, 1, 2, 3}
    assert main(["diff", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().out.startswith("NO VERDICT")
