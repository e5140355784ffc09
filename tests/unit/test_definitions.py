"""keytrace's definitions (keytrace.judge.definitions) are written once and evaluated two
ways: by the live alarm on plain values, by the differ on polars columns. For random facts,
both evaluations of every definition give the same answer; the tables say what
docs/diff.md says, in its order; and the precedences the tables encode are pinned by worked
cases, so reordering a table fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.judge import definitions as d
from keytrace.judge.ops import cases, known
from keytrace.judge.rules import Group

DOCS = Path(__file__).resolve().parents[2] / "docs" / "diff.md"
SEQ = st.one_of(st.none(), st.integers(0, 40))
FLAG = st.booleans()


def evaluated(fn: Any, rows: list[dict[str, Any]], schema: dict[str, Any]) -> list[Any]:
    """``fn`` of each row as a polars column: the differ's evaluation."""
    frame = pl.DataFrame(rows, schema=schema, orient="row")
    cols = {name: pl.col(name) for name in schema}
    return frame.select(fn(cols).alias("out"))["out"].to_list()


FACT_SCHEMA = {
    "s": pl.Int64,
    "completed": pl.Int64,
    "evicted": pl.Int64,
    "reset": pl.Int64,
    "prepared": pl.Int64,
    "failed": pl.Int64,
    "rejected": pl.Boolean,
    "other_engine": pl.Boolean,
    "sibling_stored": pl.Boolean,
    "own_first_prepared": pl.Int64,
    "token_end": pl.Int64,
    "keyable_end": pl.Int64,
    "durable": pl.Boolean,
    "held": pl.Boolean,
    "no_room": pl.Boolean,
    "own_promotion_evicted": pl.Boolean,
    "evicted_now": pl.Boolean,
    "crowded": pl.Boolean,
    "fits": pl.Boolean,
    "unsettled": pl.Boolean,
    "unasked": pl.Boolean,
    "recurrent": pl.Boolean,
    "excluded": pl.Boolean,
}
FACTS = st.fixed_dictionaries(
    {
        "s": st.integers(0, 40),
        "completed": SEQ,
        "evicted": SEQ,
        "reset": SEQ,
        "prepared": SEQ,
        "failed": SEQ,
        "rejected": FLAG,
        "other_engine": FLAG,
        "sibling_stored": FLAG,
        "own_first_prepared": SEQ,
        "token_end": st.integers(1, 40),
        "keyable_end": SEQ,
        "durable": FLAG,
        "held": FLAG,
        "no_room": FLAG,
        "own_promotion_evicted": FLAG,
        "evicted_now": FLAG,
        "crowded": FLAG,
        "fits": FLAG,
        "unsettled": FLAG,
        "unasked": FLAG,
        "recurrent": FLAG,
        "excluded": FLAG,
    }
)


@settings(max_examples=60, deadline=None)
@given(st.lists(FACTS, min_size=1, max_size=40))
def test_the_cause_table_gives_one_answer_on_values_and_on_columns(rows: list[dict]) -> None:  # type: ignore[type-arg]
    plain = [d.cause(d.KeyFacts(**r)) for r in rows]
    assert evaluated(lambda c: d.cause(d.KeyFacts(**c)), rows, FACT_SCHEMA) == plain
    assert set(plain) <= set(d.CAUSE_ORDER)


BOUNDARY = st.one_of(st.none(), st.integers(0, 60))
STORE_LIMIT = st.one_of(st.none(), st.sampled_from([str(v) for v in d.STORE_LIMITS.values()]))
EPISODE = st.fixed_dictionaries(
    {
        "S": st.integers(0, 50),
        "X": SEQ,
        "E": BOUNDARY,
        "E_free": BOUNDARY,
        "stored_limit": STORE_LIMIT,
    }
)
EPISODE_SCHEMA = {
    "S": pl.Int64,
    "X": pl.Int64,
    "E": pl.Int64,
    "E_free": pl.Int64,
    "stored_limit": pl.String,
}


@settings(max_examples=60, deadline=None)
@given(st.lists(EPISODE, min_size=1, max_size=40))
def test_base_verdicts_give_one_answer(rows: list[dict]) -> None:  # type: ignore[type-arg]
    plain = [d.base_verdict(d.EpisodeNumbers(**r)) for r in rows]
    assert evaluated(lambda c: d.base_verdict(d.EpisodeNumbers(**c)), rows, EPISODE_SCHEMA) == plain
    skips = [{**r, "skip": i % 2 == 0} for i, r in enumerate(rows)]
    limits = [d.limit_of(r["E"], r["E_free"], r["stored_limit"], r["skip"]) for r in skips]
    schema = {**EPISODE_SCHEMA, "skip": pl.Boolean}
    assert (
        evaluated(
            lambda c: d.limit_of(c["E"], c["E_free"], c["stored_limit"], c["skip"]), skips, schema
        )
        == limits
    )


LIMIT_ROWS = st.fixed_dictionaries(
    {
        "verdict": st.sampled_from([str(v) for v in d.Verdict]),
        "E": BOUNDARY,
        "E_free": BOUNDARY,
        "L": st.integers(0, 60),
        "served": st.integers(0, 60),
        "event": st.one_of(
            st.none(), st.sampled_from(["prepared", "rejected", "filtered", "withheld"])
        ),
    }
)


@settings(max_examples=60, deadline=None)
@given(st.lists(LIMIT_ROWS, min_size=1, max_size=40))
def test_the_limit_rules_give_one_answer(rows: list[dict]) -> None:  # type: ignore[type-arg]
    schema = {
        "verdict": pl.String,
        "E": pl.Int64,
        "E_free": pl.Int64,
        "L": pl.Int64,
        "served": pl.Int64,
        "event": pl.String,
    }

    def tokens(c: dict[str, Any]) -> Any:
        return d.by_request_tokens(c["verdict"], c["E"], c["E_free"], c["L"], c["served"])

    assert evaluated(tokens, rows, schema) == [tokens(r) for r in rows]
    named = [d.store_limit(r["event"]) for r in rows]
    assert evaluated(lambda c: d.store_limit(c["event"]), rows, schema) == named
    capped = [bool(d.load_capped(r["E"], r["E_free"])) for r in rows]
    assert evaluated(lambda c: d.load_capped(c["E"], c["E_free"]), rows, schema) == capped
    ceiling = [d.free_ceiling(r["served"], r["E"], r["L"]) for r in rows]
    assert evaluated(lambda c: d.free_ceiling(c["served"], c["E"], c["L"]), rows, schema) == ceiling


def test_what_a_limit_decides() -> None:
    """Worked cases: a cap that kept a boundary away is limited; a shortfall below the cap
    is still a shortfall (judged against E under the cap); a key a limit kept from the tier
    names a cold episode; nothing else does."""

    def verdict(**kw: Any) -> str:
        return str(d.base_verdict(d.EpisodeNumbers(**kw)))

    # max_load_tokens=0 (or a cap below every boundary): no E, E_free 18,816
    assert verdict(S=0, X=0, E=None, E_free=18_816) == "limited"
    assert d.limit_of(None, 18_816, None) == "max_load_tokens"
    assert d.limit_of(None, 18_816, None, True) == "skip_reading_prefix_cache"
    # the cap served E = 960 of E_free = 18,816
    assert verdict(S=0, X=960, E=960, E_free=18_816) == "limited"
    # ... but short of E under the cap is a shortfall, whatever the cap kept away
    assert verdict(S=0, X=0, E=960, E_free=18_816) == "shortfall"
    # a cap that bound nothing: a plain hit / cold
    assert verdict(S=0, X=960, E=960, E_free=960) == "hit"
    assert verdict(S=0, X=0, E=None) == "cold"
    # a cold episode whose scan ended at a filtered or withheld key
    assert verdict(S=0, X=0, E=None, stored_limit="store_threshold") == "limited"
    assert d.limit_of(None, None, "store_threshold") == "store_threshold"
    assert d.store_limit("withheld") == "max_offload_tokens"
    assert d.store_limit("filtered") == "store_threshold"
    assert d.store_limit("rejected") is None
    # a deferral is a deferral
    assert verdict(S=0, X=None, E=None, E_free=64) == "deferred"
    # the token account: limited from what was served to E_free (or L for a store limit);
    # a shortfall below a cap, from E to E_free
    assert d.by_request_tokens("limited", None, 18_816, 960, 0) == 18_816
    assert d.by_request_tokens("limited", 960, 18_816, 960, 960) == 17_856
    assert d.by_request_tokens("limited", None, None, 18_816, 0) == 18_816
    assert d.by_request_tokens("mismatch", 960, 18_816, 960, 0) == 17_856
    assert d.by_request_tokens("cold", None, None, 18_816, 0) == 0
    # past the cap a capped scan never looked: F bounds only where it ended below the cap
    assert d.free_ceiling(960, 960, 18_816) == 18_816
    assert d.free_ceiling(960, 512, 18_816) == 512


CAUSES = st.lists(st.sampled_from([*d.CAUSE_ORDER, d.UNSEEN]), max_size=4)
RESULTS = st.one_of(st.none(), st.sampled_from(["MISS", "HIT", "HIT_PENDING", "RETRY"]))


NEEDED = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from([*d.CAUSE_ORDER, d.UNSEEN])), max_size=6
)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(NEEDED, st.integers(0, 2), RESULTS), min_size=1, max_size=30))
def test_shortfall_verdicts_decisive_causes_and_the_naming_cause_give_one_answer(
    rows: list[tuple[list[tuple[int, str]], int, str | None]],
) -> None:
    """Candidate lists built from (group, cause) of the needed chunks (`candidates_of`, the
    alarm's way), then the verdict, the decisive causes and the naming cause, on values and
    on list columns (the differ's way)."""
    names = [f"c{i}" for i in range(len(d.DECISIVE_ORDER))]
    dicts = []
    for needed, binding, term in rows:
        lists = d.candidates_of(needed, binding)
        dicts.append({**dict(zip(names, lists, strict=True)), "term": term})
    schema = {**{n: pl.List(pl.String) for n in names}, "term": pl.String}

    def verdict(c: Any) -> Any:
        return d.shortfall_verdict(d.shortfall_facts([c[n] for n in names], c["term"]))

    def decisive(c: Any) -> Any:
        return d.decisive([c[n] for n in names])

    def naming(c: Any) -> Any:
        return d.shortfall_cause(decisive(c), c["term"])

    for fn in (verdict, decisive, naming):
        assert evaluated(fn, dicts, schema) == [fn(r) for r in dicts]


def test_a_blocking_cause_outranks_a_tier_rule_not_a_store_rule() -> None:
    """A tiered manager cannot serve what is on no tier (here: a peek chunk whose store
    failed), so a tier failure beside it is not what decided; a store rule decides always."""

    def judged(causes: list[tuple[int, str]]) -> tuple[str, list[str]]:
        cands = d.candidates_of(causes, 2)
        return str(d.shortfall_verdict(d.shortfall_facts(cands, "MISS"))), list(d.decisive(cands))

    tier = [(1, "promotion_evicted"), (2, "promotion_evicted")]
    assert judged([*tier, (2, "store_failed")]) == ("explained", ["store_failed"])
    assert judged(tier) == ("mismatch", ["promotion_evicted"])
    assert judged([*tier, (2, "store_failed"), (1, "never_offered")]) == (
        "mismatch",
        ["never_offered"],
    )
    # timing on a tier (a promotion under way) does not explain a tier failure away
    assert judged([(2, "promotion_starved"), (1, "promoting")]) == (
        "mismatch",
        ["promotion_starved"],
    )
    assert judged([(1, "promoting")]) == ("explained", ["promoting"])


def test_a_tier_the_request_excluded_limits_only_where_nothing_else_decides() -> None:
    """``tier_excluded`` (the request's ``kv_load_tiers``) makes a shortfall ``limited``
    only where no rule and no blocking cause decides; its limit is ``kv_load_tiers``."""

    def judged(causes: list[tuple[int, str]]) -> tuple[str, list[str], Any]:
        cands = d.candidates_of(causes, 2)
        decisive = list(d.decisive(cands))
        verdict = str(d.shortfall_verdict(d.shortfall_facts(cands, "MISS")))
        return verdict, decisive, d.limit_of_causes(decisive)

    assert judged([(1, "tier_excluded"), (2, "tier_excluded")]) == (
        "limited",
        ["tier_excluded"],
        "kv_load_tiers",
    )
    # a timing cause beside it does not take the request's own choice away
    assert judged([(2, "tier_excluded"), (1, "promoting")])[0] == "limited"
    assert judged([(2, "tier_excluded"), (2, "evicted")])[:2] == ("explained", ["evicted"])
    assert judged([(2, "tier_excluded"), (1, "secondary_resident")])[0] == "mismatch"
    assert judged([(2, "tier_excluded"), (1, "never_offered")])[0] == "mismatch"
    assert d.limit_of_causes(["evicted"]) is None and d.limit_of_causes([]) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 200),
            st.integers(0, 200),
            SEQ,
            SEQ,
            st.one_of(st.none(), st.integers(0, 300)),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_F_E_and_shortfall_tokens_give_one_answer(
    rows: list[tuple[int, int, int | None, int | None, int | None]],
) -> None:
    groups = [
        Group(0, 16, None, kind="full_attention"),
        Group(1, 32, None, kind="full_attention"),
        Group(2, 16, 2, sliding_window=32),
    ]
    dicts = [
        {"S": S, "N": S + n, "lead0": a, "lead1": b, "chain": c, "A": a, "X": b}
        for S, n, a, b, c in rows
    ]
    schema = {k: pl.Int64 for k in dicts[0]}

    def numbers(c: dict[str, Any]) -> Any:
        F = d.resident_prefix(c["S"], groups, lambda gid: c[f"lead{gid}"])
        top = d.match_ceiling(c["N"], F)
        E = d.expected_boundary(c["S"], c["chain"], d.standing_boundaries(top, groups, 48), groups)
        gpu, offload = d.served(c["S"], c["N"], c["A"], c["X"])
        return F, E, cases([(known(E), lambda: d.short_of_E(E, gpu, offload))], None)

    for part in range(3):
        plain = [numbers(r)[part] for r in dicts]
        assert evaluated(lambda c, i=part: numbers(c)[i], dicts, schema) == plain


def test_better_cause_gives_one_answer() -> None:
    causes = [*d.CAUSE_ORDER, d.UNSEEN, None]
    pairs = [{"a": a, "b": b} for a in causes for b in causes]
    schema = {"a": pl.String, "b": pl.String}
    plain = [d.better_cause(p["a"], p["b"]) for p in pairs]
    assert evaluated(lambda c: d.better_cause(c["a"], c["b"]), pairs, schema) == plain


# -------------------------------------------------------------- the tables, as written
def docs_table(heading: str) -> list[str]:
    """The first column (backquoted names) of the table under ``heading`` in docs/diff.md."""
    text = DOCS.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.M)


def test_the_cause_precedence_is_the_documented_one() -> None:
    assert list(d.CAUSE_ORDER) == [c for c in docs_table("Causes") if c != d.UNSEEN]
    assert d.CAUSE_ORDER[-1] == d.LAST_CAUSE
    assert [c for c in d.CAUSE_ORDER if c in d.EXPLAINED_CAUSES] == list(d.EXPLAINED_CAUSES)
    assert [c for c in d.CAUSE_ORDER if c in d.RULE_CAUSES] == list(d.RULE_CAUSES)


def test_the_verdicts_are_the_documented_ones() -> None:
    documented = docs_table("Verdicts")
    base = [name for name, _ in d.BASE_VERDICTS]
    assert documented[: len(base)] == base
    # a shortfall can also end `limited` (a base verdict too, documented once)
    assert set(documented[len(base) :]) == {name for name, _ in d.SHORTFALL_VERDICTS} - set(base)


def facts(**kw: Any) -> d.KeyFacts:
    """Facts of a key at s = 100 with nothing recorded, then ``kw``."""
    base: dict[str, Any] = dict.fromkeys(FACT_SCHEMA)
    base.update(s=100, rejected=False, other_engine=False, sibling_stored=False, token_end=64)
    base.update(durable=False, held=False, no_room=False, own_promotion_evicted=False, fits=True)
    base.update(unsettled=False, unasked=False, evicted_now=False, crowded=False, recurrent=False)
    base.update(excluded=False)
    base.update(kw)
    return d.KeyFacts(**base)


def test_each_precedence_in_the_cause_table() -> None:
    """Every adjacent pair of causes, with the facts of both present: the earlier wins."""
    tier = {"durable": True}
    both = [
        ("resident", "on_tier", facts(completed=20, unasked=True, **tier)),
        ("on_tier", "in_flight", facts(prepared=30, unasked=True, **tier)),
        ("in_flight", "promoting", facts(prepared=30, unsettled=True, **tier)),
        ("promoting", "promotions_held", facts(unsettled=True, held=True, **tier)),
        ("promotions_held", "promotion_no_room", facts(held=True, fits=False, **tier)),
        (
            "promotion_no_room",
            "promotion_evicted",
            facts(fits=False, own_promotion_evicted=True, **tier),
        ),
        (
            "promotion_evicted",
            "primary_busy",
            facts(own_promotion_evicted=True, no_room=True, crowded=True, **tier),
        ),
        ("primary_busy", "promotion_starved", facts(no_room=True, crowded=True, **tier)),
        ("promotion_starved", "secondary_resident", facts(no_room=True, **tier)),
        ("secondary_resident", "tier_excluded", facts(excluded=True, **tier)),
        ("tier_excluded", "evicted", facts(completed=20, evicted=30, excluded=True)),
        ("evicted", "other_engine", facts(completed=20, evicted=30, other_engine=True)),
        ("other_engine", "store_failed", facts(prepared=20, failed=30, other_engine=True)),
        ("store_failed", "rejected", facts(failed=30, rejected=True)),
        ("rejected", "no_checkpoint", facts(rejected=True, sibling_stored=True, recurrent=True)),
        ("no_checkpoint", "other_group", facts(sibling_stored=True, recurrent=True)),
        ("other_group", "never_offered", facts(sibling_stored=True, keyable_end=1000)),
        ("never_offered", "not_keyable", facts(keyable_end=64)),
    ]
    assert [(a, b) for a, b, _ in both] == list(zip(d.CAUSE_ORDER, d.CAUSE_ORDER[1:], strict=False))
    for earlier, _later, f in both:
        assert d.cause(f) == earlier
    assert d.cause(facts()) == "not_keyable"
    assert (
        d.cause(facts(completed=20, evicted=30, no_room=True, fits=True)) == "evicted"
    )  # not durable
    # resident and in flight at s, but the episode's own promotions evicted it during the
    # lookup: neither (a tiered lookup changes the primary it reads)
    for was in (facts(completed=20), facts(prepared=30)):
        gone = dataclasses.replace(was, evicted_now=True, durable=True, fits=False)
        assert d.cause(was) in ("resident", "in_flight")
        assert d.cause(gone) == "promotion_no_room"
    # crowded alone (no promotion found no room) says nothing; a busy primary is timing
    assert d.cause(facts(crowded=True, **tier)) == "secondary_resident"
    assert "primary_busy" in d.EXPLAINED_CAUSES and "promotion_starved" in d.RULE_CAUSES
    # this group id reached the store path before s: a sibling says nothing
    assert d.cause(facts(sibling_stored=True, own_first_prepared=50, keyable_end=64)) == (
        "never_offered"
    )


def test_a_busy_primary_is_counted_beside_the_work_in_flight() -> None:
    # 8 chunks needed, a 20-chunk primary: 12 slots held by others leave exactly room
    assert d.held_by_others(10, 7, 5) == 12
    assert not d.crowded(8, 20, 12) and d.crowded(8, 20, 13)
    assert not d.crowded(8, None, 10_000)  # an unknown capacity is never crowded
    frame = pl.DataFrame({"n": [8, 8], "held": [12, 13]})
    assert frame.select(d.crowded(pl.col("n"), 20, pl.col("held")))["n"].to_list() == [
        False,
        True,
    ]


def test_the_evaluator_is_lazy_for_plain_values() -> None:
    """A later condition may assume an earlier one false (E known once not cold): for plain
    values the chain stops at the first match, as ``if/elif`` would."""
    assert d.base_verdict(d.EpisodeNumbers(S=0, X=None, E=None)) == "deferred"
    assert d.base_verdict(d.EpisodeNumbers(S=0, X=5, E=None)) == "cold"
    assert d.base_verdict(d.EpisodeNumbers(S=0, X=5, E=5)) == "hit"
    assert d.base_verdict(d.EpisodeNumbers(S=0, X=4, E=5)) == "shortfall"


@pytest.mark.parametrize(
    ("req_id", "named", "same"),
    [
        ("cmpl-b9ee44ee58fc8024-0-9a8fd555", "cmpl-b9ee44ee58fc8024", True),  # the API's id
        ("cmpl-b9ee44ee58fc8024-1-1f2e3d4c", "cmpl-b9ee44ee58fc8024", True),  # choice 1
        ("cmpl-b9ee44ee58fc8024-0-9a8fd555", "cmpl-b9ee44ee58fc8024-0-9a8fd555", True),
        ("cmpl-b9ee44ee58fc80249-0-9a8fd555", "cmpl-b9ee44ee58fc8024", False),  # another id
        ("r1", "r1", True),
        ("r10", "r1", False),
        (None, "r1", False),
    ],
)
def test_a_request_is_named_by_vllm_s_id_or_the_api_s(
    req_id: str | None, named: str, same: bool
) -> None:
    assert d.is_request(req_id, named) is same
    frame = pl.DataFrame({"req_id": [req_id]}, schema={"req_id": pl.Categorical})
    assert frame.select(d.is_request(pl.col("req_id"), named).fill_null(False)).item() is same


# ------------------------------------------------- which rows a rule applies to (selection)
FA16 = Group(0, 16, None, kind="full_attention")
SWA16 = Group(1, 16, 2, sliding_window=32)
MTP16 = Group(2, 16, 2, sliding_window=32, eagle=True)
SELECTION_GROUPS = [FA16, SWA16, MTP16]


def test_which_groups_list_their_needed_chunks() -> None:
    # full attention: resident by construction (E <= F) unless a tier may hold it
    assert [d.lists_needed(g, False) for g in SELECTION_GROUPS] == [False, True, True]
    assert [d.lists_needed(g, True) for g in SELECTION_GROUPS] == [True, True, True]


def test_keyed_chunks_count_a_tail_proof_for_an_eagle_group_only() -> None:
    # 10 hash blocks of 16 tokens: 10 keyed 16-token chunks; a proof of the peek chunk the
    # prompt cannot key makes it 11 in an EAGLE group's list, nowhere else
    assert [d.keyed_chunks(g, 10, 16) for g in SELECTION_GROUPS] == [10, 10, 10]
    assert [d.keyed_chunks(g, 10, 16, True) for g in SELECTION_GROUPS] == [10, 10, 11]
    frame = pl.DataFrame({"H": [10, 10], "p": [False, True]})
    got = frame.select(d.keyed_chunks(MTP16, pl.col("H"), 16, pl.col("p")).alias("k"))
    assert got["k"].to_list() == [10, 11]


def test_needed_total_counts_full_attention_where_it_is_not_listed() -> None:
    # 5 listed chunks; full attention's [0, 96) is 6 chunks unless listed (tiered)
    assert d.needed_total(5, 0, 96, SELECTION_GROUPS, False) == 11
    assert d.needed_total(5, 0, 96, SELECTION_GROUPS, True) == 5
    assert d.needed_total(5, 32, 96, SELECTION_GROUPS, False) == 9


def test_what_counts_toward_F_on_a_tiered_manager() -> None:
    assert d.lead_ok("HIT", False) and d.lead_ok("MISS", True) and d.lead_ok(None, True)
    assert not d.lead_ok("MISS", False) and not d.lead_ok(None, False)
    assert not d.lead_ok("HIT_PENDING", False)


def test_the_hit_ends_a_recorder_lists_needed_keys_for() -> None:
    # every intended boundary in (S, top), the ceiling; none at or below S, none past top
    assert d.listing_boundaries(0, 144, [96, 192, 0, 144], SELECTION_GROUPS, 0, False) == [96, 144]
    assert d.listing_boundaries(96, 144, [96], SELECTION_GROUPS, 0, False) == [144]
    # the standing boundary of a retention interval; on a tiered manager every multiple
    assert d.listing_boundaries(0, 144, [], SELECTION_GROUPS, 64, False) == [128, 144]
    assert d.listing_boundaries(0, 144, [], SELECTION_GROUPS, 64, True) == [64, 128, 144]


def test_the_chunks_listed_for_those_ends() -> None:
    # a 2-chunk window at 96 and at 144: chunks 4, 5 and 7, 8; the MTP group queries its
    # peek chunk (6, 9) and needs one more hit, then pops it: 4..6 and 7..9
    assert d.listed_chunks(SWA16, 0, [96, 144], 20, 144, False) == [4, 5, 7, 8]
    assert d.listed_chunks(MTP16, 0, [96, 144], 20, 144, False) == [4, 5, 6, 7, 8, 9]
    # only keyed chunks have a key to list
    assert d.listed_chunks(MTP16, 0, [144], 9, 144, False) == [6, 7, 8]
    # full attention: every chunk from S to the cap, on a tiered manager only
    assert d.listed_chunks(FA16, 16, [144], 20, 96, True) == [1, 2, 3, 4, 5]
    assert d.listed_chunks(FA16, 16, [144], 20, 96, False) == []


def test_a_chunk_is_keyable_up_to_where_the_chain_reached() -> None:
    assert d.chunk_keyable(5, 16, 96) and not d.chunk_keyable(5, 16, 95)
    assert not d.chunk_keyable(0, 16, None)
    frame = pl.DataFrame({"c": [5, 5, 0], "k": [96, 95, None]})
    got = frame.select(d.chunk_keyable(pl.col("c"), 16, pl.col("k")).alias("x"))["x"]
    assert got.to_list() == [True, False, False]


def test_the_cause_of_a_needed_chunk() -> None:
    # HIT is the manager's word; a chunk whose key the episode never had is settled only
    # where no request sharing the prefix offered it
    assert d.chunk_cause("HIT", True, False, False, "evicted") == "resident"
    assert d.chunk_cause("MISS", True, False, False, "evicted") == "evicted"
    assert d.chunk_cause(None, False, True, True, None) == "never_offered"
    assert d.chunk_cause(None, False, True, False, None) == "not_keyable"
    assert d.chunk_cause(None, False, False, True, None) == "not_looked_up"
    # a recurrent group's chunk nobody offered: its state was never kept there
    assert d.chunk_cause(None, False, True, True, None, True) == "no_checkpoint"
    assert d.chunk_cause(None, False, True, False, None, True) == "not_keyable"
    rows = [
        {"r": r, "k": k, "u": u, "y": y, "c": c, "m": m}
        for r in (None, "HIT", "MISS")
        for k in (False, True)
        for u in (False, True)
        for y in (False, True)
        for c in (None, "evicted")
        for m in (False, True)
    ]
    schema = {
        "r": pl.String,
        "k": pl.Boolean,
        "u": pl.Boolean,
        "y": pl.Boolean,
        "c": pl.String,
        "m": pl.Boolean,
    }
    plain = [d.chunk_cause(x["r"], x["k"], x["u"], x["y"], x["c"], x["m"]) for x in rows]
    assert (
        evaluated(
            lambda c: d.chunk_cause(c["r"], c["k"], c["u"], c["y"], c["c"], c["m"]), rows, schema
        )
        == plain
    )


def test_a_recurrent_key_never_kept_is_no_checkpoint_whatever_else_holds() -> None:
    # what other_group and never_offered say of an attention group's key...
    assert d.cause(facts(sibling_stored=True)) == "other_group"
    assert d.cause(facts(keyable_end=128)) == "never_offered"
    # ...of a recurrent group's: its block hash is every group's, and its state is kept
    # only where a request computed one
    assert d.cause(facts(sibling_stored=True, recurrent=True)) == "no_checkpoint"
    assert d.cause(facts(keyable_end=128, recurrent=True)) == "no_checkpoint"
    # timing and capacity come first, for every group
    assert d.cause(facts(completed=50, recurrent=True)) == "resident"
    assert d.cause(facts(completed=50, evicted=60, recurrent=True)) == "evicted"
    assert d.cause(facts(recurrent=True)) == "not_keyable"
    assert "no_checkpoint" in d.STORE_RULE_CAUSES


def test_the_binding_scan_and_the_terminal_key_rank() -> None:
    # the last scan that saw a non-HIT binds, even before a later scan that only hit
    ranks = [d.binding_rank(n_hit, n, scan) for scan, (n_hit, n) in enumerate([(2, 3), (4, 4)])]
    assert ranks.index(max(ranks)) == 0
    ranks = [d.binding_rank(n_hit, n, scan) for scan, (n_hit, n) in enumerate([(2, 3), (1, 3)])]
    assert ranks.index(max(ranks)) == 1
    # a MISS (or RETRY) is terminal before a HIT_PENDING that came first in call order
    assert d.terminal_rank("MISS", 9) < d.terminal_rank("HIT_PENDING", 1)
    assert d.terminal_rank("RETRY", 9) < d.terminal_rank("HIT_PENDING", 1)
    assert d.terminal_rank("MISS", 1) < d.terminal_rank("MISS", 9)
    assert d.terminal_candidate(True, "MISS") and d.terminal_candidate(True, "HIT_PENDING")
    assert not d.terminal_candidate(True, "HIT") and not d.terminal_candidate(True, None)
    assert not d.terminal_candidate(False, "MISS")
    rows = [{"r": r, "s": s} for r in ("MISS", "HIT_PENDING", "RETRY") for s in (1, 9)]
    plain = [d.terminal_rank(x["r"], x["s"]) for x in rows]
    schema = {"r": pl.String, "s": pl.Int64}
    assert evaluated(lambda c: d.terminal_rank(c["r"], c["s"]), rows, schema) == plain


def test_a_recurrent_model_keeps_a_junction_only_where_the_request_computed_through_it() -> None:
    from keytrace.analysis.boundaries import request_boundaries
    from keytrace.judge.rules import Group

    fa = Group(gid=3, tpc=64, window=None, kind="full_attention")
    swa = Group(gid=1, tpc=64, window=2, sliding_window=128)
    mamba = Group(gid=0, tpc=64, window=1, kind="mamba")
    # windowed groups keep tails at a junction whatever the request loaded
    assert d.request_boundaries([swa, fa], 700, 128, computed_from=768) == [640, 128]
    # a recurrent state exists at the junction only where the request computed through it
    assert d.request_boundaries([mamba, fa], 700, 128, computed_from=768) == [640]
    assert d.request_boundaries([mamba, fa], 700, 128, computed_from=128) == [640]
    assert d.request_boundaries([mamba, fa], 700, 130, computed_from=64) == [640, 128]
    assert d.request_boundaries([mamba, fa], 700, 128) == [640]  # not answered yet
    # the differ's columns say the same, episode by episode
    episodes = pl.LazyFrame(
        {
            "inst": [1, 1, 1, 1],
            "req_id": ["loaded", "computed", "deferred", "deferred"],
            "s": [10, 20, 30, 40],
            "P": [700, 700, 700, 700],
            "spb": [128, 130, None, 128],
            "S": [0, 0, 0, 0],
            "X": [768, 64, None, None],
        }
    )
    for groups, kept in (
        ([mamba, fa], {("computed", 128)}),
        ([swa, fa], {("loaded", 128), ("computed", 128), ("deferred", 128)}),
    ):
        got = request_boundaries(episodes, groups).collect()
        junctions = {(r, b) for r, b in zip(got["req_id"], got["b"], strict=True) if b != 640}
        assert junctions == kept, groups


def test_a_hit_under_one_chunk_past_a_local_hit_inside_a_chunk_is_nothing() -> None:
    # vLLM's lookup loads nothing when a group's hit past S is under one of its chunks
    # (_lookup_complete_chunks); only S inside a chunk (blocks_per_chunk > 1) can meet it
    fa = Group(0, 128, None, kind="full_attention")
    swa = Group(1, 128, 1, sliding_window=64)
    # F: a full-attention run that ends less than a chunk past S counts as none
    assert d.fa_prefix_end(704, 128, 1) == 704  # [640, 768): 64 past S
    assert d.fa_prefix_end(704, 128, 2) == 896
    assert d.fa_prefix_end(640, 128, 1) == 768  # S a chunk boundary: as before
    assert d.fa_prefix_end(704, 128, None) == 704
    # E: the largest intended boundary, unless it lies under a window chunk past S
    assert d.expected_boundary(704, 768, [], [fa, swa]) is None
    assert d.expected_boundary(640, 768, [], [fa, swa]) == 768
    assert d.expected_boundary(704, None, [768], [fa, swa]) is None
    assert d.expected_boundary(704, 768, [], [fa]) == 768  # no window group: F decides
    frame = pl.DataFrame({"S": [704, 640], "lead": [1, 1], "b": [768, 768]})
    got = frame.select(
        F=d.fa_prefix_end(pl.col("S"), 128, pl.col("lead")),
        E=d.expected_boundary(pl.col("S"), pl.col("b"), [], [fa, swa]),
    )
    assert got.rows() == [(704, None), (768, 768)]
