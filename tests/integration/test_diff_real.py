"""`keytrace diff` on traces recorded from the real vLLM 0.33.0 scheduler.

Historical store-side bugs are reintroduced with keytrace.vllm.mods.inject; the lookup side is stock.
Every expected value below is derived by hand in the comment above it.

Geometries (keytrace.analysis.geometry):
- dsv4: MLA tpc 256 (the alignment A); group 1 SWA tpc 64 window 128 -> W = 2 chunks;
  group 2 the same but MTP (EAGLE); group 3 C4 tpc 4 W 2; group 4 C128 tpc 8 W 16.
  Lookup order: [0, 4, 1, 2, 3] (full attention first, then windows descending, stable).
- small: FA tpc 64 (= A); groups 1 and 2 SWA tpc 16 window 32 -> W 2, group 2 MTP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.analysis.geometry import DSV4, SMALL, Geometry  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.vllm.lab.sweep import run_one  # noqa: E402

ONE_STEP = {"dsv4": 32_768, "small": 2048}
CHUNKED = {"dsv4": 2048, "small": 128}
GEOS = {"dsv4": DSV4, "small": SMALL}

# dsv4, 18,877 tokens: cap L = round_down(18,876, 256) = 18,688 = E (the prime's own boundary).
#   MTP group 2 at E: 294 keyed chunks > 292, so the peek chunk 292 exists; vLLM needs the run
#   290, 291, 292 (W + 1 = 3 hits, scanning right to left from 292), then pops 292.
#   pre48911 keeps c % 4 >= 2: 290, 291 yes, 292 (292 % 4 = 0) no -> first MISS is 292.
#   no_eagle_plus1 keeps [292 - 2, 292) = 290, 291 (no shift, no +1) -> first MISS is 292.
# small, 1,024 tokens: L = round_down(1,023, 64) = 960 = E; 64 keyed chunks of 16 tokens.
#   For a hit at E = 960 the MTP group 2 needs 58, 59 and the peek 60 (64 keyed chunks).
#   pre48911 keeps every c % 4 >= 2 chunk: 58, 59, 62, 63, not 60. vLLM's own scan starts
#   further right (group 1's hits at 62, 63 keep its candidate at 1,023): 63, 62 hit, 61
#   MISS (not needed for E), 60 MISS -> the first needed chunk it missed is 60.
#   no_eagle_plus1: group 2 kept [58, 60) without the EAGLE shift; group 1 (stock) moved
#   the boundary to 960, so group 2 scans from its peek 60: MISS first -> terminal 60.
INJECTED = [
    ("dsv4", 18_877, "pre48911", 2, 292),
    ("dsv4", 18_877, "no_eagle_plus1", 2, 292),
    ("small", 1_024, "pre48911", 2, 60),
    ("small", 1_024, "no_eagle_plus1", 2, 60),
]


@pytest.mark.parametrize("prefill", ["one-step", "chunked"])
@pytest.mark.parametrize(("geo", "n", "inject", "group", "chunk"), INJECTED)
def test_injected_bug_is_named(
    geo: str,
    n: int,
    inject: str,
    group: int,
    chunk: int,
    prefill: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    budget = (ONE_STEP if prefill == "one-step" else CHUNKED)[geo]
    d = tmp_path / "t"
    row = run_one(GEOS[geo].with_(max_num_batched_tokens=budget), n, inject=inject, keep_dir=str(d))
    assert (row.verdict, row.external) == ("mismatch", 0)
    assert (row.binding_group, row.terminal_chunk, row.cause) == (group, chunk, "never_offered")
    assert main(["diff", str(d)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert f"binding group {group} (SWA, MTP), terminal chunk {chunk:,} (MISS)" in first
    # the same scenario without the injection hits E: the injected rule alone broke it
    stock = run_one(GEOS[geo].with_(max_num_batched_tokens=budget), n)
    assert stock.verdict == "hit" and stock.external == stock.E


# Stock vLLM, each with its E worked out:
#   dsv4 18,877: E = 18,688 reached (hit). 18,944 = 74 * 256 is an exact multiple of the
#   full-attention chunk: L = round_down(18,943, 256) = 18,688, so the last chunk is
#   recomputed by design and 18,688 is a full hit. 30,208: L = round_down(30,207, 256) =
#   29,952; 30,272: L = 30,208 (vLLM #51761's 30,208-token prompt and its aligned 30,272
#   control); both reach E.
#   small 1,000: L = round_down(999, 64) = 960; 1,088: L = 1,024.
STOCK_HITS = [
    ("dsv4", 18_877, 18_688),
    ("dsv4", 18_944, 18_688),
    ("dsv4", 30_208, 29_952),
    ("dsv4", 30_272, 30_208),
    ("small", 1_000, 960),
    ("small", 1_088, 1_024),
]


@pytest.mark.parametrize(("geo", "n", "E"), STOCK_HITS)
def test_stock_hits_agree(geo: str, n: int, E: int, tmp_path: Path) -> None:
    d = tmp_path / "t"
    row = run_one(GEOS[geo], n, keep_dir=str(d))
    assert (row.verdict, row.E, row.external) == ("hit", E, E)
    assert main(["diff", str(d)]) == 0


def test_cold_lookup_agrees(tmp_path: Path) -> None:
    from keytrace.vllm.hook.patches import recording
    from keytrace.vllm.lab.harness import Harness

    d = tmp_path / "t"
    with recording(d):
        h = Harness(DSV4, max_prompt_tokens=5000)
        h.submit(5000)
        h.run_until_idle()
    report = diff(open_trace(str(d)), all_episodes=True)
    [episode] = report.episodes
    assert (episode.verdict, episode.E, episode.external_tokens) == ("cold", None, 0)
    assert main(["diff", str(d), "--all", "--json"]) == 0


def eagle_peek_missing(n: int, alignment: int, mtp_tpc: int) -> bool:
    """The stock 0.33.0 miss this sweep found: the prime's boundary E = round_down(n - 1, A)
    keeps the MTP tail for a peek chunk [E, E + tpc) that a resend of n tokens cannot key
    (n < E + tpc), so lookup shifts its window one chunk left, onto a chunk never stored."""
    E = (n - 1) // alignment * alignment
    return n < E + mtp_tpc


@pytest.mark.parametrize(
    ("geo", "lengths"),
    [
        ("dsv4", [17_975 + 13 * i for i in range(100)]),
        ("small", [1_000 + 7 * i for i in range(100)]),
    ],
)
def test_stock_sweep(geo: str, lengths: list[int]) -> None:
    g: Geometry = GEOS[geo]
    alignment = g.tokens_per_chunk(0)
    mtp_tpc = g.tokens_per_chunk(2)
    rows = [run_one(g, n) for n in lengths]
    for r in rows:
        # a hit that reaches E is always "hit" (exit 0), never a false alarm
        assert (r.external >= (r.E or 0)) == (r.verdict == "hit"), r
        assert r.verdict in ("hit", "mismatch"), r
        # every stock mismatch is the EAGLE/MTP peek mechanism, and the rule is exact
        assert (r.verdict == "mismatch") == eagle_peek_missing(r.length, alignment, mtp_tpc), r
        if r.verdict == "mismatch":
            assert (r.binding_group, r.cause, r.external) == (2, "never_offered", 0), r
    assert any(r.verdict == "mismatch" for r in rows) and any(r.verdict == "hit" for r in rows)


def test_next_turn_a_little_longer_is_a_mismatch(tmp_path: Path) -> None:
    # turn 1: 17,975 tokens, boundary E = 17,920; its MTP tail 278, 279 (+ the peek 280,
    # which it cannot key: 280 ends at 17,984). Turn 2: 18,000 tokens, so it keys 280 and
    # lookup queries it as the peek: needs 278-280, finds 280 missing. Turn 2 then stores
    # 280 itself, after its lookup; that store explains nothing.
    from keytrace.vllm.lab.replay import replay

    r = replay(DSV4, [17_975], 18_000, trace_dir=tmp_path / "t")
    assert (r.verdict, r.external_tokens, r.expected_E) == ("mismatch", 0, 17_920)
    assert (r.binding_group, r.terminal_chunk, r.cause) == (2, 280, "not_keyable")


def test_the_chunk_maps_are_the_same_every_time(tmp_path: Path) -> None:
    """Realistic traffic (conversations sharing system prompts, so a chunk index has many
    keys across the chain's requests): the maps the differ returns are the same on every
    run, and every key a map shows for a chunk is one the episode's own request has there.
    (The page once took the first of the chain's store rows in whatever order a streaming
    group-by left them: one run in three drew other keys.)"""
    import polars as pl

    from keytrace.analysis import frames
    from keytrace.report.html import page_data
    from keytrace.vllm.lab.workload import WorkloadSpec, run_workload

    d = str(tmp_path / "t")
    run_workload(WorkloadSpec(geometry="small", seed=11), d)
    trace = open_trace(d)
    pages = [page_data(diff(trace, maps=200)) for _ in range(3)]
    assert pages[0]["episodes"] and pages[0] == pages[1] == pages[2]
    # a request's own keys name its content at each end token (any group: the block hash)
    own = frames.collect(
        pl.concat(
            [
                frames.lookups(trace).select("req_id", "end_token", "key"),
                frames.stores(trace).select("req_id", "end_token", "key").drop_nulls(),
            ]
        ).unique()
    )
    hash_at = {(r, e): bytes(k)[:-4].hex() for r, e, k in own.iter_rows()}
    report = diff(trace, maps=200)
    shown = [
        (hash_at.get((m.episode.req_id, c.token_end)), c.key[:-8])
        for m in report.maps
        for lane in m.lanes
        for c in lane.chunks
        if c.key is not None
    ]
    assert shown and all(mine == key for mine, key in shown if mine is not None)
    assert sum(mine is not None for mine, _ in shown) > len(shown) // 2
