"""Why a needed key was absent (keytrace.analysis.history.causes), on frames built by hand.

Each case is one probe (one key one episode needed, at sequence number ``s`` = 100 and wall
clock ``t`` = 100) against a few store rows, so every branch of the precedence in
docs/diff.md has a case where only that branch decides. Sequence numbers are unique per
process in a real trace (one counter for every recorder row), so no case puts a store row
at ``seq == s``.
"""

from __future__ import annotations

import hashlib

import polars as pl
import pytest

from keytrace.analysis.history import causes

S = T = 100
GIDS = (0, 1, 2)


def key(name: str, gid: int) -> bytes:
    return hashlib.sha256(name.encode()).digest() + gid.to_bytes(4, "big")


K = key("k", 1)  # the probed key: hash "k" under group 1


def stores(
    *rows: tuple[int, str, bytes | None] | tuple[int, str, bytes | None, int, int],
) -> pl.LazyFrame:
    """Rows ``(seq, event, key[, inst, ts])``; ts defaults to seq, inst to 0."""
    full = [(*r, 0, r[0]) if len(r) == 3 else r for r in rows]
    return pl.DataFrame(
        {
            "inst": [r[3] for r in full],
            "seq": [r[0] for r in full],
            "ts": [r[4] for r in full],
            "event": [r[1] for r in full],
            "key": [r[2] for r in full],
            "gid": [None if r[2] is None else int.from_bytes(r[2][-4:], "big") for r in full],
        },
        schema={
            "inst": pl.Int64,
            "seq": pl.Int64,
            "ts": pl.Int64,
            "event": pl.String,
            "key": pl.Binary,
            "gid": pl.Int64,
        },
    ).lazy()


def probe(token_end: int = 64, keyable_end: int | None = 1_000) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "pid": [0],
            "inst": [0],
            "s": [S],
            "t": [T],
            "key": [K],
            "gid": [1],
            "token_end": [token_end],
            "keyable_end": [keyable_end],
        },
        schema_overrides={"key": pl.Binary, "keyable_end": pl.Int64},
    )


def cause(*rows: tuple, p: pl.DataFrame | None = None) -> str:  # type: ignore[type-arg]
    out = causes(probe() if p is None else p, stores(*rows), GIDS)
    assert out.height == 1
    return str(out["cause"][0])


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # completed before s, nothing removed since (even with the smallest sequence numbers)
        ([(0, "prepared", K), (1, "completed", K)], "resident"),
        # evicted, then stored again: the last completion is after the last removal
        (
            [
                (10, "prepared", K),
                (20, "completed", K),
                (30, "evicted", K),
                (40, "prepared", K),
                (50, "completed", K),
            ],
            "resident",
        ),
        ([(10, "prepared", K), (20, "completed", K), (30, "evicted", K)], "evicted"),
        # a tier reset removes everything completed before it
        ([(10, "prepared", K), (20, "completed", K), (30, "reset", None)], "evicted"),
        # a reset after the lookup changes nothing
        ([(10, "prepared", K), (20, "completed", K), (130, "reset", None)], "resident"),
        # prepared, not settled at s
        ([(20, "prepared", K)], "in_flight"),
        ([(20, "prepared", K), (120, "completed", K)], "in_flight"),
        # prepared again after a reset, not settled yet
        (
            [(10, "prepared", K), (20, "completed", K), (30, "reset", None), (40, "prepared", K)],
            "in_flight",
        ),
        # settled by a failure: not in flight, the store failed
        ([(20, "prepared", K), (30, "failed", K)], "store_failed"),
        ([(20, "rejected", K)], "rejected"),
        # a store offered only after the lookup explains nothing
        ([(120, "prepared", K), (130, "completed", K)], "never_offered"),
    ],
)
def test_own_instance_history(rows: list[tuple], expected: str) -> None:  # type: ignore[type-arg]
    assert cause(*rows) == expected


@pytest.mark.parametrize(
    ("ts", "expected"),
    [(50, "other_engine"), (T, "never_offered"), (150, "never_offered")],
)
def test_another_engine_counts_only_strictly_before_the_lookup(ts: int, expected: str) -> None:
    assert cause((20, "prepared", K, 1, ts)) == expected
    assert cause((20, "rejected", K, 1, ts)) == expected


def test_another_engine_is_a_routing_miss_before_a_capacity_or_rule_cause() -> None:
    assert cause((20, "rejected", K), (21, "prepared", K, 1, 21)) == "other_engine"
    # a store that failed here while another engine had the key: routing, not capacity
    assert cause((20, "prepared", K), (30, "failed", K), (21, "prepared", K, 1, 21)) == (
        "other_engine"
    )
    assert cause((20, "failed", K), (21, "rejected", K)) == "store_failed"


def test_evicted_outranks_another_engine() -> None:
    rows = [
        (10, "prepared", K),
        (20, "completed", K),
        (30, "evicted", K),
        (40, "prepared", K, 1, 40),
    ]
    assert cause(*rows) == "evicted"


def test_same_hash_completed_under_another_group_id() -> None:
    other = key("k", 0)
    assert cause((10, "prepared", other), (20, "completed", other)) == "other_group"
    # only prepared there, never completed: not stored under the other id
    assert cause((10, "prepared", other)) == "never_offered"
    # completed there only after the lookup
    assert cause((110, "prepared", other), (120, "completed", other)) == "never_offered"
    # this group id did reach the store path (another key of group 1, prepared before s)
    rows = [(5, "prepared", key("x", 1)), (10, "prepared", other), (20, "completed", other)]
    assert cause(*rows) == "never_offered"


def test_keyable_end_separates_never_offered_from_not_keyable() -> None:
    assert cause(p=probe(token_end=64, keyable_end=64)) == "never_offered"
    assert cause(p=probe(token_end=65, keyable_end=64)) == "not_keyable"
    assert cause(p=probe(token_end=1, keyable_end=None)) == "not_keyable"


def test_no_probes_gives_an_empty_string_column() -> None:
    out = causes(probe().clear(), stores((1, "completed", K)), GIDS)
    assert out.height == 0 and out.schema["cause"] == pl.String
