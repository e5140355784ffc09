"""The partial-tail rules (`keytrace.judge.partial`): both evaluations (plain values for the
live alarm, polars columns for the differ) give one answer, and the worked cases of
docs/diff.md, "Partial tails". vLLM's own lookup code checks the model in
tests/integration/test_partial_rules.py."""

from __future__ import annotations

from typing import Any

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.judge import partial as p
from keytrace.judge.rules import PARTIAL_ANCHOR_COMPLETE, PARTIAL_ANCHOR_FA, Group

BS, TPH = 64, 16
FA = Group(3, BS, None, kind="full_attention")
R = [Group(g, BS, 1, kind="mamba", cow=True) for g in range(3)]
MAYBE = st.one_of(st.none(), st.integers(0, 900))


def _column(fn: Any, row: dict[str, Any], schema: dict[str, Any]) -> Any:
    frame = pl.DataFrame([row], schema=schema, orient="row")
    return frame.select(fn({k: pl.col(k) for k in schema}).alias("out"))["out"][0]


@settings(max_examples=300, deadline=None)
@given(
    P=st.integers(1, 900),
    extra=st.integers(0, 40),
    S=st.integers(0, 10),
    max_new=MAYBE,
    max_load=MAYBE,
    T=st.integers(0, 900),
    top=MAYBE,
    end=MAYBE,
    chunk=MAYBE,
)
def test_both_evaluations_agree(
    P: int,
    extra: int,
    S: int,
    max_new: int | None,
    max_load: int | None,
    T: int,
    top: int | None,
    end: int | None,
    chunk: int | None,
) -> None:
    N = P + extra
    H, S = N // TPH, S * BS
    schema = {
        "P": pl.Int64,
        "H": pl.Int64,
        "S": pl.Int64,
        "max_new": pl.Int64,
        "max_load": pl.Int64,
        "T": pl.Int64,
        "top": pl.Int64,
        "end": pl.Int64,
        "chunk": pl.Int64,
    }
    row = dict(
        P=P, H=H, S=S, max_new=max_new, max_load=max_load, T=T, top=top, end=end, chunk=chunk
    )
    L_p = p.partial_cap(P, H, TPH, S, max_new, max_load)
    assert L_p == _column(
        lambda c: p.partial_cap(
            c["P"],
            c["H"],
            TPH,
            c["S"],
            c["max_new"] if max_new is not None else None,
            c["max_load"] if max_load is not None else None,
        ),
        row,
        schema,
    )
    assert L_p % TPH == 0 and L_p <= max(0, P - 1)
    reach = p.partial_in_reach(T, S, top, L_p, BS)
    col = _column(lambda c: p.partial_in_reach(c["T"], c["S"], c["top"], L_p, BS), row, schema)
    assert reach == bool(col)
    got = p.offer_boundary(end, chunk, BS)
    assert got == _column(lambda c: p.offer_boundary(c["end"], c["chunk"], BS), row, schema)
    assert p.is_partial(T, BS) == _column(lambda c: p.is_partial(c["T"], BS), row, schema)


def test_the_cap_takes_the_recomputed_token_off_the_prompt_before_the_caps() -> None:
    # a 700-token prompt: the last hash boundary before its last token is 688
    assert p.partial_cap(700, 700 // TPH, TPH, 0) == 688
    # a resumed request of 760 tokens (700 of prompt): its output is never a tail
    assert p.partial_cap(700, 760 // TPH, TPH, 0) == 688
    # a load cap of 600 from S = 64: the cap is a hash boundary, 656 (no - 1 after it)
    assert p.partial_cap(700, 700 // TPH, TPH, 64, None, 600) == 656
    assert p.partial_cap(700, 700 // TPH, TPH, 0, None, 0) == 0  # skips reading external KV


def test_an_offer_names_a_tail_only_inside_a_block_and_without_a_chunk() -> None:
    assert p.offer_boundary(688, None, BS) == 688
    assert p.offer_boundary(640, None, BS) is None  # an aligned state: a chunk's key
    assert p.offer_boundary(640, 9, BS) is None
    assert p.offer_boundary(None, None, BS) is None


def test_the_expected_partial_boundary_lies_in_the_block_the_prefix_reaches() -> None:
    # tails at 688 (block 640) and 1000 (block 960); full attention resident to 640
    assert p.expected_partial([688, 1000], 0, 640, 1008, BS) == 688
    assert p.expected_partial([688, 1000], 0, 960, 1008, BS) == 1000
    assert p.expected_partial([688], 0, 576, 1008, BS) is None  # its block is not reached
    assert p.expected_partial([688], 0, 640, 672, BS) is None  # past the cap
    assert p.expected_partial([688], 704, 960, 1008, BS) is None  # below the local hit
    assert p.expected_partial([640], 0, 960, 1008, BS) is None  # aligned: E_c's
    assert p.expected_with_partial(640, 688) == 688
    assert p.expected_with_partial(None, 688) == 688
    assert p.expected_with_partial(None, None) is None


def test_the_window_and_its_probes_follow_the_anchor_rule() -> None:
    # C = 0 (no aligned state), the full-attention prefix reaches 640: 0.33.0 probes the
    # first block only, 0.34.0 the block past 640 down to C, skipping the aligned ones
    A33 = p.partial_anchor(PARTIAL_ANCHOR_COMPLETE, 0, 640)
    A34 = p.partial_anchor(PARTIAL_ANCHOR_FA, 0, 640)
    assert (A33, A34) == (0, 640)
    assert p.window_top(A33, 688, BS, TPH) == 48 and p.window_top(A34, 688, BS, TPH) == 688
    probes = p.probe_order(PARTIAL_ANCHOR_FA, 0, A34, 688, BS, TPH)
    assert probes[:4] == [688, 672, 656, 624] and 640 not in probes and probes[-1] == 16
    assert p.probe_order(PARTIAL_ANCHOR_COMPLETE, 0, 0, 48, BS, TPH) == [48, 32, 16]
    assert p.probe_order(PARTIAL_ANCHOR_COMPLETE, 640, 640, 640, BS, TPH) == []


def test_a_probe_hits_only_where_every_group_answered_hit() -> None:
    assert p.probe_hits(["HIT"] * 4)
    assert not p.probe_hits(["HIT", "HIT_PENDING", "HIT", "HIT"])
    assert p.probe_terminal(["HIT", "HIT_PENDING", "MISS"]) == 2  # the MISS ended it
    assert p.probe_terminal(["HIT", "RETRY", "HIT", "HIT"]) == 1
    assert p.probe_terminal(["HIT"] * 4) is None


def test_the_lookup_model_defers_a_pending_tail_only_without_a_complete_hit() -> None:
    def pending(b: int) -> list[str]:
        return ["HIT", "HIT_PENDING"] if b == 688 else ["MISS"]

    args = (PARTIAL_ANCHOR_FA, 0)
    assert p.partial_lookup(*args, 0, 640, 688, BS, TPH, pending) == (None, None)
    # W2: with a complete hit the pending tail is not waited for
    assert p.partial_lookup(*args, 640, 640, 688, BS, TPH, pending) == (640, None)
    hit = p.partial_lookup(*args, 640, 640, 688, BS, TPH, lambda b: ["HIT"] * 2)
    assert hit == (688, 688)
    assert p.partial_lookup(*args, None, 640, 688, BS, TPH, pending) == (None, None)


def test_what_a_partial_hit_needs_by_release() -> None:
    groups = [*R, FA]
    chunks, partial = p.partial_needed(groups, PARTIAL_ANCHOR_COMPLETE, 0, 688, BS)
    assert chunks == {0: range(9, 10), 1: range(9, 10), 2: range(9, 10), 3: range(0, 10)}
    assert partial == [0, 1, 2, 3]
    chunks, _ = p.partial_needed(groups, PARTIAL_ANCHOR_FA, 0, 688, BS)
    assert chunks == {3: range(0, 10)}  # 0.34.0: no aligned state needed
    chunks, _ = p.partial_needed(groups, PARTIAL_ANCHOR_COMPLETE, 640, 688, BS)
    assert chunks == {3: range(10, 10)}  # the block start is local: nothing looked up
    assert p.served_boundary(0, 688, BS) == 688 and p.served_boundary(0, 640, BS) is None
    assert p.probed_at([688, 672, None], 688) and not p.probed_at([672], 688)


def test_the_block_past_the_local_hit_is_in_reach_when_the_complete_part_loads_nothing() -> None:
    # P 21, S 16 (block 16, hash 4): the complete cap leaves under a chunk past S, so
    # lookup_cap is 0 (`rules.sub_chunk_cap`); vLLM still probes the window from S and
    # serves the tail at 20 (found by test_partial_rules against vLLM's own lookup)
    bs, S = 16, 16
    L_p = p.partial_cap(21, 5, 4, S)
    assert L_p == 20
    assert p.partial_in_reach(20, S, 0, L_p, bs)
    assert p.expected_partial([20], S, 0, L_p, bs) == 20
    # a block further is not: its start is past the cap
    assert not p.partial_in_reach(36, S, 0, 40, bs)
    schema = {"T": pl.Int64, "S": pl.Int64, "top": pl.Int64}
    col = _column(
        lambda c: p.partial_in_reach(c["T"], c["S"], c["top"], L_p, bs),
        {"T": 20, "S": S, "top": 0},
        schema,
    )
    assert bool(col)
