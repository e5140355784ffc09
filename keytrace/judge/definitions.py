"""keytrace's own definitions (``docs/diff.md``), each written once.

The offline differ evaluates these over polars columns (millions of episodes and keys in one
pass); the live alarm in the serving process calls the very same functions with ints, bools
and None (`keytrace.judge.ops` makes one spelling serve both). vLLM's own arithmetic (the
lookup cap, load windows, needed chunks) is in `keytrace.judge.rules`; the OffloadKey
layout in `keytrace.format.keys`; which lookup results end a scan in
`keytrace.format.schema`.

What is here, in the order of ``docs/diff.md``:

- the resident full-attention prefix F (`fa_prefix_end`, `resident_prefix`) and the ceiling
  of a hit (`match_ceiling`);
- request boundaries (`anchor`, `boundary_chunk`) and the expected boundary E (`in_reach`,
  `standing_boundaries`, `expected_boundary`);
- residency (`resident`, `removal`, `in_flight`) and the cause of an absent key: the
  precedence is the table `CAUSES`, evaluated by `cause` (first match wins);
- the binding scan (`binds`) and the order in which a scan's keys are terminal
  (`terminal_order`);
- verdicts: `base_verdict`, then for a shortfall `decisive`, `shortfall_verdict` and the
  cause that names its tokens (`shortfall_cause`);
- the shortfall's tokens (`served`, `short_of_E`).

Each function takes what it needs as arguments: plain values from the alarm's records, or
columns the differ joined. Neither side re-states a rule; a test evaluates every table on
both kinds and requires the same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, TypeVar, cast, overload

from keytrace.format.schema import IN_FLIGHT_TIER_WORK as IN_FLIGHT_TIER_WORK  # re-exported
from keytrace.format.schema import NOT_SETTLED, SCAN_ENDING, LookupResult, StoreEvent, TierEvent
from keytrace.format.schema import OWN_TIER_WORK as OWN_TIER_WORK  # re-exported
from keytrace.judge.ops import (
    Label,
    Labels,
    MaybeNum,
    Num,
    Truth,
    as_expr,
    as_int,
    cases,
    coalesce,
    eq,
    ge,
    greatest,
    greatest_known,
    gt,
    is_expr,
    known,
    le,
    least,
    least_known,
    lt,
    member,
    negate,
    unknown,
)
from keytrace.judge.rules import Group, align_down, needed_range, store_boundary, unit

if TYPE_CHECKING:
    from polars import Expr, String

C = TypeVar("C", bound=str)
"""A cause's type: `Cause` in the live alarm, plain names where a trace was read back."""


class Cause(StrEnum):
    """Why a needed key was (not) there (``docs/diff.md``, "Causes"; `CAUSES` holds the
    precedence). Members are strings: reports and JSON carry the names."""

    RESIDENT = "resident"
    ON_TIER = "on_tier"
    IN_FLIGHT = "in_flight"
    PROMOTING = "promoting"
    PROMOTIONS_HELD = "promotions_held"
    PROMOTION_NO_ROOM = "promotion_no_room"
    PROMOTION_EVICTED = "promotion_evicted"
    PRIMARY_BUSY = "primary_busy"
    PROMOTION_STARVED = "promotion_starved"
    SECONDARY_RESIDENT = "secondary_resident"
    TIER_EXCLUDED = "tier_excluded"
    """Durable only on secondary tiers the request's ``kv_load_tiers`` keeps its lookup
    from consulting: not loaded because the request said so (`Limit.KV_LOAD_TIERS`)."""
    EVICTED = "evicted"
    OTHER_ENGINE = "other_engine"
    STORE_FAILED = "store_failed"
    REJECTED = "rejected"
    NO_CHECKPOINT = "no_checkpoint"
    """A recurrent group's key the store path never offered: vLLM keeps a state only where a
    request computed one, and kept none at this boundary (one phrase for what
    `OTHER_GROUP` and `NEVER_OFFERED` would say of it: its block hash is every group's)."""
    OTHER_GROUP = "other_group"
    NEVER_OFFERED = "never_offered"
    NOT_KEYABLE = "not_keyable"
    NOT_LOOKED_UP = "not_looked_up"
    """A needed chunk whose key the episode never had (its scan stopped in another group)."""
    ALL_RESIDENT = "all_resident"
    """Not a key's cause: what names a shortfall's tokens when every needed chunk was
    resident (`shortfall_cause`)."""


class Verdict(StrEnum):
    """An episode's verdict (``docs/diff.md``, "Verdicts"). Members are strings."""

    STALLED = "stalled"
    DEFERRED = "deferred"
    COLD = "cold"
    HIT = "hit"
    SHORTFALL = "shortfall"
    """Before its explanation: external tokens short of E (`base_verdict`), then
    `EXPLAINED` or `MISMATCH` (`shortfall_verdict`)."""
    EXPLAINED = "explained"
    MISMATCH = "mismatch"
    UNDETERMINED = "undetermined"
    """The live alarm only: a shortfall it cannot decide from what it kept (a forgotten
    record, a key it never saw); counted, never warned about."""
    LIMITED = "limited"
    """Served what a limit allowed, and short of what the tier held (or cold) because the
    request or the manager's admission said so (`Limit`): an agreement, never a warning."""


class Limit(StrEnum):
    """What asked that tokens not be loaded or stored (`LIMIT_LABELS`): a request's
    ``kv_transfer_params`` or the spec's store admission. Members are strings."""

    MAX_LOAD_TOKENS = "max_load_tokens"
    SKIP_READING = "skip_reading_prefix_cache"
    """The request asked not to read external KV at all (vLLM 0.33.0's
    ``skip_reading_prefix_cache``; 0.34.0 reads it as ``skip_reading_external_kv``)."""
    MAX_OFFLOAD_TOKENS = "max_offload_tokens"
    STORE_THRESHOLD = "store_threshold"
    KV_LOAD_TIERS = "kv_load_tiers"
    """The request's ``kv_load_tiers`` excluded the secondary tiers that held what its
    lookup needed (`Cause.TIER_EXCLUDED`)."""


LIMIT_LABELS: dict[str, str] = {
    Limit.MAX_LOAD_TOKENS: "by request: max_load_tokens",
    Limit.SKIP_READING: "by request: skip_reading_prefix_cache",
    Limit.MAX_OFFLOAD_TOKENS: "by request: max_offload_tokens",
    Limit.STORE_THRESHOLD: "filtered: store_threshold",
    Limit.KV_LOAD_TIERS: "by request: kv_load_tiers",
}
"""How a limit is named in a verdict line and in the token account."""

STORE_LIMITS: dict[str, Limit] = {
    StoreEvent.WITHHELD: Limit.MAX_OFFLOAD_TOKENS,
    StoreEvent.FILTERED: Limit.STORE_THRESHOLD,
}
"""The store events (`keytrace.format.schema.LIMIT_EVENTS`) that say a key was kept from the
tier on purpose, and the limit each names."""


SHORTFALLS: tuple[Verdict, ...] = (Verdict.EXPLAINED, Verdict.MISMATCH)
"""The verdicts a judged shortfall gets (`shortfall_verdict`)."""

# ------------------------------------------------------------------ F and the ceiling


def fa_prefix_end(S: Num, tpc: int, lead: MaybeNum, drop: bool = False) -> Num:
    """How far one full-attention group is resident from S, by the manager's own word: its
    first scan runs left to right from S, so its ``lead`` HITs end at ``(S // tpc + lead) *
    tpc``; one chunk less for a group that drops a block for its drafter (``drop``:
    `Group.drop`), whose lookup queries a peek chunk past the hit and pops the last chunk
    it confirmed (``num_hit_chunks -= 1`` in ``_lookup_complete_chunks``): a hit at b
    needs the chunk past b resident too. A group the episode never scanned (``lead``
    unknown) gives S, and so does a run that ends less than one chunk past S: vLLM's lookup
    then loads nothing ("We can only load less than a chunk, so skip",
    ``_lookup_complete_chunks``), which a local hit that ends inside a chunk can meet
    (``blocks_per_chunk`` > 1)."""

    def end() -> Num:
        return (S // tpc + cast("Num", lead) - int(drop)) * tpc

    return cases([(unknown(lead), S), (lambda: lt(end(), S + tpc), S)], end)


@overload
def resident_prefix(
    S: int, groups: Sequence[Group], lead: Callable[[int], int | None]
) -> int | None: ...
@overload
def resident_prefix(
    S: Expr, groups: Sequence[Group], lead: Callable[[int], MaybeNum]
) -> Expr | None: ...
def resident_prefix(S: Num, groups: Sequence[Group], lead: Callable[[int], MaybeNum]) -> MaybeNum:
    """F: the smallest `fa_prefix_end` over the full-attention groups (``lead(gid)``: the
    leading HITs of that group's first scan, unknown if never scanned); None when there is
    no full-attention group (no constraint)."""
    ends = [fa_prefix_end(S, g.tpc, lead(g.gid), g.drop) for g in groups if g.full_attention]
    return least(*ends) if ends else None


@overload
def match_ceiling(L: int, F: int | None) -> int: ...
@overload
def match_ceiling(L: int | None, F: int | None) -> int | None: ...
@overload
def match_ceiling(L: MaybeNum, F: MaybeNum) -> MaybeNum: ...
def match_ceiling(L: MaybeNum, F: MaybeNum) -> MaybeNum:
    """``min(L, F)``: no hit can end past the lookup cap or the resident prefix (an unknown
    F is no constraint)."""
    return least_known(L, F)


def free_ceiling(L: MaybeNum, F: MaybeNum, L_free: MaybeNum) -> MaybeNum:
    """The ceiling of a hit had the request not capped its load (``L_free``: the lookup cap
    without ``max_load_tokens``). A capped lookup never scans past its cap L, so where its
    full-attention scans held to the cap (``F >= L``) nothing says what is resident past
    it: F is no constraint there, and the chain's intended boundaries (their keys were
    offered) count. Where F ended below the cap, it still bounds."""
    return match_ceiling(L_free, cases([(ge(F, L), None)], F))


# ------------------------------------------------------------- boundaries and E


def anchor(groups: Sequence[Group]) -> Group:
    """The group whose keys name a prefix: the first full-attention group, else the first."""
    return next((g for g in groups if g.full_attention), groups[0])


@overload
def boundary_chunk(b: int, tpc: int) -> int: ...
@overload
def boundary_chunk(b: Expr, tpc: int) -> Expr: ...
def boundary_chunk(b: Num, tpc: int) -> Num:
    """The chunk (of a group with ``tpc`` tokens per chunk) that ends at boundary ``b``: its
    key is the one a request offers for that boundary."""
    return b // tpc - 1


def in_reach(b: Num, S: Num, ceiling: MaybeNum) -> Truth:
    """An intended boundary the episode could have hit: ``S < b <= min(L, F)``."""
    return gt(b, S) & le(b, ceiling)


@overload
def standing_boundaries(
    ceiling: int, groups: Sequence[Group], retention: int | None
) -> list[int]: ...
@overload
def standing_boundaries(
    ceiling: Expr, groups: Sequence[Group], retention: int | None
) -> list[Expr]: ...
def standing_boundaries(
    ceiling: Num, groups: Sequence[Group], retention: int | None
) -> list[int] | list[Expr]:
    """The boundaries intended for every episode, whatever was stored: each multiple of the
    retention interval when it is > 0, and every chunk boundary when there is no
    sliding-window group or retention is dense (``None``: vLLM keeps every block of every
    window), each at or below ``ceiling``, the largest one of each kind."""
    out: list[Num] = []
    if retention is not None and retention > 0:  # segment tails every retention_interval
        out.append(ceiling // retention * retention)
    if retention is None or all(g.full_attention for g in groups):  # every boundary kept
        u = unit(groups)
        out.append(ceiling // u * u)
    return cast("list[int] | list[Expr]", out)  # of ``ceiling``'s kind, every one


def expected_boundary(
    S: Num, chain_best: MaybeNum, standing: Sequence[Num], groups: Sequence[Group]
) -> MaybeNum:
    """E: the largest intended boundary in reach. ``chain_best``: the largest of the chain's
    boundaries `in_reach` (unknown if none); ``standing``: `standing_boundaries`. Unknown
    when nothing is above S: a cold episode; and when the largest lies less than one chunk
    of some windowed group past S: vLLM's lookup then loads nothing at all (it checks each
    group's hit against the group's own chunk, ``_lookup_complete_chunks``), which a local
    hit inside a chunk can meet (``blocks_per_chunk`` > 1; the full-attention groups' side
    of the same check is in `fa_prefix_end` and `keytrace.judge.rules.lookup_cap`)."""
    above = [cases([(gt(b, S), b)], None) for b in standing]
    E = greatest_known(chain_best, *above)
    step = max((g.tpc for g in groups if not g.full_attention), default=0)
    if not step:
        return E
    return cases([(lt(E, S + step), None)], E)


# ------------------------------------------------------------------ needed chunks


def junction_kept(groups: Sequence[Group], junction: Num, computed_from: MaybeNum) -> Truth:
    """A request's stores keep what a hit at its junction (``shared_prefix_boundary``,
    aligned down) needs: windowed groups keep tails there whatever the request loaded;
    a recurrent group has a state only where the request computed one, so with one the
    junction counts only when the request computed through it (``computed_from``: where
    its episode's computation began, local plus external tokens; unknown, as for a
    deferred episode: not yet)."""
    if not any(g.recurrent for g in groups):
        return True
    return gt(junction, computed_from)


def carried_junction(
    groups: Sequence[Group], junction: int | None, computed_from: int | None = None
) -> int | None:
    """The junction boundary a request's stores keep what a hit needs for, from one of its
    episodes (None: none). vLLM sets ``request.shared_prefix_boundary`` afresh at every
    lookup (a request resumed after preemption looks up again, 0.33.0 and 0.34.0
    ``Scheduler.schedule``), and its store path reads the value the request carries when
    it stores: a junction counts for the offers after the episode that reported it and
    before the request's next episode, aligned down, where `junction_kept`."""
    if not junction:
        return None
    b = align_down(junction, groups)
    return b if b > 0 and junction_kept(groups, b, computed_from) else None


def request_boundaries(
    groups: Sequence[Group], prompt: int, junction: int | None, computed_from: int | None = None
) -> list[int]:
    """The boundaries a request's stores keep sliding-window tails for (``docs/diff.md``,
    "Intended boundaries") after one of its episodes: its own (`store_boundary` of its
    prompt) and the junction it carries (`carried_junction`); the positive ones. (The
    differ builds the same over columns, `keytrace.analysis.boundaries.request_boundaries`.)"""
    out = [store_boundary(groups, prompt), carried_junction(groups, junction, computed_from)]
    return [b for b in dict.fromkeys(out) if b is not None and b > 0]


def lists_needed(g: Group, tiered: bool) -> bool:
    """Whether a group's needed chunks are listed and judged one by one: every windowed
    group's; a full-attention group's only on a tiered manager (elsewhere every chunk in
    ``[S, E)`` is resident by construction, E <= F; on a tiered manager F counts what a
    secondary tier holds, and a promotion can fail)."""
    return tiered or not g.full_attention


@overload
def keyed_chunks(g: Group, hashes: int, tph: int, tail_proof: bool = False) -> int: ...
@overload
def keyed_chunks(g: Group, hashes: Num, tph: int, tail_proof: Truth = False) -> Num: ...
def keyed_chunks(g: Group, hashes: Num, tph: int, tail_proof: Truth = False) -> Num:
    """How many of ``g``'s keys the lookup had (``needed_range``'s ``keyed_chunks``): the
    request's block hashes give ``hashes * tph // tpc``; under the candidate fix
    ``eagle_proof_key`` a group that drops a block for its drafter (`Group.drop`) has one
    more, the proof of the peek chunk the prompt cannot key, where the recorder listed one
    (``tail_proof``: a proof of the chunk just past the keyed ones)."""
    keyed = hashes * tph // g.tpc
    if not g.drop:
        return keyed
    return keyed + as_int(tail_proof)


def listing_boundaries(
    S: int,
    top: int,
    intended: Sequence[int],
    groups: Sequence[Group],
    retention: int | None,
    tiered: bool,
) -> list[int]:
    """The hit ends the recorder lists needed keys for when vLLM did not look them up: the
    ceiling ``top`` (min(L, F); L on a tiered manager), every intended boundary in
    ``(S, top)`` and the standing ones. E is always one of them (``docs/diff.md``), so
    what the differ and the alarm need at E is in the trace, whatever the alarm knows. On a
    tiered manager F counts what the tiers hold, which the recorder cannot see, so every
    multiple of the retention interval in ``(S, top]`` stands in for the standing one."""
    ends = {top, *(b for b in intended if S < b < top)}
    ends.update(b for b in standing_boundaries(top, groups, retention) if S < b <= top)
    if tiered and retention:
        ends.update(range((S // retention + 1) * retention, top + 1, retention))
    return sorted(ends)


def listed_chunks(
    g: Group, S: int, ends: Sequence[int], keyed: int, cap: int, tiered: bool
) -> list[int]:
    """The chunks of ``g`` a hit at any of ``ends`` (`listing_boundaries`) needs, that its
    lookup may not have asked for: `needed_range` at each end; on a tiered manager a
    full-attention group's every chunk from S up to the cap (``cap``: L), which F may
    reach. Only keyed chunks (below ``keyed``) have a key to list."""
    if g.full_attention:
        return list(range(S // g.tpc, min(cap // g.tpc, keyed))) if tiered else []
    chunks: set[int] = set()
    for end in ends:
        lo, hi = needed_range(g, S, end, keyed)
        chunks.update(range(lo, hi))
    return sorted(c for c in chunks if c < keyed)


def needed_total(listed: Num, S: Num, E: Num, groups: Sequence[Group], tiered: bool) -> Num:
    """The chunks an episode needs for a hit at E, every group's: ``listed`` (its needed
    chunks of the groups `lists_needed` lists) plus each other full-attention group's
    ``[S, E)``. What `fits_primary` and `crowded` count."""
    total = listed
    for g in groups:
        if not lists_needed(g, tiered):
            total = total + (E // g.tpc - S // g.tpc)
    return total


# ------------------------------------------------------------- residency and causes


def removal(evicted: MaybeNum, reset: MaybeNum, now: MaybeNum = None) -> MaybeNum:
    """The last time the key left the tier: its eviction or a reset, whichever is later
    (``now``: the episode's own *s*, when its lookup's promotions evicted the key during it)."""
    return greatest_known(evicted, reset, now)


@overload
def resident(completed: int | None, removed: int | None) -> bool: ...
@overload
def resident(completed: Expr, removed: MaybeNum) -> Expr: ...
@overload
def resident(completed: MaybeNum, removed: MaybeNum) -> Truth: ...
def resident(completed: MaybeNum, removed: MaybeNum) -> Truth:
    """*Resident*: a completed store after the last removal."""
    return known(completed) & (unknown(removed) | gt(completed, removed))


def in_flight(prepared: MaybeNum, removed: MaybeNum, failed: MaybeNum) -> Truth:
    """Prepared after the last removal and not failed since. (A completion needs no term: a
    completed key is resident, checked first, unless a removal followed the completion,
    and then that removal also follows the preparation.)"""
    return (
        known(prepared)
        & (unknown(removed) | gt(prepared, removed))
        & (unknown(failed) | lt(failed, prepared))
    )


@dataclass(frozen=True)
class KeyFacts:
    """What the store history says of one key on one instance at an episode's moment (its
    sequence number ``s`` and wall clock): the last sequence number before ``s`` of each
    store event, and the facts the later causes read. Plain values (the alarm) or columns
    (the differ)."""

    s: Num
    completed: MaybeNum
    evicted: MaybeNum
    reset: MaybeNum
    prepared: MaybeNum
    failed: MaybeNum
    rejected: Truth
    other_engine: Truth
    """Offered on another recorder instance before the episode's wall clock."""
    sibling_stored: Truth
    """The same block hash completed under another group id before ``s``."""
    own_first_prepared: MaybeNum
    """When this group id first reached the store path on the instance (any key)."""
    token_end: MaybeNum
    """The token the key's chunk ends at (unknown: a key with no chunk, a partial tail's probe)."""
    keyable_end: MaybeNum
    """How far the earlier requests on the episode's chain reached (None: no chain)."""
    durable: Truth = False
    """A secondary tier held the key at the episode (a write-through to it completed
    before, or its lookup answered HIT; no eviction from it since). A reset of the primary
    leaves it so."""
    held: Truth = False
    """Promotions were held at the episode (after a reset, until vLLM releases them)."""
    no_room: Truth = False
    """The episode's lookup found the key on a secondary tier and the primary had no slot
    to promote it into (vLLM then answers MISS)."""
    own_promotion_evicted: Truth = False
    """A promotion of the episode's own request evicted the key from the primary."""
    evicted_now: Truth = False
    """A promotion of the episode's own lookup evicted the key from the primary during the
    episode: resident at *s*, gone when (or after) the lookup reached it."""
    crowded: Truth = False
    """When the primary had no slot for the episode's promotions, other work in flight held
    so many of its slots that the chunks the episode needs no longer fit in the rest
    (`crowded`): the primary was busy, not wrong."""
    recurrent: Truth = False
    """The key's group is a recurrent state group (`keytrace.judge.rules.Group.recurrent`)."""
    fits: Truth = True
    """Every chunk the episode needs for a hit at E fits the primary tier at once (an
    uncontended tiered manager could promote them all: `fits_primary`)."""
    unsettled: Truth = False
    """The episode's own lookup of the key answered HIT_PENDING or RETRY (a promotion or a
    tier's asynchronous lookup under way: `unsettled`)."""
    unasked: Truth = False
    """The episode never looked the key up (its key is known from elsewhere)."""
    excluded: Truth = False
    """Durable on a secondary tier, but only on tiers the episode's ``kv_load_tiers``
    excludes (``durable`` counts the tiers it allows: `keytrace.judge.rules.excluded_tiers`)."""


def last_removal(f: KeyFacts) -> MaybeNum:
    """`removal` of the key at the episode: its last eviction or reset before *s*, or *s*
    itself when a promotion of the episode's own lookup evicted it during the episode (on a
    tiered manager a lookup changes the primary: what was resident at *s* may be gone when
    the lookup reaches it)."""
    return removal(f.evicted, f.reset, cases([(f.evicted_now, f.s)], None))


def _other_group(f: KeyFacts) -> Truth:
    """The block hash completed under another group id while this group id had not yet
    reached the store path on the instance."""
    return f.sibling_stored & negate(lt(f.own_first_prepared, f.s))


def _never_offered(f: KeyFacts) -> Truth:
    """An earlier request on the chain was long enough to key it, and none offered it."""
    return le(f.token_end, f.keyable_end)


CAUSES: tuple[tuple[Cause, Callable[[KeyFacts], Truth]], ...] = (
    (Cause.RESIDENT, lambda f: resident(f.completed, last_removal(f))),
    (Cause.ON_TIER, lambda f: f.durable & f.unasked),
    (Cause.IN_FLIGHT, lambda f: in_flight(f.prepared, last_removal(f), f.failed)),
    (Cause.PROMOTING, lambda f: f.durable & f.unsettled),
    (Cause.PROMOTIONS_HELD, lambda f: f.durable & f.held),
    (Cause.PROMOTION_NO_ROOM, lambda f: f.durable & negate(f.fits)),
    (Cause.PROMOTION_EVICTED, lambda f: f.durable & f.own_promotion_evicted),
    (Cause.PRIMARY_BUSY, lambda f: f.durable & f.no_room & f.crowded),
    (Cause.PROMOTION_STARVED, lambda f: f.durable & f.no_room),
    (Cause.SECONDARY_RESIDENT, lambda f: f.durable),
    (Cause.TIER_EXCLUDED, lambda f: f.excluded),
    (Cause.EVICTED, lambda f: known(f.completed)),
    (Cause.OTHER_ENGINE, lambda f: f.other_engine),
    (Cause.STORE_FAILED, lambda f: known(f.failed)),
    (Cause.REJECTED, lambda f: f.rejected),
    (Cause.NO_CHECKPOINT, lambda f: f.recurrent & (_other_group(f) | _never_offered(f))),
    (Cause.OTHER_GROUP, lambda f: _other_group(f)),
    (Cause.NEVER_OFFERED, lambda f: _never_offered(f)),
)
"""The cause of a key's state at an episode, in precedence order: the first that holds
(``docs/diff.md``, "Causes"); none holding is `LAST_CAUSE`."""
LAST_CAUSE = Cause.NOT_KEYABLE
"""No earlier request on the chain was long enough to key it."""


GATES: dict[Cause, str] = {
    **dict.fromkeys(
        (
            Cause.ON_TIER,
            Cause.PROMOTING,
            Cause.PROMOTIONS_HELD,
            Cause.PROMOTION_NO_ROOM,
            Cause.PROMOTION_EVICTED,
            Cause.PRIMARY_BUSY,
            Cause.PROMOTION_STARVED,
            Cause.SECONDARY_RESIDENT,
        ),
        "durable",
    ),
    Cause.TIER_EXCLUDED: "excluded",
}
"""The fact each of these causes' tests is a conjunction with: where it is plainly false
the test cannot hold, and `cause` does not run it (a key on no secondary tier, every key
of a CPU-only manager, skips nine of the table's tests). A gate only saves work: a test
that holds without its gate would be a bug in this table (tests/unit/test_cause_gates.py
checks every gate against its test)."""

_PLAIN_CAUSES = tuple((name, test, GATES.get(name)) for name, test in CAUSES)


def cause(facts: KeyFacts) -> Cause | Expr:
    """The cause of ``facts``: the first of `CAUSES` that holds, else `LAST_CAUSE`.

    Plain facts (the live alarm, once per needed key of a shortfall) are tested in turn
    with no `cases` chain built, a test whose gate (`GATES`) is plainly false skipped;
    the first test that gives an expression hands the whole table to `cases` (the same
    first-that-holds order, over columns)."""
    for name, test, gate in _PLAIN_CAUSES:
        if gate is not None and getattr(facts, gate) is False:
            continue
        holds = test(facts)
        if type(holds) is not bool and is_expr(holds):
            break
        if holds:
            return name
    else:
        return LAST_CAUSE
    return cases([(partial(test, facts), name) for name, test in CAUSES], LAST_CAUSE)


CAUSE_ORDER: tuple[Cause, ...] = (*(name for name, _ in CAUSES), LAST_CAUSE)
"""Every cause `cause` can give, most available first (`better_cause` ranks by it)."""
CAUSE_RANK: dict[str, int] = {c: i for i, c in enumerate(CAUSE_ORDER)}
"""A cause's position in `CAUSE_ORDER`; a cause outside it ranks after all of them."""
BLOCKING_CAUSES = (
    Cause.IN_FLIGHT,
    Cause.PROMOTION_NO_ROOM,
    Cause.EVICTED,
    Cause.OTHER_ENGINE,
    Cause.STORE_FAILED,
)
"""Timing, capacity or routing that no tiered manager could have overcome: the key was not
there to serve (being written, evicted and on no tier, elsewhere, never written) or the
request does not fit the primary."""
TIER_TIMING_CAUSES = (Cause.PROMOTING, Cause.PROMOTIONS_HELD, Cause.PRIMARY_BUSY)
"""A key on a tier, on its way: a promotion or a tier's lookup under way, promotions held
after a reset, or a primary whose slots other transfers held (vLLM answers MISS rather than
wait when the primary is full: a choice upstream made on purpose, vllm #40020)."""
EXPLAINED_CAUSES = tuple(c for c in CAUSE_ORDER if c in (*BLOCKING_CAUSES, *TIER_TIMING_CAUSES))
"""Causes of an absent key that are timing, capacity or routing: a shortfall with only
these is not a rule bug (in `CAUSE_ORDER`'s order)."""
STORE_RULE_CAUSES = (
    Cause.REJECTED,
    Cause.NO_CHECKPOINT,
    Cause.OTHER_GROUP,
    Cause.NEVER_OFFERED,
    Cause.NOT_KEYABLE,
)
"""The store path and the lookup path disagree about a key: with perfect timing, capacity
and routing the lookup would still fall short."""
LIMIT_CAUSES = (Cause.TIER_EXCLUDED,)
"""A key kept from the lookup because the request said so: a shortfall with these and no
rule cause is `Verdict.LIMITED` (`LIMIT_OF_CAUSE` names the limit)."""
LIMIT_OF_CAUSE: dict[str, Limit] = {Cause.TIER_EXCLUDED: Limit.KV_LOAD_TIERS}
"""The `Limit` each of `LIMIT_CAUSES` names."""
TIER_RULE_CAUSES = (Cause.PROMOTION_EVICTED, Cause.PROMOTION_STARVED, Cause.SECONDARY_RESIDENT)
"""A tiered manager did not serve a key a tier held, though the request fits its primary:
alone, with nothing blocking, it would have served it."""
RULE_CAUSES = (*TIER_RULE_CAUSES, *STORE_RULE_CAUSES)
"""Causes where vLLM's paths disagree about a key (in `CAUSE_ORDER`'s order)."""
TIER_CAUSES = (
    Cause.PROMOTING,
    Cause.PROMOTIONS_HELD,
    Cause.PROMOTION_EVICTED,
    Cause.PROMOTION_NO_ROOM,
    Cause.PRIMARY_BUSY,
    Cause.PROMOTION_STARVED,
    Cause.SECONDARY_RESIDENT,
    Cause.TIER_EXCLUDED,
)
"""Causes that only a tiered manager gives: the key was on a secondary tier."""


def fits_primary(needed_chunks: Num, primary_chunks: MaybeNum) -> Truth:
    """The chunks an episode needs for a hit at E (every group's) fit the primary tier at
    once; an unknown capacity fits."""
    return cases([(unknown(primary_chunks), True)], lambda: le(needed_chunks, primary_chunks))


def crowded(needed_chunks: Num, primary_chunks: MaybeNum, held_by_others: Num) -> Truth:
    """The chunks an episode needs do not fit beside the primary slots that other work in
    flight held when its promotion found no room (`held_by_others`): the primary was busy.
    An unknown capacity is never crowded."""
    return gt(needed_chunks + held_by_others, primary_chunks)


@overload
def held_by_others(cascades: int, promotions: int, own_promotions: int) -> int: ...
@overload
def held_by_others(cascades: Expr, promotions: Expr, own_promotions: Expr) -> Expr: ...
def held_by_others(cascades: Num, promotions: Num, own_promotions: Num) -> Num:
    """Primary slots other work held at a promotion that found no room: the keys with a
    write-through job in flight, and the promotions in flight of other requests (each a
    running count of `IN_FLIGHT_TIER_WORK` over the rows before it). A needed key of the
    episode that is being written through counts in both (an over-count: see docs/diff.md)."""
    return cascades + promotions - own_promotions


UNSEEN = Cause.NOT_LOOKED_UP
"""A needed chunk whose key the episode never had (its scan stopped in another group)."""


def cause_rank(c: Label) -> Num:
    """`CAUSE_RANK` of a cause (of a column of causes): unknown ones rank last."""
    last = len(CAUSE_RANK)
    if is_expr(c):
        import polars as pl

        return as_expr(c).replace_strict(CAUSE_RANK, default=last, return_dtype=pl.Int32)
    return CAUSE_RANK.get(c or "", last)


def proof_is_better(own: Label, proof: Label) -> Truth:
    """A chunk found under either of two keys (an EAGLE peek and its proof, under the
    candidate fix ``eagle_proof_key``) is as available as the better: the proof's cause
    decides when it is known and ranks strictly earlier in `CAUSE_ORDER`."""
    return known(proof) & lt(cause_rank(proof), cause_rank(own))


@overload
def better_cause(a: Cause, b: Cause) -> Cause: ...
@overload
def better_cause(a: Label, b: Label) -> Label: ...
def better_cause(a: Label, b: Label) -> Label:
    """Of two causes of one chunk's two keys, the better (`proof_is_better`; a tie keeps
    ``a``)."""
    return cases([(proof_is_better(a, b), b)], a)


@overload
def chunk_cause(
    result: str | None,
    key_known: bool,
    unoffered: bool,
    keyable: bool,
    key_cause: Cause | Callable[[], Cause | None] | None,
    recurrent: bool = False,
) -> Cause: ...
@overload
def chunk_cause(
    result: Label,
    key_known: Truth,
    unoffered: Truth,
    keyable: Truth,
    key_cause: Label,
    recurrent: Truth = False,
) -> Label: ...
def chunk_cause(
    result: Label,
    key_known: Truth,
    unoffered: Truth,
    keyable: Truth,
    key_cause: Label | Callable[[], Label],
    recurrent: Truth = False,
) -> Label | Cause:
    """The cause of one needed chunk of a shortfall: ``resident`` when the episode's own
    lookup of it answered HIT (the manager's word); for a chunk whose key the episode
    never had, ``never_offered`` (``no_checkpoint`` for a ``recurrent`` group's) or
    ``not_keyable`` when no request sharing the prefix offered it (``unoffered``;
    ``keyable``: the chain reached its end), else ``not_looked_up``; otherwise
    ``key_cause``, the `cause` of its key. For plain values ``key_cause`` may be a
    zero-argument function, called only when no earlier case holds (the live alarm
    gathers a key's facts only for the chunks that read them)."""
    unseen = negate(key_known)
    return cases(
        [
            (eq(result, LookupResult.HIT), Cause.RESIDENT),
            (lambda: unseen & unoffered & keyable & recurrent, Cause.NO_CHECKPOINT),
            (lambda: unseen & unoffered & keyable, Cause.NEVER_OFFERED),
            (lambda: unseen & unoffered, Cause.NOT_KEYABLE),
            (unseen, UNSEEN),
        ],
        key_cause,
    )


def chunk_keyable(chunk: Num, tpc: Num, keyable_end: MaybeNum) -> Truth:
    """A chunk the chain's requests were long enough to key: it ends at or before how far
    they reached (an unknown reach keys nothing)."""
    return le((chunk + 1) * tpc, coalesce(keyable_end, 0))


# --------------------------------------------------------------- binding and terminal


def binds(n_hit: Num, n: Num) -> Truth:
    """A scan that can bind an episode: it saw a non-HIT. The binding scan is the last such
    scan in call order (else the episode's last scan, with no terminal key)."""
    return lt(n_hit, n)


RANK_SPAN = 1 << 48
"""Larger than any scan index or sequence number of one process: a rank's boolean part
outweighs its ordinal part."""


def binding_rank(n_hit: Num, n: Num, scan: Num) -> Num:
    """The binding scan is the one of greatest rank: the last scan, in call order, that
    `binds`, else the episode's last scan (it binds with no terminal key)."""
    return as_int(binds(n_hit, n)) * RANK_SPAN + scan


def terminal_candidate(binding: Truth, result: Label) -> Truth:
    """A needed chunk that can be the terminal key: of the binding group, looked up by the
    episode, and not a HIT. vLLM starts a window scan at its own candidate end, which can
    lie right of E's window, so the terminal key is the first *needed* chunk the binding
    scan did not find; only when there is none does the scan's own terminal row stand."""
    return binding & known(result) & negate(eq(result, LookupResult.HIT))


def terminal_rank(result: Label, seq: Num) -> Num:
    """Among the candidates (`terminal_candidate`) the terminal key is the one of least rank: a MISS or a
    RETRY before a HIT_PENDING (`terminal_order`), then in call order."""
    return as_int(terminal_order(result)) * RANK_SPAN + seq


def lead_ok(result: Label, durable: Truth) -> Truth:
    """A full-attention chunk counts toward F on a tiered manager: the primary answered
    HIT, or a secondary tier held it (``durable``). F's lead is the run of these from S's
    chunk on, in a row (`keytrace.analysis.scans.tiered_leads`; the alarm walks it)."""
    return eq(result, LookupResult.HIT) | durable


def terminal_order(result: Label) -> Truth:
    """How a scan's non-HIT keys rank for terminal (sort by this, then call order): a MISS
    or RETRY (`SCAN_ENDING`) before a HIT_PENDING."""
    return negate(member(result, SCAN_ENDING))


# -------------------------------------------------------------------------- verdicts


STALL_EPISODES = 50
"""Consecutive deferrals of one request after which it is `stalled`. A lookup vLLM defers
(a store or a promotion still in flight, a tier's asynchronous lookup) resolves within a
few steps; fifty in a row with nothing served is a request that will not be served."""
STALL_NS = 30_000_000_000
"""Or: this long (30 s) since the first of its consecutive deferrals (a server's steps
can be far apart)."""


def stalled(deferrals: Num, waited_ns: MaybeNum) -> Truth:
    """A deferred episode that is the `STALL_EPISODES`-th (or later) consecutive deferral of
    its request, or comes `STALL_NS` or more after the first of them."""
    return ge(deferrals, STALL_EPISODES) | ge(waited_ns, STALL_NS)


@dataclass(frozen=True)
class EpisodeNumbers:
    """What `base_verdict` reads of an episode: S, external tokens X (unknown: vLLM
    returned None), E (unknown: none), and for a deferral how many of its request's
    lookups in a row were deferred, this one included, and for how long (ns). ``E_free``:
    E had the request not capped its load (`free_boundary`; unknown: no cap, or nothing
    past it); ``stored_limit``: the `Limit` that kept a key the episode missed from the tier
    (`store_limit`; unknown: none)."""

    S: Num
    X: MaybeNum
    E: MaybeNum
    deferrals: Num = 0
    waited: MaybeNum = 0
    E_free: MaybeNum = None
    stored_limit: Label = None


def load_capped(E: MaybeNum, E_free: MaybeNum) -> Truth:
    """The request's ``max_load_tokens`` kept a boundary from the episode: E without the
    cap is past E with it (or there is none with it)."""
    return known(E_free) & (unknown(E) | gt(E_free, E))


def limited(e: EpisodeNumbers) -> Truth:
    """An answered episode kept from the tier by a limit: no E, and only because the
    request capped its load (`load_capped`) or a limit kept the key it missed from the
    tier (``stored_limit``); or E served, and the cap alone kept a larger boundary away."""
    return cases(
        [(unknown(e.E), lambda: known(e.E_free) | known(e.stored_limit))],
        lambda: ge(e.X, cast("Num", e.E) - e.S) & load_capped(e.E, e.E_free),
    )


BASE_VERDICTS: tuple[tuple[Verdict, Callable[[EpisodeNumbers], Truth]], ...] = (
    (Verdict.STALLED, lambda e: unknown(e.X) & stalled(e.deferrals, e.waited)),
    (Verdict.DEFERRED, lambda e: unknown(e.X)),
    (Verdict.LIMITED, limited),
    (Verdict.COLD, lambda e: unknown(e.E)),
    (Verdict.HIT, lambda e: cast("Num", e.X) >= cast("Num", e.E) - e.S),
)
"""An episode's verdict before its shortfall is explained, first match wins; none holding
is ``shortfall``. ``stalled`` is never an agreement: the request is deferred again and
again and served nothing. ``limited`` (`limited`) agrees; a shortfall below a load cap is
judged against the boundary the cap allows, as any other."""


@overload
def limit_of(
    E: int | None, E_free: int | None, stored_limit: Limit | None, skip_reading: bool = False
) -> Limit | None: ...
@overload
def limit_of(
    E: MaybeNum, E_free: MaybeNum, stored_limit: Label, skip_reading: Truth | None = False
) -> Label: ...
def limit_of(
    E: MaybeNum, E_free: MaybeNum, stored_limit: Label, skip_reading: Truth | None = False
) -> Label:
    """The `Limit` an episode's verdict and token account name: where its own load cap kept
    a boundary away (`load_capped`), ``skip_reading_prefix_cache`` when it asked not to
    read external KV at all, else ``max_load_tokens``; otherwise the limit that kept its
    missed key from the tier (`store_limit`), else unknown."""
    capped = load_capped(E, E_free)
    skip = as_expr(skip_reading).fill_null(False) if is_expr(skip_reading) else bool(skip_reading)
    return cases(
        [(lambda: capped & skip, Limit.SKIP_READING), (capped, Limit.MAX_LOAD_TOKENS)],
        stored_limit,
    )


@overload
def limit_of_causes(decisive_causes: Sequence[str]) -> Limit | None: ...
@overload
def limit_of_causes(decisive_causes: Expr) -> Expr: ...
def limit_of_causes(decisive_causes: Labels) -> Limit | Expr | None:
    """The `Limit` a ``limited`` shortfall names: that of its first decisive cause
    (`LIMIT_OF_CAUSE`), else unknown. A list, or a list column."""
    if is_expr(decisive_causes):
        import polars as pl

        return (
            as_expr(decisive_causes)
            .list.first()
            .replace_strict(
                {str(k): str(v) for k, v in LIMIT_OF_CAUSE.items()},
                default=None,
                return_dtype=pl.String,
            )
        )
    plain = cast("Sequence[str]", decisive_causes)
    return LIMIT_OF_CAUSE.get(plain[0]) if plain else None


@overload
def store_limit(last_event: str | None) -> Limit | None: ...
@overload
def store_limit(last_event: Expr) -> Expr: ...
def store_limit(last_event: Label) -> Limit | Expr | None:
    """The `Limit` named by a key's last store event before the episode, when that event
    is a limit's (`STORE_LIMITS`): filtered by ``store_threshold``, or withheld by its
    request's ``max_offload_tokens``; unknown otherwise (a later offer, store or eviction
    of the key supersedes it)."""
    if is_expr(last_event):
        import polars as pl

        return (
            as_expr(last_event)
            .cast(pl.String)
            .replace_strict(
                {str(k): str(v) for k, v in STORE_LIMITS.items()},
                default=None,
                return_dtype=pl.String,
            )
        )
    return STORE_LIMITS.get(cast("str", last_event))


def by_request_tokens(
    verdict: Label, E: MaybeNum, E_free: MaybeNum, L: Num, served_end: Num
) -> Num:
    """The tokens a limit kept from an episode (the token account's ``limited`` row):
    a shortfall below a load cap, from E to E without the cap; a ``limited`` episode, from
    what was served to E without the cap, or to the lookup cap L where a store limit (no
    E without it is known: the key was never stored) named it; 0 otherwise.
    ``served_end``: S plus the accepted external tokens."""
    shortfall = member(verdict, SHORTFALLS) & known(E_free) & known(E)
    limited = eq(verdict, Verdict.LIMITED)
    return cases(
        [
            (shortfall, lambda: greatest(cast("Num", E_free) - cast("Num", E), 0)),
            (limited & known(E_free), lambda: greatest(cast("Num", E_free) - served_end, 0)),
            (limited, lambda: greatest(L - served_end, 0)),
        ],
        0,
    )


def base_verdict(e: EpisodeNumbers) -> Verdict | Expr:
    """``deferred``, ``cold``, ``limited``, ``hit`` or ``shortfall`` (`BASE_VERDICTS`)."""
    return cases([(partial(test, e), name) for name, test in BASE_VERDICTS], Verdict.SHORTFALL)


@dataclass(frozen=True)
class Shortfall:
    """What `shortfall_verdict` reads: whether any needed chunk is absent for a store rule
    cause, whether the binding key was seen unsettled (`NOT_SETTLED`), whether any needed
    chunk is absent for a blocking cause, for a tier rule cause, for any cause."""

    any_store_rule: Truth
    unsettled: Truth
    any_blocking: Truth
    any_tier_rule: Truth
    any_absent: Truth
    any_limit: Truth = False


SHORTFALL_VERDICTS: tuple[tuple[Verdict, Callable[[Shortfall], Truth]], ...] = (
    (Verdict.MISMATCH, lambda f: f.any_store_rule),
    (Verdict.EXPLAINED, lambda f: f.unsettled),
    (Verdict.EXPLAINED, lambda f: f.any_blocking),
    (Verdict.MISMATCH, lambda f: f.any_tier_rule),
    (Verdict.LIMITED, lambda f: f.any_limit),
    (Verdict.EXPLAINED, lambda f: f.any_absent),
)
"""A shortfall's verdict, first match wins; none holding (every needed chunk was resident
and lookup still fell short) is ``mismatch``. A tier rule cause is a mismatch only where
nothing blocking stood in the way: a tiered manager cannot serve a key that is on no tier,
or a request bigger than its primary. A shortfall whose rule-free absent chunks include
one the request kept from its lookup (`LIMIT_CAUSES`) is ``limited``: the request asked."""


DECISIVE_ORDER: tuple[tuple[tuple[str, ...] | None, bool], ...] = (
    (STORE_RULE_CAUSES, False),
    (BLOCKING_CAUSES, True),
    (BLOCKING_CAUSES, False),
    (TIER_RULE_CAUSES, True),
    (TIER_RULE_CAUSES, False),
    (LIMIT_CAUSES, True),
    (LIMIT_CAUSES, False),
    (None, True),
    (None, False),
)
"""Where a shortfall's decisive causes come from, first non-empty wins: (which causes, None
for any absent one; whether the binding group's chunks only). The class that decides the
verdict (`SHORTFALL_VERDICTS`) names it."""


def shortfall_facts(candidates: Sequence[Labels], term_result: Label) -> Shortfall:
    """`Shortfall` of an episode from its `DECISIVE_ORDER` candidate lists (lists, or list
    columns) and its binding key's result."""

    def some(x: Labels) -> Truth:
        return as_expr(x).list.len() > 0 if is_expr(x) else bool(x)

    by = dict(zip(DECISIVE_ORDER, candidates, strict=True))
    return Shortfall(
        any_store_rule=some(by[(STORE_RULE_CAUSES, False)]),
        unsettled=unsettled(term_result),
        any_blocking=some(by[(BLOCKING_CAUSES, False)]),
        any_tier_rule=some(by[(TIER_RULE_CAUSES, False)]),
        any_absent=some(by[(None, False)]),
        any_limit=some(by[(LIMIT_CAUSES, False)]),
    )


def candidates_of(causes: Sequence[tuple[int, C]], binding_group: int | None) -> list[list[C]]:
    """`DECISIVE_ORDER`'s candidate lists from (group, cause) of every needed chunk, in
    (group, chunk) order: plain values (the alarm, the tests); the differ builds the same
    lists as polars aggregations (`keytrace.analysis.verdict.shortfall_verdicts`)."""
    out = []
    for kind, bound in DECISIVE_ORDER:
        out.append(
            [
                c
                for g, c in causes
                if (c in kind if kind is not None else bool(absent(c)))
                and (not bound or g == binding_group)
            ]
        )
    return out


def shortfall_verdict(f: Shortfall) -> Verdict | Expr:
    """``mismatch``, ``explained`` or ``limited`` (`SHORTFALL_VERDICTS`)."""
    return cases([(partial(test, f), name) for name, test in SHORTFALL_VERDICTS], Verdict.MISMATCH)


PROMOTION_AS_STORE: dict[str, StoreEvent] = {
    TierEvent.PROMOTION_PREPARED: StoreEvent.PREPARED,
    TierEvent.PROMOTION_COMPLETED: StoreEvent.COMPLETED,
    TierEvent.PROMOTION_FAILED: StoreEvent.FAILED,
    TierEvent.PROMOTION_DEFERRED: StoreEvent.FAILED,
}
"""A promotion into the primary tier is a store into it (its slot taken, filled, or freed):
residency and in-flight read both alike (tier event -> store event)."""
DURABLE_EVENTS = (TierEvent.CASCADE_COMPLETED,)
"""Tier events that leave the key on that tier (a tier lookup answering HIT says so too)."""

ASKED_AGAIN = (Verdict.STALLED, Verdict.DEFERRED)
"""Verdicts of an episode vLLM deferred: its request is looked up again, so it accounts for
no token (`keytrace.analysis.lost`)."""
FINDINGS = (Verdict.MISMATCH, Verdict.STALLED)
"""Verdicts that are findings (exit 1): a disagreement, or a request that is never served."""


AVAILABLE = (Cause.RESIDENT, Cause.ON_TIER)
"""Causes that say a key was there to serve: in the primary, or on a tier (and the
lookup never got to it)."""


def absent(c: Label) -> Truth:
    """A needed chunk's cause that says its key was not there."""
    return negate(member(c, (*AVAILABLE, UNSEEN)))


@overload
def unsettled(term_result: str | None) -> bool: ...
@overload
def unsettled(term_result: Expr) -> Expr: ...
def unsettled(term_result: Label) -> Truth:
    """The binding key was seen as HIT_PENDING or RETRY: the store had not finished."""
    return member(term_result, NOT_SETTLED)


@overload
def decisive(candidates: Sequence[Sequence[C]]) -> Sequence[C]: ...
@overload
def decisive(candidates: Sequence[Expr]) -> Expr: ...
def decisive(candidates: Sequence[Sequence[C]] | Sequence[Expr]) -> Sequence[C] | Expr:
    """The causes shown with a shortfall's verdict: the first non-empty of its
    `DECISIVE_ORDER` candidate lists (lists, or list columns)."""
    if is_expr(*candidates):
        columns = [as_expr(c) for c in candidates]
        return cases([(c.list.len() > 0, c) for c in columns[:-1]], columns[-1])
    return next((c for c in candidates if c), candidates[-1])


@overload
def shortfall_cause(decisive_causes: Sequence[Cause], term_result: str | None) -> Cause: ...
@overload
def shortfall_cause(decisive_causes: Labels, term_result: Label) -> Label: ...
def shortfall_cause(decisive_causes: Labels, term_result: Label) -> Label:
    """The one cause that names a shortfall's tokens: its first decisive cause, else
    ``in_flight`` when the binding key was unsettled, else ``all_resident``."""
    first: Label | Callable[[], Label]
    some: Truth
    if is_expr(decisive_causes, term_result):
        column = as_expr(decisive_causes)
        first, some = column.list.first(), column.list.len() > 0
    else:
        names = cast("Sequence[str]", decisive_causes)
        some = bool(names)
        first = (lambda: names[0]) if some else None
    return cases([(some, first), (unsettled(term_result), Cause.IN_FLIGHT)], Cause.ALL_RESIDENT)


# -------------------------------------------------------------------- shortfall tokens


@overload
def served(S: int, N: int, accepted: int | None, external: int | None) -> tuple[int, int]: ...
@overload
def served(S: Expr, N: Num, accepted: MaybeNum, external: MaybeNum) -> tuple[Expr, Expr]: ...
def served(S: Num, N: Num, accepted: MaybeNum, external: MaybeNum) -> tuple[Num, Num]:
    """(from the GPU prefix cache, from the offload tier) of an episode's N tokens: S (at
    most N), and what the scheduler accepted (the connector's answer when it accepted
    nothing yet) within the rest."""
    gpu = least(S, N)
    return gpu, least(cast("Num", coalesce(accepted, external, 0)), N - gpu)


@overload
def short_of_E(E: int, gpu: int, offload: int) -> int: ...
@overload
def short_of_E(E: Expr, gpu: Num, offload: Num) -> Expr: ...
def short_of_E(E: Num, gpu: Num, offload: Num) -> Num:
    """A shortfall's tokens: between what was served and the expected boundary E."""
    return greatest(E - gpu - offload, 0)


def is_request(req_id: Label, request: str) -> Truth:
    """``req_id`` (vLLM's internal request id) is the request a user names ``request``:
    equal, or that id plus vLLM's suffixes. The OpenAI server returns ``cmpl-<hex>``; the
    scheduler sees ``cmpl-<hex>-<choice index>-<random>``, so ``--request`` with the id the
    API returned selects every choice of it (and never ``cmpl-<hex>9``, a different id)."""
    if is_expr(req_id):
        text = as_expr(req_id).cast(pl_string())
        return (text == request) | text.str.starts_with(request + "-")
    return req_id is not None and (req_id == request or str(req_id).startswith(request + "-"))


def pl_string() -> type[String]:
    """polars' String type, imported only for an expression (the alarm never loads polars)."""
    import polars as pl

    return pl.String
