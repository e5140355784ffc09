"""The differ on hand-built traces: one test per cause label, and verdict boundaries.

Geometry TINY: FA, SWA (window 32 = 2 chunks) and EAGLE SWA (window 2 + peek), all with 16
tokens per chunk. A 100-token prompt has keys for chunks 0..5; its cap is
L = round_down(100 - 1, 16) = 96, so the prime's own boundary is 96 = 6 chunks.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.analysis.diff import EpisodeVerdict, _before, diff
from keytrace.analysis.geometry import GroupGeom
from keytrace.cli import main
from keytrace.format.reader import open_trace
from keytrace.judge.rules import Group, needed_chunks
from tests.factories import TINY, TraceBuilder, new_builder

FA_ALL = [(c, "HIT") for c in range(6)]


def _r2(episodes: list[EpisodeVerdict]) -> EpisodeVerdict:
    return next(v for v in episodes if v.req_id == "r2")


def _swa_scan(results: dict[int, str], lo: int = 0, hi: int = 5) -> list[tuple[int, str]]:
    """A right-to-left sliding-window scan that stops once two consecutive hits are found."""
    out, run = [], 0
    for c in range(hi, lo - 1, -1):
        r = results.get(c, "MISS")
        out.append((c, r))
        run = run + 1 if r in ("HIT", "HIT_PENDING") else 0
        if run == 2:
            break
    return out


def _build(
    tmp: Path,
    swa1: list[int],
    *,
    episode_external: int,
    swa1_results: dict[int, str] | None = None,
    extra: object = None,
) -> Path:
    d = tmp / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 100, swa_chunks={1: swa1})
    if callable(extra):
        extra(b)
    res = swa1_results if swa1_results is not None else {c: "HIT" for c in swa1}
    b.episode(
        "r2", 100, external=episode_external, chain="c", scans=[(0, FA_ALL), (1, _swa_scan(res))]
    )
    b.close()
    return d


def _only(tmp: Path, **kw: object):
    report = diff(open_trace(str(_build(tmp, **kw))), all_episodes=True)
    return _r2(report.episodes), report


def test_full_hit_agrees(tmp_path: Path) -> None:
    v, report = _only(tmp_path, swa1=[4, 5], episode_external=96)
    assert (v.verdict, v.E, v.S) == ("hit", 96, 0)
    assert report.verdict == "agree" and report.first_mismatch is None


def test_never_offered(tmp_path: Path) -> None:
    # store kept chunk 5 only; the window ending at 96 needs 4 and 5
    v, report = _only(tmp_path, swa1=[5], episode_external=0)
    assert v.verdict == "mismatch" and report.first_mismatch == v
    assert v.binding_group == 1 and v.terminal is not None
    assert (v.terminal.chunk, v.terminal.result, v.terminal.cause) == (4, "MISS", "never_offered")
    assert [(n.chunk, n.cause) for n in v.needed if n.group_id == 1] == [
        (4, "never_offered"),
        (5, "resident"),
    ]
    assert v.stored_chunks == [(5, 5)]


def test_offered_not_accepted(tmp_path: Path) -> None:
    def reject(b: TraceBuilder) -> None:
        b.store("r1", "c", 1, [], rejected=[4])

    v, _ = _only(tmp_path, swa1=[5], episode_external=0, extra=reject)
    assert v.verdict == "mismatch" and v.terminal.cause == "rejected"


def test_pending_is_explained(tmp_path: Path) -> None:
    def pend(b: TraceBuilder) -> None:
        b.store("r1", "c", 1, [4], complete=False, job=9)

    v, report = _only(tmp_path, swa1=[5], episode_external=0, extra=pend)
    assert v.verdict == "explained" and v.terminal.cause == "in_flight"
    assert report.verdict == "agree"


def test_evicted_is_explained(tmp_path: Path) -> None:
    def ev(b: TraceBuilder) -> None:
        b.evict("r3", "c", 1, [4])

    v, _ = _only(tmp_path, swa1=[4, 5], episode_external=0, swa1_results={5: "HIT"}, extra=ev)
    assert v.verdict == "explained" and v.terminal.cause == "evicted"


def test_a_tier_reset_removes_what_was_stored_before_it(tmp_path: Path) -> None:
    # chunk 4 completed, then the tier was reset, then chunks 0..5 (FA) and 5 were stored
    # again: lookup misses 4. With the reset row 4 was removed (explained); without it,
    # 4 would be resident and the miss a mismatch. The reset row alone decides.
    verdicts = {}
    for with_reset in (True, False):
        d = tmp_path / str(with_reset) / "t"
        b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
        b.store("r0", "c", 1, [4])
        if with_reset:
            b.rec.reset()
        b.prime("r1", "c", 100, swa_chunks={1: [5]})
        b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
        b.close()
        v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
        verdicts[with_reset] = (v.verdict, v.terminal.cause)
    assert verdicts == {True: ("explained", "evicted"), False: ("mismatch", "resident")}


def test_evicted_then_stored_again_is_resident(tmp_path: Path) -> None:
    def again(b: TraceBuilder) -> None:
        b.evict("r3", "c", 1, [4])
        b.store("r4", "c", 1, [4])  # re-stored after the eviction: resident at the episode

    v, _ = _only(tmp_path, swa1=[4, 5], episode_external=0, swa1_results={5: "HIT"}, extra=again)
    assert (v.verdict, v.terminal.cause) == ("mismatch", "resident")


def test_resident_prefix_bounds_E(tmp_path: Path) -> None:
    # two chain requests: r0 (52 tokens, boundary 48) and r1 (100 tokens, boundary 96).
    # The episode's full-attention scan misses chunk 4 (evicted), so F = 64: E is r0's 48,
    # not r1's 96. vLLM returned 48 -> a hit.
    d = tmp_path / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r0", "c", 52, swa_chunks={1: [1, 2]})
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    b.evict("r9", "c", 0, [4])
    fa = [(0, "HIT"), (1, "HIT"), (2, "HIT"), (3, "HIT"), (4, "MISS")]
    b.episode(
        "r2",
        100,
        external=48,
        chain="c",
        scans=[(0, fa), (1, _swa_scan({1: "HIT", 2: "HIT"}, hi=3))],
    )
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.L, v.E, v.external_tokens) == ("hit", 96, 48, 48)


@pytest.mark.parametrize("result", ["HIT_PENDING", "RETRY"])
def test_a_pending_or_retried_binding_key_is_explained(tmp_path: Path, result: str) -> None:
    def pending(b: TraceBuilder) -> None:
        b.store("r1", "c", 1, [4], complete=False, job=5)  # prepared, not yet completed

    v, _ = _only(
        tmp_path, swa1=[5], episode_external=0, swa1_results={5: "HIT", 4: result}, extra=pending
    )
    assert v.verdict == "explained" and v.terminal.result == result
    assert v.reason == f"lookup saw {result} at the binding key: the store had not finished"


def test_other_engine_counts_only_when_offered_there_before_the_lookup(tmp_path: Path) -> None:
    d = tmp_path / "t"
    geo = TINY.with_(groups=TINY.groups[:2])
    a = new_builder(d, geometry=geo, engine_id="A")
    bb = new_builder(d, geometry=geo, engine_id="B", dp_rank=1)
    a.prime("r1", "c", 100, swa_chunks={1: [5]})
    a.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    bb.store("rb", "c", 1, [4])  # on engine B, but only after the episode
    a.close()
    bb.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.terminal.cause) == ("mismatch", "never_offered")


def test_engine_and_rank_select_episodes(tmp_path: Path) -> None:
    d = tmp_path / "t"
    geo = TINY.with_(groups=TINY.groups[:2])
    a = new_builder(d, geometry=geo, engine_id="A", dp_rank=0)
    bb = new_builder(d, geometry=geo, engine_id="B", dp_rank=1)
    a.prime("ra", "c", 100, swa_chunks={1: [4, 5]})
    bb.prime("rb", "d", 100, swa_chunks={1: [5]})
    bb.episode("rb2", 100, external=0, chain="d", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    a.episode(
        "ra2",
        100,
        external=96,
        chain="c",
        scans=[(0, FA_ALL), (1, _swa_scan({4: "HIT", 5: "HIT"}))],
    )
    a.close()
    bb.close()
    trace = open_trace(str(d))
    whole = diff(trace, all_episodes=True)
    assert whole.counts == {"cold": 2, "hit": 1, "mismatch": 1}
    assert whole.first_mismatch is not None and whole.first_mismatch.req_id == "rb2"
    for sel in ({"engine": "A"}, {"rank": 0}):
        r = diff(trace, all_episodes=True, **sel)
        assert {e.req_id for e in r.episodes} == {"ra", "ra2"}, sel
        assert r.counts == {"cold": 1, "hit": 1} and r.verdict == "agree"
    for sel in ({"engine": "B"}, {"rank": 1}):
        r = diff(trace, all_episodes=True, **sel)
        assert {e.req_id for e in r.episodes} == {"rb", "rb2"} and r.verdict == "mismatch", sel
    assert main(["diff", str(d), "--rank", "0"]) == 0
    assert main(["diff", str(d), "--rank", "1"]) == 1
    assert main(["diff", str(d), "--engine", "B"]) == 1


def test_moving_one_row_changes_the_verdict(tmp_path: Path) -> None:
    # chunk 4's completion before the episode: it was resident and lookup still missed it
    def before(b: TraceBuilder) -> None:
        b.store("r1", "c", 1, [4], complete=True)

    v_before, _ = _only(tmp_path / "a", swa1=[5], episode_external=0, extra=before)
    # the very same completion row written after the episode
    d = tmp_path / "b" / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 100, swa_chunks={1: [5]})
    b.store("r1", "c", 1, [4], complete=False)
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.complete("r1", "c", 1, [4])
    b.close()
    v_after = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert v_before.verdict == "mismatch" and "resident, yet lookup fell short" in v_before.reason
    assert v_after.verdict == "explained" and v_after.terminal.cause == "in_flight"


def test_completed_after_and_other_engine(tmp_path: Path) -> None:
    d = tmp_path / "t"
    geo = TINY.with_(groups=TINY.groups[:2])
    a = new_builder(d, geometry=geo, engine_id="A")
    bb = new_builder(d, geometry=geo, engine_id="B")
    a.prime("r1", "c", 100, swa_chunks={1: [5]})
    bb.store("rb", "c", 1, [4])  # chunk 4 lives on engine B only
    a.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    a.close()
    bb.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert v.verdict == "explained" and v.terminal.cause == "other_engine"
    # --engine narrows to one engine
    report = diff(open_trace(str(d)), engine="A", all_episodes=True)
    assert {e.engine_id for e in report.episodes} == {"A"}


def test_a_store_first_offered_after_the_lookup_explains_nothing(tmp_path: Path) -> None:
    # chunk 4 is prepared and completed only after the episode (by a later request, or by
    # the episode's own request once it computed it): not in flight at the lookup
    for who in ("r3", "r2"):
        d = tmp_path / who / "t"
        b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
        b.prime("r1", "c", 100, swa_chunks={1: [5]})
        b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
        b.store(who, "c", 1, [4])
        b.close()
        v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
        assert (v.verdict, v.terminal.cause) == ("mismatch", "never_offered"), who


def test_other_group_id(tmp_path: Path) -> None:
    # group 1's chunks were written under group id 7: its own id never reaches the store
    d = tmp_path / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 100)
    wrong = [b.key("c", 1, c)[:-4] + (7).to_bytes(4, "big") for c in (4, 5)]
    b.rec.store_prepared("r1", wrong, {}, wrong, [], 3)
    b.rec.store_completed("r1", wrong, {}, 3, True)
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({}))])
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert v.verdict == "mismatch" and v.terminal.cause == "other_group"


def test_not_keyable_eagle_peek(tmp_path: Path) -> None:
    # the prime (100 tokens) stored the EAGLE tail 4..5 for its boundary 96; a longer resend
    # (120 tokens) can query the peek chunk 6 = tokens 96..112, which the prime never keyed
    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [4, 5]})
    b.episode(
        "r2",
        120,
        external=0,
        chain="c",
        scans=[
            (0, [*FA_ALL, (6, "MISS")]),
            (1, _swa_scan({4: "HIT", 5: "HIT"})),
            (2, [(6, "MISS"), (5, "HIT"), (4, "HIT"), (3, "MISS")]),
        ],
    )
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.E, v.binding_group) == ("mismatch", 96, 2)
    assert (v.terminal.chunk, v.terminal.cause) == (6, "not_keyable")
    assert [(n.chunk, n.cause) for n in v.needed if n.group_id == 2] == [
        (4, "resident"),
        (5, "resident"),
        (6, "not_keyable"),
    ]


def test_cold_and_deferred(tmp_path: Path) -> None:
    d = tmp_path / "t"
    b = new_builder(d)
    b.episode("r1", 100, external=0, chain="c", scans=[(0, [(0, "MISS")])])
    b.episode("r2", 100, external=None, chain="c", scans=[(0, [(0, "RETRY")])])
    b.close()
    report = diff(open_trace(str(d)), all_episodes=True)
    assert [v.verdict for v in report.episodes] == ["cold", "deferred"]
    assert report.verdict == "agree"


def test_exact_multiple_of_chunk_is_short_by_design(tmp_path: Path) -> None:
    # a 96-token prompt: cap 95 rounds down to 80 -- the last chunk is recomputed by design
    d = tmp_path / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 96, swa_chunks={1: [3, 4]})
    b.episode(
        "r2",
        96,
        external=80,
        chain="c",
        scans=[(0, [(c, "HIT") for c in range(5)]), (1, _swa_scan({3: "HIT", 4: "HIT"}, hi=4))],
    )
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.E, v.L) == ("hit", 80, 80)


def test_request_filter_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _build(tmp_path, swa1=[5], episode_external=0)
    assert main(["diff", str(d)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        "MISMATCH: request r2 got 0 external tokens, expected 96 (E=96); binding group 1 (SWA)"
    )
    assert "group 1 (SWA) needed chunks 4–5 for a hit at 96; store wrote 5 near there" in out
    assert main(["diff", str(d), "--request", "r1"]) == 0
    capsys.readouterr()
    assert main(["diff", str(d), "--request", "nope"]) == 2


def test_needed_chunks_rule() -> None:
    swa = Group(1, 64, 2, 128, 0, False, "sliding_window")
    mtp = Group(2, 64, 2, 128, 0, True, "sliding_window")
    # DSv4 17,975 tokens: 280 keyed chunks, E = 17,920: no peek chunk exists
    assert needed_chunks(mtp, 0, 17_920, 280) == [277, 278, 279]
    # 18,877 tokens: E = 18,688 = chunk 292; the peek chunk 292 is keyed
    assert needed_chunks(mtp, 0, 18_688, 294) == [290, 291, 292]
    assert needed_chunks(swa, 0, 18_688, 294) == [290, 291]


def test_keys_of_groups_the_scan_never_reached_are_derived(tmp_path: Path) -> None:
    # group 1 misses first, so vLLM never scans group 2. Its needed chunks' keys are the
    # request's own block hashes at the same end tokens (here group 1's lookups of the same
    # chunks) with group id 2: chunk 3 was never offered, 4 and 5 are resident.
    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("r1", "c", 100, swa_chunks={1: [5], 2: [4, 5]})
    b.episode(
        "r2",
        100,
        external=0,
        chain="c",
        scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))],
        listed=False,
    )
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.binding_group, v.terminal.chunk) == ("mismatch", 1, 4)
    g2 = [(n.chunk, n.lookup_result, n.cause, n.key) for n in v.needed if n.group_id == 2]
    # E = 96: the MTP group would need 3, 4, 5 (no peek chunk: 100 tokens key chunks 0..5)
    assert g2 == [
        (c, None, cause, b.key("c", 2, c).hex())
        for c, cause in ((3, "never_offered"), (4, "resident"), (5, "resident"))
    ]


def test_a_rule_miss_behind_an_eviction_is_a_mismatch(tmp_path: Path) -> None:
    # group 1's chunk 4 was evicted (the scan fails there: capacity), but group 2, which the
    # scan never reached, was never offered chunk 3: with nothing evicted vLLM would still
    # fall short, so this is a rule mismatch, not an explained shortfall
    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [4, 5]})
    b.evict("r9", "c", 1, [4])
    b.episode(
        "r2",
        100,
        external=0,
        chain="c",
        scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))],
        listed=False,
    )
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.binding_group, v.terminal.cause) == ("mismatch", 1, "evicted")
    assert [(n.group_id, n.chunk, n.cause) for n in v.needed if n.cause != "resident"] == [
        (1, 4, "evicted"),
        (2, 3, "never_offered"),
    ]
    # without the missing group-2 chunk, the same eviction is only a capacity shortfall
    d2 = tmp_path / "t2"
    b = new_builder(d2)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [3, 4, 5]})
    b.evict("r9", "c", 1, [4])
    b.episode(
        "r2",
        100,
        external=0,
        chain="c",
        scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))],
        listed=False,
    )
    b.close()
    v2 = _r2(diff(open_trace(str(d2)), all_episodes=True).episodes)
    assert (v2.verdict, v2.terminal.cause) == ("explained", "evicted")


def test_a_request_that_only_evicted_a_key_does_not_share_its_prefix(tmp_path: Path) -> None:
    # group 2 has 4-token chunks, so its chunk 22 (tokens 88-92) ends where r2 recorded no
    # key of its own: the key is derived from requests sharing r2's key ending at 96. r9
    # (another prefix, "x") holds that key only as an eviction row, and stored its own chunk
    # 22: taking r9's key would call the chunk resident. Nobody on r2's prefix offered it.
    geo = TINY.with_(
        groups=(
            TINY.groups[0],
            TINY.groups[1],
            GroupGeom("sliding_window", 4, sliding_window=8, name="fine"),
        )
    )
    d = tmp_path / "t"
    b = new_builder(d, geometry=geo)
    b.prime("r1", "c", 100, swa_chunks={1: [5], 2: [23]})
    b.store("r9", "x", 2, [22])
    b.episode(
        "r2",
        100,
        external=0,
        chain="c",
        scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))],
        listed=False,
    )
    b.evict("r9", "c", 0, [5])
    b.evict("r9", "c", 1, [5])
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.binding_group, v.terminal.chunk) == ("mismatch", 1, 4)
    fine = [(n.chunk, n.key, n.cause) for n in v.needed if n.group_id == 2]
    assert fine == [(22, None, "never_offered"), (23, b.key("c", 2, 23).hex(), "resident")]


def test_lookups_read_in_batches_of_parts_give_the_same_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`frames.lookups_in` reads v2 lookup parts a batch at a time (bounded memory); the
    shortfalls' needed chunks found in every batch, not only the first, decide the report."""
    from keytrace.analysis import frames
    from keytrace.format import encode, writer

    # these parts are small: split them by group id as a big part is (`SPLIT_MIN_ROWS`)
    monkeypatch.setattr(writer, "write_parquet", lambda t, fh: encode.write_parquet(t, fh, 0))

    b = new_builder(tmp_path / "t", geometry=TINY.with_(groups=TINY.groups[:2]))
    fa = [(c, "HIT") for c in range(6)]
    for n, chain in enumerate("cdef"):
        b.prime(f"p{n}", chain, 100, swa_chunks={1: [5]})
        b.episode(
            f"r{n}", 100, external=0, chain=chain, scans=[(0, fa), (1, [(5, "HIT"), (4, "MISS")])]
        )
        b.rec.writer.flush()  # each episode's lookups in parts of their own
    b.close()
    trace = open_trace(str(tmp_path / "t"))
    # a part bigger than the bound is cut into its row groups (v2 lookup: one per group id)
    row_groups = sum(
        pq.ParquetFile(p.path).metadata.num_row_groups for p in trace.parts_of("lookup")
    )
    assert len(trace.batches("lookup", 1)) == row_groups > len(trace.parts_of("lookup")) >= 4
    assert len(trace.batches("lookup", 1 << 30)) == 1
    whole = diff(trace)
    monkeypatch.setattr(frames, "LOOKUP_BATCH_BYTES", 1)
    batched = diff(trace)
    assert batched == whole
    assert [(v.req_id, v.verdict) for v in batched.episodes] == [
        (f"r{n}", "mismatch") for n in range(4)
    ]
    assert all(v.needed and v.terminal and v.terminal.chunk == 4 for v in batched.episodes)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 60), st.integers(0, 60)), max_size=40
    ),
    episodes=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 60), st.integers(0, 60)),
        min_size=1,
        max_size=6,
    ),
)
def test_a_batch_keeps_every_store_row_its_episodes_can_read(
    rows: list[tuple[int, int, int]], episodes: list[tuple[int, int, int]]
) -> None:
    # an episode (inst, s, t) reads its instance's rows before s and other instances' rows
    # before t (keytrace.analysis.history); sequence numbers are per process, so another
    # instance's row may have a larger seq than the episode and still come before it
    hi = max(s for _, s, _ in episodes) + 1
    t_max = max(t for _, _, t in episodes)
    bound = _before(hi, t_max)
    assert bound is not None
    store = pl.DataFrame(rows, schema=["inst", "seq", "ts"], orient="row")
    kept = set(store.filter(bound).iter_rows())
    for inst, s, t in episodes:
        for row in rows:
            r_inst, r_seq, r_ts = row
            if (r_inst == inst and r_seq < s) or (r_inst != inst and r_ts < t):
                assert row in kept


def test_the_terminal_key_is_a_miss_before_an_earlier_pending_one(tmp_path: Path) -> None:
    # group 1's chunk 5 was prepared and not completed (HIT_PENDING, found first: the window
    # scan runs right to left), chunk 4 was never offered (MISS, found after it). The MISS
    # ended the match: a pending key is on its way, a missing one is not.
    def in_flight(b: TraceBuilder) -> None:
        b.store("r1", "c", 1, [5], complete=False, job=5)

    v, _ = _only(
        tmp_path,
        swa1=[],
        episode_external=0,
        swa1_results={5: "HIT_PENDING"},
        extra=in_flight,
    )
    assert (v.verdict, v.binding_group) == ("mismatch", 1)
    assert (v.terminal.chunk, v.terminal.result, v.terminal.cause) == (4, "MISS", "never_offered")
    assert [(n.chunk, n.cause) for n in v.needed] == [(4, "never_offered"), (5, "in_flight")]


def test_keys_needed_below_the_ceiling_are_listed_for_an_unscanned_group(tmp_path: Path) -> None:
    # r1 (100 tokens) keeps its tails for its own boundary 96, r1b (200 tokens) for 192;
    # both share r2's prefix. r2 (150 tokens): L = 144 and every full-attention chunk is
    # stored, so the ceiling is 144, but the largest intended boundary in reach is r1's:
    # E = 96 (192 is past L). Group 1 never finds two hits in a row (its chunk 4 was never
    # offered), so vLLM returns 0 before it scans the MTP group 2. What a hit at E needs
    # of group 2 (chunks 4..6: r2 keys 9 chunks, so the MTP lookup queries the peek chunk
    # 6 and needs 4, 5 and 6, then pops 6) lies below the ceiling's (6..8): the recorder
    # lists it for E, an intended boundary it knows from its chain book, so the differ
    # and the live alarm judge it from the trace alone. Chunk 6 ends at 112, past r1's
    # 100 tokens: not keyable by the chain (r1b, longer, is not on it: 192 is past L).
    from keytrace.format.schema import SCAN_UNQUERIED

    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("r1", "c", 100, swa_chunks={1: [5], 2: [3, 4]})
    b.prime("r1b", "c", 200, swa_chunks={1: [10, 11], 2: [9, 10, 11]})
    fa = [(c, "HIT") for c in range(9)]
    b.episode("r2", 150, external=0, chain="c", scans=[(0, fa), (1, _swa_scan({5: "HIT"}, hi=8))])
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.E, v.binding_group, v.terminal.chunk) == ("mismatch", 96, 1, 4)
    g2 = [(n.chunk, n.lookup_result, n.cause) for n in v.needed if n.group_id == 2]
    assert g2 == [(4, None, "resident"), (5, None, "never_offered"), (6, None, "not_keyable")]
    listed = (
        open_trace(str(d))
        .frame("lookup")
        .filter((pl.col("scan") == SCAN_UNQUERIED) & (pl.col("group_id") == 2))
        .select(pl.col("head_chunks").explode())
        .collect()
        .to_series()
        .to_list()
    )
    assert sorted(listed) == [4, 5, 6, 7, 8]  # at E = 96 (4..6) and at the ceiling (6..8)


def test_lookahead_hashes_leave_an_identical_resend_short_of_its_own_boundary(
    tmp_path: Path,
) -> None:
    # vLLM 0.34.0 with a multi-module MTP drafter of 2 tokens (num_hash_lookahead_tokens 2):
    # a block's hash covers the 2 tokens past it, so a 97-token prompt keys 5 of its
    # 16-token chunks ((97 - 2) // 16) and an identical resend reaches 80. The store kept
    # the windows' tails at P - 1 = 96 (chunks 4, 5), where no resend can look: the window
    # ending at 80 needs chunk 3 too, never offered. keytrace judged this resend "cold"
    # (no intended boundary in reach: it took the prime's boundary for 96) before the
    # rules knew the lookahead; the lookahead makes the prime's own boundary 80.
    from keytrace.analysis.geometry import synthetic_header

    d = tmp_path / "t"
    header = {**synthetic_header(TINY), "num_hash_lookahead_tokens": 2}
    b = new_builder(d, header=header)
    b.episode("r1", 97, external=0, scans=[(0, [(0, "MISS")])], chain="c")
    b.store("r1", "c", 0, list(range(6)))
    b.store("r1", "c", 1, [4, 5])
    b.store("r1", "c", 2, [4, 5])
    fa = [(c, "HIT") for c in range(5)]
    b.episode("r2", 97, external=0, chain="c", scans=[(0, fa), (1, _swa_scan({4: "HIT"}, hi=4))])
    b.close()
    v = _r2(diff(open_trace(str(d)), all_episodes=True).episodes)
    assert (v.verdict, v.L, v.E, v.binding_group) == ("mismatch", 80, 80, 1)
    assert (v.terminal.chunk, v.terminal.cause) == (3, "never_offered")
    # no peek: with lookahead hashes the MTP group is a plain window group
    assert [(n.group_id, n.chunk, n.cause) for n in v.needed] == [
        (1, 3, "never_offered"),
        (1, 4, "resident"),
        (2, 3, "never_offered"),
        (2, 4, "resident"),
    ]
