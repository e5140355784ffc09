"""Verdicts as pure functions (keytrace.analysis.verdict), on frames built by hand."""

from __future__ import annotations

import polars as pl
import pytest

from keytrace.analysis.verdict import base_verdict, reason, shortfall_verdicts

NO_LIMIT = (pl.lit(None, pl.Int64).alias("E_free"), pl.lit(None, pl.String).alias("stored_limit"))
"""An episode no limit touched: no load cap (no E without one), no key a limit kept away."""


@pytest.mark.parametrize(
    ("S", "X", "E", "expected"),
    [
        (0, None, 1_024, "deferred"),
        (0, 0, None, "cold"),
        (0, 1_024, 1_024, "hit"),
        (0, 1_023, 1_024, "shortfall"),
        # X counts tokens beyond the local prefix S: a hit needs X >= E - S
        (256, 768, 1_024, "hit"),
        (256, 767, 1_024, "shortfall"),
    ],
)
def test_base_verdict(S: int, X: int | None, E: int | None, expected: str) -> None:
    df = pl.DataFrame(
        {"S": [S], "X": [X], "E": [E], "deferrals": [1 if X is None else None], "waited": [0]},
        schema={
            "S": pl.Int64,
            "X": pl.Int64,
            "E": pl.Int64,
            "deferrals": pl.Int64,
            "waited": pl.Int64,
        },
    ).with_columns(NO_LIMIT)
    assert df.select(base_verdict())[0, 0] == expected


@pytest.mark.parametrize(
    ("deferrals", "waited", "expected"),
    [
        (49, 29_999_999_999, "deferred"),
        (50, 0, "stalled"),  # the 50th consecutive deferral of the request
        (1, 30_000_000_000, "stalled"),  # or 30 s after the first
    ],
)
def test_a_request_deferred_without_end_is_stalled(
    deferrals: int, waited: int, expected: str
) -> None:
    df = pl.DataFrame(
        {"S": [0], "X": [None], "E": [1_024], "deferrals": [deferrals], "waited": [waited]},
        schema={
            "S": pl.Int64,
            "X": pl.Int64,
            "E": pl.Int64,
            "deferrals": pl.Int64,
            "waited": pl.Int64,
        },
    ).with_columns(NO_LIMIT)
    assert df.select(base_verdict())[0, 0] == expected


# needed chunks per episode s: (cause, binding)
NEEDED = {
    1: [("resident", True), ("never_offered", False), ("resident", False)],
    2: [("evicted", True), ("in_flight", False)],
    3: [("resident", True), ("in_flight", False)],
    4: [("resident", True), ("resident", False)],
    5: [("resident", True), ("resident", False)],
    6: [("resident", True), ("resident", False)],
    7: [("not_looked_up", True), ("resident", False)],
    # 8: no needed rows at all
    9: [("in_flight", True), ("other_group", True)],
}
TERM = {4: "HIT_PENDING", 5: "RETRY", 9: "HIT_PENDING"}


def verdicts() -> dict[int, tuple[str, list[str]]]:
    needed = pl.DataFrame(
        [(0, s, 1, c, b) for s, rows in NEEDED.items() for c, b in rows],
        schema={
            "inst": pl.Int64,
            "s": pl.Int64,
            "gid": pl.Int64,
            "cause": pl.String,
            "binding": pl.Boolean,
        },
        orient="row",
    )
    terminals = pl.DataFrame(
        {
            "inst": [0] * 9,
            "s": list(range(1, 10)),
            "term_result": [TERM.get(s) for s in range(1, 10)],
        },
        schema={"inst": pl.Int64, "s": pl.Int64, "term_result": pl.String},
    )
    out = shortfall_verdicts(needed, terminals)
    assert out.height == 9  # every shortfall episode, with or without needed rows
    return {r["s"]: (r["verdict"], r["decisive"]) for r in out.iter_rows(named=True)}


@pytest.mark.parametrize(
    ("s", "verdict", "decisive"),
    [
        (1, "mismatch", ["never_offered"]),  # one rule cause is enough, binding or not
        (2, "explained", ["evicted"]),  # the binding group's absent chunks decide
        (3, "explained", ["in_flight"]),  # else every absent chunk's causes
        (4, "explained", []),  # everything resident, but the binding key was still pending
        (5, "explained", []),
        (6, "mismatch", []),  # everything resident and lookup fell short anyway
        (7, "mismatch", []),  # a key not looked up is not absent
        (8, "mismatch", []),  # no needed rows: nothing explains the shortfall
        (9, "mismatch", ["other_group"]),  # a rule cause outranks a pending binding key
    ],
)
def test_shortfall_verdicts(s: int, verdict: str, decisive: list[str]) -> None:
    # built per case (not a fixture): a mutation tester maps each case to what it calls
    assert verdicts()[s] == (verdict, decisive)


def test_reason_lines() -> None:
    assert reason("limited", ["tier_excluded"], "MISS") == (
        "by request: kv_load_tiers: only on secondary tiers the request's kv_load_tiers "
        "excluded from its lookup"
    )
    # a rule mismatch names only the rule causes, even when timing causes are decisive too
    assert reason("mismatch", ["evicted", "never_offered"], None) == (
        "lookup needed chunks the store path did not keep: never offered by the store path"
    )
    # a cause this version has no text for is printed as its name
    assert reason("explained", ["novel_cause"], None).endswith(": novel_cause")
    assert (
        reason("explained", [], "RETRY")
        == "lookup saw RETRY at the binding key: the store had not finished"
    )
    assert reason("explained", ["evicted", "in_flight", "evicted"], None) == (
        "shortfall explained by timing/capacity/routing: evicted before the episode; "
        "store in flight at the lookup (prepared before it, not yet completed)"
    )
    assert reason("mismatch", [], None) == (
        "every chunk vLLM's rule needs for a hit at E was resident, yet lookup fell short"
    )
    assert reason("mismatch", ["never_offered", "rejected"], None) == (
        "lookup needed chunks the store path did not keep: never offered by the store path; "
        "offered but declined by prepare_store"
    )
