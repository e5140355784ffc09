"""vLLM 0.33.0's arithmetic (keytrace.judge.rules): worked values, and the int and polars
evaluations of the same duck-typed function agreeing on random inputs."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.judge.definitions import CAUSE_ORDER, EXPLAINED_CAUSES, RULE_CAUSES, better_cause
from keytrace.judge.ops import greatest, least
from keytrace.judge.rules import (
    Group,
    align_down,
    cdiv,
    eagle_peek_unkeyable,
    excluded_tiers,
    group_label,
    groups_from_header,
    load_cap,
    load_window,
    lookup_cap,
    needed_chunks,
    needed_range,
    partial_anchor_of,
    peek_cap,
    request_limits,
    store_boundary,
    trim_first_of,
    window_chunks,
    withheld_chunk,
)

MLA = Group(0, 256, None, kind="mla")
SWA = Group(1, 64, 2, 128, 0, False, "sliding_window")
MTP = Group(2, 64, 2, 128, 0, True, "sliding_window")
C4 = Group(3, 4, 2, 8, 0, False, "sliding_window")
DSV4 = [MLA, Group(4, 8, 16, 128, 0, False, "sliding_window"), SWA, MTP, C4]


def test_labels_and_windows() -> None:
    assert [group_label(g.kind, g.eagle) for g in (MLA, SWA, MTP)] == ["MLA", "SWA", "SWA, MTP"]
    # get_sliding_window_size_in_chunks: max(cdiv(sw, tpc), cdiv(sw - 1 + extra, tpc))
    assert window_chunks(128, 0, 64) == 2
    assert window_chunks(128, 3, 64) == 3  # multi-module MTP retains more
    assert window_chunks(None, 0, 64) is None


def test_cap_and_boundary() -> None:
    # 17,975 tokens: L = round_down(17,974, 256) = 17,920 (a window group: minus 1)
    assert lookup_cap(DSV4, 17_975, 0, None) == 17_920
    assert store_boundary(DSV4, 18_944) == 18_688  # exact multiple: last chunk recomputed
    assert lookup_cap([MLA], 18_944, 0, None) == 18_944  # no window group: no minus 1
    assert lookup_cap(DSV4, 20_000, 512, 1000) == 1_280  # within S + max_new
    assert lookup_cap(DSV4, 100, 0, None) == 0


def test_needed_chunks_with_the_eagle_peek() -> None:
    # 17,975 tokens: 280 keyed chunks of 64; E = 17,920 = chunk 280's start: no peek exists
    assert needed_chunks(MTP, 0, 17_920, 280) == [277, 278, 279]
    # 18,877 tokens: E = 18,688; the peek chunk 292 is keyed (294 keyed chunks)
    assert needed_chunks(MTP, 0, 18_688, 294) == [290, 291, 292]
    assert needed_chunks(SWA, 0, 18_688, 294) == [290, 291]
    assert needed_chunks(MLA, 512, 1_024, 10) == [2, 3]
    # a right edge off the chunk grid widens the window (load_window_size_in_chunks)
    assert load_window(C4, 16) == 2 and load_window(SWA, 18_688 + 32) == 3


def test_the_stock_rule() -> None:
    assert eagle_peek_unkeyable(17_975, DSV4)  # 17,975 mod 256 = 55 < 64
    assert not eagle_peek_unkeyable(18_877, DSV4)  # 189
    assert not eagle_peek_unkeyable(18_944, DSV4)  # 0: E = 18,688, P - E = 256
    # the edges: P - E = tpc(MTP) keys the peek (17,984 hits on the real scheduler), and a
    # prompt shorter than A has no boundary to miss (E = 0: a cold lookup, not this rule)
    assert eagle_peek_unkeyable(17_983, DSV4) and not eagle_peek_unkeyable(17_984, DSV4)
    assert not eagle_peek_unkeyable(10, DSV4)


def test_small_helpers() -> None:
    assert (
        group_label("mamba", False) == "Mamba"
        and group_label("novel_kind", True) == "novel_kind, MTP"
    )
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    # an int and an expression mix: the row-wise min/max of polars
    assert pl.select(least(3, pl.lit(5)), greatest(pl.lit(3), 5).alias("g")).row(0) == (3, 5)
    assert align_down(17_975, DSV4) == 17_920 and align_down(255, [SWA, C4]) == 192
    # retained extra tokens widen the window only past a chunk boundary
    assert window_chunks(128, 1, 64) == 2 and window_chunks(128, 2, 64) == 3


def test_cap_edges() -> None:
    # one token past a unit boundary: the window group's "minus 1" lands on the boundary
    assert lookup_cap(DSV4, 18_945, 0, None) == 18_944
    assert lookup_cap(DSV4, 18_944, 0, None) == 18_688


def test_load_window_pads_an_unaligned_right_edge() -> None:
    # C4: tpc 4, sliding window 8 (2 chunks); end 1 leaves 3 tokens of pad: cdiv(7 + 3, 4) = 3
    assert load_window(C4, 1) == 3 and load_window(C4, 3) == 2 and load_window(C4, 4) == 2
    # extra retained tokens count: cdiv(64 - 1 + 1 + 1, 64) = 2 for an end one short of a chunk
    g = Group(0, 64, 1, 64, 1, False, "sliding_window")
    assert load_window(g, 127) == 2 and load_window(g, 128) == 1


def test_groups_from_header() -> None:
    header = {
        "groups": [
            {
                "group_id": 2,
                "offloaded": True,
                "tokens_per_chunk": 64,
                "window_chunks": 3,
                "sliding_window": 128,
                "extra_retained_tokens": 2,
                "is_eagle": True,
                "kind": "sliding_window",
            },
            {"group_id": 1, "offloaded": False, "tokens_per_chunk": 64, "kind": "mamba"},
            {
                "group_id": 0,
                "offloaded": True,
                "tokens_per_chunk": 256,
                "window_chunks": None,
                "sliding_window": None,
                "extra_retained_tokens": None,
                "is_eagle": False,
                "kind": "mla",
            },
        ]
    }
    assert groups_from_header(header) == [
        Group(0, 256, None, None, 0, False, "mla"),
        Group(2, 64, 3, 128, 2, True, "sliding_window"),
    ]
    assert groups_from_header({}) == []


groups_st = st.lists(
    st.builds(
        Group,
        gid=st.integers(0, 7),
        tpc=st.sampled_from([4, 8, 16, 64, 256]),
        window=st.one_of(st.none(), st.integers(1, 20)),
        sliding_window=st.one_of(st.none(), st.integers(1, 600)),
        extra=st.integers(0, 4),
        eagle=st.booleans(),
        kind=st.sampled_from(["sliding_window", "mla", "full_attention"]),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(
    groups=groups_st,
    num_tokens=st.integers(0, 40_000),
    local=st.integers(0, 40_000),
    max_new=st.one_of(st.none(), st.integers(0, 40_000)),
    max_load=st.one_of(st.none(), st.integers(0, 40_000)),
    trim_first=st.booleans(),
    E=st.integers(0, 40_000),
    keyed=st.integers(0, 700),
)
def test_polars_and_int_evaluations_agree(
    groups: list[Group],
    num_tokens: int,
    local: int,
    max_new: int | None,
    max_load: int | None,
    trim_first: bool,
    E: int,
    keyed: int,
) -> None:
    groups = [dataclasses.replace(g, gid=i) for i, g in enumerate(groups)]
    df = pl.DataFrame(
        {"N": [num_tokens], "S": [local], "m": [max_new], "ml": [max_load], "E": [E], "k": [keyed]},
        schema={c: pl.Int64 for c in ("N", "S", "m", "ml", "E", "k")},
    )
    cap = lookup_cap(groups, pl.col("N"), pl.col("S"), pl.col("m"), pl.col("ml"), trim_first)
    cols = {"cap": cap}
    for g in groups:
        if g.window is None:
            continue
        lo, hi = needed_range(g, pl.col("S"), pl.col("E"), pl.col("k"))
        cols[f"lo{g.gid}"], cols[f"hi{g.gid}"] = lo, hi
    row = df.select(**cols).row(0, named=True)
    assert row["cap"] == lookup_cap(groups, num_tokens, local, max_new, max_load, trim_first)
    for g in groups:
        if g.window is not None:
            assert (row[f"lo{g.gid}"], row[f"hi{g.gid}"]) == needed_range(g, local, E, keyed)


def test_better_cause_follows_the_history_precedence() -> None:
    """A chunk with two keys (an EAGLE peek and its proof) is as available as the better
    one; the differ's polars form and the alarm's Python form pick the same for every
    pair, and a cause outside the order (not looked up) yields to any known one."""
    from keytrace.analysis.diff import _proof_if_better

    explained = [c for c in CAUSE_ORDER if c in EXPLAINED_CAUSES]
    assert explained == list(EXPLAINED_CAUSES)
    assert [c for c in CAUSE_ORDER if c in RULE_CAUSES] == list(RULE_CAUSES)
    assert CAUSE_ORDER.index("resident") == 0 and CAUSE_ORDER[-1] == "not_keyable"
    assert better_cause("never_offered", "evicted") == "evicted"
    assert better_cause("evicted", "never_offered") == "evicted"
    assert better_cause("not_looked_up", "never_offered") == "never_offered"
    assert better_cause(None, "rejected") == "rejected"
    assert better_cause("in_flight", None) == "in_flight"
    causes = [*CAUSE_ORDER, "not_looked_up"]
    pairs = [(a, b) for a in causes for b in [*causes, None]]
    frame = pl.DataFrame(
        {
            "key": [b"own"] * len(pairs),
            "cause": [a for a, _ in pairs],
            "proof": [b"proof"] * len(pairs),
            "proof_cause": [b for _, b in pairs],
        }
    ).with_columns(_proof_if_better())
    want = [better_cause(a, b) for a, b in pairs]
    assert frame["cause"].to_list() == want
    # the evidence names the key that decided: the proof only where it was strictly better
    assert frame["key"].to_list() == [
        b"proof" if b is not None and w == b and w != a else b"own"
        for (a, b), w in zip(pairs, want, strict=True)
    ]


def test_lookahead_hashes_cap_the_hit_where_the_keys_end() -> None:
    """vLLM 0.34.0's lookahead hashes (``num_hash_lookahead_tokens`` L): a block's key
    exists once L tokens past it do, so no hit reaches past ``N - L``; a group that would
    drop a block for its drafter does not (its hash proves the drafter's input)."""
    fa = Group(0, 4, None, kind="full_attention")
    swa = Group(1, 4, 2, sliding_window=8)
    for L, cap in ((0, 12), (1, 12), (2, 8), (3, 8), (5, 8)):
        groups = [dataclasses.replace(g, lookahead=L) for g in (fa, swa)]
        assert lookup_cap(groups, 13) == cap, L
    # full attention alone: nothing recomputed, only the keys bound it
    assert lookup_cap([dataclasses.replace(fa, lookahead=2)], 13) == 8
    assert lookup_cap([fa], 13) == 12
    mtp = Group(2, 4, 2, sliding_window=8, eagle=True)
    assert mtp.drop and not dataclasses.replace(mtp, lookahead=1).drop
    # with the drop, a hit at 8 queries the peek chunk 2 and needs chunks 0..2; without it,
    # the plain window 0..1
    assert needed_range(mtp, 0, 8, 3) == (0, 3)
    assert needed_range(dataclasses.replace(mtp, lookahead=1), 0, 8, 3) == (0, 2)


HYBRID = [Group(0, 64, None, kind="full_attention"), Group(1, 16, 2, 32)]


def test_max_load_tokens_caps_the_lookup_as_each_release_orders_it() -> None:
    # the 18,877-token resend (hybrid: FA 64 + SWA 16), S = 0
    assert lookup_cap(HYBRID, 18_877, 0, None, None) == 18_816  # no cap
    assert lookup_cap(HYBRID, 18_877, 0, None, 0) == 0  # "0 disables external loading"
    # 0.33.0 takes the recomputed token off after the cap: 1,024 -> 1,023 -> 960
    assert lookup_cap(HYBRID, 18_877, 0, None, 1024) == 960
    assert lookup_cap(HYBRID, 18_877, 0, None, 1025) == 1024
    # 0.34.0 before it: a cap of k chunks serves k chunks
    assert lookup_cap(HYBRID, 18_877, 0, None, 1024, trim_first=True) == 1024
    assert lookup_cap(HYBRID, 18_877, 0, None, 63, trim_first=True) == 0
    # the cap counts from S, the GPU prefix hit, not from token 0
    assert lookup_cap(HYBRID, 18_877, 1000, None, 1024) == 1984
    # without a sliding-window group the order does not matter
    fa = HYBRID[:1]
    assert lookup_cap(fa, 18_877, 0, None, 1024) == lookup_cap(fa, 18_877, 0, None, 1024, True)
    assert trim_first_of({}) is False
    assert trim_first_of({"lookup_trims_before_caps": True}) is True


def test_the_partial_anchor_reads_as_the_older_code_where_the_header_has_none() -> None:
    assert partial_anchor_of({}) == "complete"  # every header before keytrace read it
    assert partial_anchor_of({"recurrent": {"hash_block_size": 16}}) == "complete"
    assert partial_anchor_of({"recurrent": {"partial_anchor": "complete"}}) == "complete"
    assert partial_anchor_of({"recurrent": {"partial_anchor": "fa_prefix"}}) == "fa_prefix"


def test_only_the_recognised_kv_transfer_params_are_read_as_vllm_validates_them() -> None:
    none = {"max_load_tokens": None, "max_offload_tokens": None, "kv_load_tiers": None}
    assert request_limits(None) == none
    assert request_limits({"prompt": "secret", "user": 7}) == none  # never arbitrary data
    assert request_limits({"max_load_tokens": 0, "max_offload_tokens": 1000}) == {
        **none,
        "max_load_tokens": 0,
        "max_offload_tokens": 1000,
    }
    # vLLM ignores (with a warning) anything but a non-negative int: bool, float, str, < 0
    for bad in (True, 1024.0, "1024", -1):
        assert request_limits({"max_load_tokens": bad, "max_offload_tokens": bad}) == none
    tiers = request_limits(
        {"kv_load_tiers": [{"medium": "cpu", "locality": "local", "x": 1}, "junk", {"medium": 3}]}
    )["kv_load_tiers"]
    # vLLM skips an entry that is not a dict or names an unknown (or non-string) value
    assert tiers == '[{"locality":"LOCAL","medium":"CPU"}]'
    assert request_limits({"kv_load_tiers": []})["kv_load_tiers"] == "[]"  # allows none
    assert request_limits({"kv_load_tiers": "cpu"})["kv_load_tiers"] is None  # vLLM: all
    # a non-empty list with no valid entry: vLLM falls back to every tier
    assert request_limits({"kv_load_tiers": [{"medium": "tape"}, 7]})["kv_load_tiers"] is None
    assert request_limits({"kv_load_tiers": [{}]})["kv_load_tiers"] == "[{}]"  # matches all


FS = {"index": 0, "medium": "STORAGE", "locality": None}
P2P = {"index": 1, "medium": "CPU", "locality": "REMOTE"}


@pytest.mark.parametrize(
    ("raw", "excluded"),
    [
        (None, []),
        ([], [0, 1]),
        ([{"medium": "storage"}], [1]),
        ([{"medium": "CPU"}], [0]),
        ([{"locality": "local"}], [1]),  # fs has no locality: matches any
        ([{"medium": "cpu", "locality": "local"}], [0, 1]),
        ([{"medium": "cpu"}, {"medium": "storage"}], []),
        ([{"medium": "tape"}], []),  # no valid entry: every tier
    ],
)
def test_the_tiers_a_request_excludes_are_those_its_filter_matches_none_of(
    raw: object, excluded: list[int]
) -> None:
    asked = request_limits({"kv_load_tiers": raw})["kv_load_tiers"]
    assert excluded_tiers(asked, [FS, P2P]) == excluded


def test_a_request_that_skips_external_kv_has_a_load_cap_of_0() -> None:
    assert load_cap(None, False) is None
    assert load_cap(1024, False) == 1024
    assert load_cap(1024, True) == 0
    assert load_cap(None, True) == 0
    df = pl.DataFrame(
        {"m": [None, 1024, 1024, None], "skip": [False, False, True, None]},
        schema={"m": pl.Int64, "skip": pl.Boolean},
    )
    got = df.select(load_cap(pl.col("m"), pl.col("skip")).alias("c"))["c"].to_list()
    assert got == [None, 1024, 0, None]


def test_the_chunk_max_offload_tokens_withholds() -> None:
    fa, swa = HYBRID
    # 1,000 tokens: FA stores 15 chunks (960), withholds chunk 15; SWA stores 62, withholds 62
    assert withheld_chunk(fa, 1000, 18_877) == 15
    assert withheld_chunk(swa, 1000, 18_877) == 62
    # a cap past the prompt's last complete chunk withholds nothing
    assert withheld_chunk(fa, 18_877, 18_877) is None
    assert withheld_chunk(fa, 0, 18_877) == 0


def test_a_cap_under_one_full_attention_chunk_past_a_local_hit_loads_nothing() -> None:
    # two blocks per chunk (FA chunk 128, SWA 32): the GPU prefix cache hit S = 704 ends
    # inside FA chunk 5. vLLM returns 0 when min(cap, keys) - S < 128: an 800-token
    # request's cap 799 is 95 past S
    groups = [Group(0, 128, None, kind="full_attention"), Group(1, 32, 1, 32)]
    assert lookup_cap(groups, 800, 704) == 0
    assert lookup_cap(groups, 1_000, 704) == 896
    assert lookup_cap(groups, 800, 640) == 768  # S a chunk boundary: as before
    # a request's max_load_tokens rounds the cap down to the chunk first (0.33.0: after
    # the recomputed token): 704 + 200 - 1 = 903 -> 896, 192 past S; 704 + 150 -> 768
    assert lookup_cap(groups, 2_000, 704, None, 200) == 896
    assert lookup_cap(groups, 2_000, 704, None, 150) == 0


def test_a_null_max_load_tokens_row_is_not_rounded_like_a_bounded_one() -> None:
    """The differ passes ``max_load_tokens`` as a column that is null where a request set
    none: only the rows with a bound round the cap down to the chunk (hypothesis found the
    polars form treating the whole column as bounded: 0 where vLLM returns 512)."""
    groups = [Group(0, 4, None, kind="full_attention"), Group(1, 256, None, kind="mla")]
    df = pl.DataFrame(
        {"N": [513, 513], "S": [257, 257], "ml": [None, 300]},
        schema={c: pl.Int64 for c in ("N", "S", "ml")},
    )
    caps = df.select(c=lookup_cap(groups, pl.col("N"), pl.col("S"), None, pl.col("ml")))["c"]
    assert caps.to_list() == [512, 0]
    assert [lookup_cap(groups, 513, 257, None, m) for m in (None, 300)] == [512, 0]


def test_a_full_attention_drafter_group_pops_its_last_keyed_chunk() -> None:
    """vLLM 0.33.0's lookup (and 0.34.0's without lookahead hashes) queries an EAGLE/MTP
    group one chunk past the hit within its keys and pops the last chunk it confirmed: a
    full-attention draft group (DeepSeek-V3's MLA MTP) serves one chunk below its last
    keyed one. A 1,000-token resend keys 15 chunks of 64 and is served 896 (the lab's real
    scheduler, tests/integration/test_sweep_cli.py); E is 896, not a mismatch at 960."""
    mla, mtp = Group(0, 64, None, kind="mla"), Group(1, 64, None, eagle=True, kind="mla")
    assert peek_cap(mtp, 1000) == 896
    assert lookup_cap([mla, mtp], 1000) == 896
    assert lookup_cap([mla, mtp], 1024) == 960  # 16 keyed: the peek past 960 is keyed
    assert lookup_cap([mla], 1000) == 960  # no drafter group: no pop
    # lookahead hashes (vLLM 0.34.0 with a drafter): no block is dropped
    ahead = dataclasses.replace(mtp, lookahead=1)
    assert not ahead.drop and lookup_cap([mla, ahead], 1001) == 960
    # the pop leaves under one chunk past a local hit: nothing to load
    assert lookup_cap([mla, mtp], 1000, local=896) == 0


def test_a_full_attention_drafter_group_needs_its_peek_chunk_resident() -> None:
    """Below its last keyed chunk the pop takes the peek: a hit at b needs the chunk past b
    to hit too, so such a group's resident prefix F ends one chunk before its leading HITs
    (the oracle's tiered DeepSeek-V3-like layout under DCP: E 1280 with the chunk past it
    absent, vLLM served 1152), and the peek chunk is needed where it is keyed."""
    from keytrace.judge.definitions import fa_prefix_end

    mtp = Group(1, 128, None, eagle=True, kind="mla")
    assert fa_prefix_end(0, 128, 10) == 1280
    assert fa_prefix_end(0, 128, 10, drop=True) == 1152
    assert fa_prefix_end(1152, 128, 1, drop=True) == 1152  # nothing past S: S
    assert needed_range(mtp, 0, 1152, 16) == (0, 10)  # the peek chunk 9 ([1152, 1280))
    assert needed_range(mtp, 0, 1920, 16) == (0, 16)  # the last keyed chunk is the peek
    assert needed_range(dataclasses.replace(mtp, lookahead=1), 0, 1152, 16) == (0, 9)
