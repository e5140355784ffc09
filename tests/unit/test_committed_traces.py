"""Every released schema version's committed trace still reads and diffs the same way."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pytest

from keytrace.analysis.diff import diff
from keytrace.cli import main
from keytrace.format.reader import open_trace
from tests.downgrade import downgrade

DATA = Path(__file__).resolve().parents[1] / "data"

# Every version's trace was recorded by tools/regen_test_data.py from the real scheduler: small
# geometry, 1,030 tokens, the resend of one prompt. E = round_down(1,029, 64) = 1,024; the
# MTP group's peek chunk 64 would end at 1,040 > 1,030, so lookup needs its chunks 61-63 and
# the store kept only 62, 63 (+ the unkeyable 64): terminal = group 2 chunk 61.
EXPECTED = (1024, 0, 2, 61, "never_offered")


def _first(path: Path) -> tuple[int, int | None, int | None, int, str]:
    v = diff(open_trace(str(path))).first_mismatch
    assert v is not None and v.terminal is not None
    return (v.E, v.external_tokens, v.binding_group, v.terminal.chunk, v.terminal.cause)


def test_v1_trace_reads_and_diffs(capsys: pytest.CaptureFixture[str]) -> None:
    trace = open_trace(str(DATA / "v1"))
    assert trace.version == 1
    assert trace.header["vllm_version"] == "0.33.0"
    # no load rows: the resend loaded nothing
    assert sorted(trace.kinds) == ["episode", "lookup", "step", "store"]
    assert _first(DATA / "v1") == EXPECTED
    files = [str(DATA / "v1" / f"{k}.parquet") for k in ("store", "lookup", "episode")]
    assert main(["diff", *files]) == 1
    assert "store wrote 62–63 near there" in capsys.readouterr().out


def test_v1_without_its_episode_rows_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(DATA / "v1" / f"{k}.parquet") for k in ("store", "lookup")]
    assert main(["diff", *files]) == 2
    err = capsys.readouterr().err
    assert "episode" in err and err.count("\n") == 1


def test_v2_trace_reads_and_diffs(capsys: pytest.CaptureFixture[str]) -> None:
    trace = open_trace(str(DATA / "v2"))
    assert trace.version == 2
    assert sorted(trace.kinds) == ["lookup", "step", "store"]
    assert _first(DATA / "v2") == EXPECTED
    files = [str(DATA / "v2" / f"{k}.parquet") for k in ("store", "lookup")]
    assert main(["diff", *files]) == 1
    assert "store wrote 62–63 near there" in capsys.readouterr().out


def test_v3_tiered_trace_reads_and_diffs(capsys: pytest.CaptureFixture[str]) -> None:
    # the same scenario on vLLM's tiering manager (tools/regen_test_data.py): the resend's
    # full-attention keys were evicted from the 24-chunk primary and come back from the
    # example tier by promotion; the MTP rule still loses the whole resend
    trace = open_trace(str(DATA / "v3"))
    assert trace.version == 3
    assert sorted(trace.kinds) == ["lookup", "step", "store", "tier"]
    assert trace.header["offload_spec"] == "TieringOffloadingSpec"
    assert [t["type"] for t in trace.header["secondary_tiers"]] == ["example"]
    assert trace.header["cpu_num_chunks"] == 24
    events = set(trace.collect("tier")["event"].cast(pl.String))
    assert {"cascade_completed", "lookup", "promotion_prepared", "promotion_evicted"} <= events
    assert _first(DATA / "v3") == EXPECTED
    assert main(["diff", str(DATA / "v3")]) == 1
    assert "store wrote 62–63 near there" in capsys.readouterr().out


def test_v4_trace_records_what_requests_asked(capsys: pytest.CaptureFixture[str]) -> None:
    # v3's scenario, then the prompt once more asking max_load_tokens 0 (a request that asked
    # not to load): the cap is in its episode row, and the differ names it, never cold
    trace = open_trace(str(DATA / "v4"))
    assert trace.version == 4
    assert sorted(trace.kinds) == ["lookup", "step", "store", "tier"]
    assert trace.header["lookup_trims_before_caps"] is False  # 0.33.0: after the caps
    assert trace.header["store_threshold"] == 0 and trace.header["max_tracker_size"] is None
    asked = (
        trace.collect("lookup")
        .filter(pl.col("scan") == -1)
        .select(pl.col("req_id").cast(pl.String), "max_load_tokens", "max_offload_tokens")
        .sort("req_id")
        .rows()
    )
    assert asked == [("r1", None, None), ("r2", None, None), ("r3", None, None), ("r4", 0, None)]
    assert _first(DATA / "v4") == EXPECTED
    report = diff(trace, all_episodes=True)
    last = report.episodes[-1]
    assert (last.req_id, last.verdict, last.limit, last.E_free) == (
        "r4",
        "limited",
        "max_load_tokens",
        1024,
    )
    assert report.lost is not None
    assert {r.label for r in report.lost.rows} >= {"by request: max_load_tokens"}
    assert main(["diff", str(DATA / "v4")]) == 1
    capsys.readouterr()


def test_v5_trace_records_a_deferred_release(capsys: pytest.CaptureFixture[str]) -> None:
    # v4's scenario on vLLM 0.34.0's code, with the resend's promotion failing while its
    # tier may still write (a deferred release): the keys leave the primary at once, their
    # slots come back two steps later, both rows naming the promotion's request and job
    trace = open_trace(str(DATA / "v5"))
    assert trace.version == 5
    assert trace.header["vllm_version"] == "0.34.0"
    tier = trace.collect("tier").with_columns(pl.col("event", "req_id").cast(pl.String))
    prepared = tier.filter(pl.col("event") == "promotion_prepared")
    deferred = tier.filter(pl.col("event") == "promotion_deferred")
    released = tier.filter(pl.col("event") == "deferred_released")
    assert deferred.height == released.height == prepared.height == 16
    assert set(deferred["key"]) == set(released["key"]) == set(prepared["key"])
    for rows in (deferred, released):
        assert rows.select("req_id", "tier", "job_id").unique().rows() == [("r3", 0, 4)]
    assert deferred["seq"].max() < released["seq"].min()  # type: ignore[operator]
    assert tier.filter(
        pl.col("event").is_in(["promotion_completed", "promotion_failed"])
    ).is_empty()
    assert _first(DATA / "v5") == EXPECTED
    assert main(["diff", str(DATA / "v5")]) == 1
    capsys.readouterr()


def test_v2_and_its_v1_form_give_identical_verdicts(tmp_path: Path) -> None:
    # the same recording in both layouts: the format change must not move a verdict
    downgrade(str(DATA / "v2"), str(tmp_path))
    old, new = diff(open_trace(str(tmp_path))), diff(open_trace(str(DATA / "v2")))
    assert open_trace(str(tmp_path)).version == 1
    assert old.verdict == new.verdict == "mismatch"
    assert [dataclasses.asdict(v) for v in old.episodes] == [
        dataclasses.asdict(v) for v in new.episodes
    ]
    assert old.lost == new.lost


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "v4", "v5"])
def test_judged_one_episode_at_a_time_the_verdicts_are_the_same(version: str) -> None:
    # batches cut a trace by episode sequence number; the second episode's chain (the
    # first request's stores) lies before its batch (tests/integration/test_diff_batches.py
    # does this on two-engine traffic)
    trace = open_trace(str(DATA / version))
    whole = diff(trace, all_episodes=True)
    one = diff(trace, all_episodes=True, batch_episodes=1)
    assert len(whole.episodes) >= 2
    assert one == whole
    assert one.first_mismatch is not None and one.first_mismatch.chain


def test_an_episode_range_keeps_the_store_whole() -> None:
    trace = open_trace(str(DATA / "v2"))
    seqs = sorted(trace.collect("lookup")["episode"].unique().to_list())
    later = trace.episode_range(seqs[-1], None)
    assert set(later.collect("lookup")["episode"].to_list()) == {seqs[-1]}
    assert trace.episode_range(None, seqs[0]).collect("lookup").height == 0
    assert later.collect("store").height == trace.collect("store").height


@pytest.mark.parametrize("size", [1, 1000])
def test_a_selection_no_batch_holds_is_an_error(size: int) -> None:
    from keytrace.errors import TraceError

    with pytest.raises(TraceError, match="no episode matches"):
        diff(open_trace(str(DATA / "v2")), request="no-such-request", batch_episodes=size)
