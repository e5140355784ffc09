"""Why a key a lookup needed was (not) there: the store history of a key at a moment.

A *probe* is one key needed by one episode: ``(pid, inst, s, t, key, gid, token_end,
keyable_end)``: the episode's recorder instance, sequence number and wall clock, the key
and its group, the token its chunk ends at, and how far the earlier requests on the
episode's chain reached (a chunk ending beyond that was never keyable by them).

`causes` adds ``cause`` to every probe: it gathers, per probe, the facts
`keytrace.judge.definitions.KeyFacts` names from the store rows, and the one definition
(`keytrace.judge.definitions.cause`, the table ``CAUSES``) turns them into a cause, with
this precedence (docs/diff.md):

``resident``      completed on the instance before s, not evicted or reset since (nor
                  evicted during the episode by its own lookup's promotions)
``in_flight``     prepared before s and not yet settled (completed or failed) at s
(on a tiered trace, the tier causes of docs/diff.md come here: ``on_tier`` after
``resident``, then ``promoting`` ... ``secondary_resident`` after ``in_flight``)
``evicted``       completed before s, then evicted (or the tier reset) before s
``other_engine``  offered on another recorder instance before that moment (wall clock):
                  a routing miss, whether it is still resident there or not
``store_failed``  offered before s and the allocation or the transfer failed (capacity)
``rejected``      offered before s, declined by ``prepare_store`` (e.g. ``store_threshold``)
``other_group``   the block hash stored under another group id, this group's never
``never_offered`` keyable by an earlier request on the chain, never offered before s
``not_keyable``   no earlier request on the chain was long enough to key it

A store first offered *after* the lookup, by the episode's own request or any later one,
explains nothing: only what was in flight or resident at s counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from keytrace.analysis import frames
from keytrace.analysis.frames import collect
from keytrace.analysis.partition import FirstOffers
from keytrace.format.keys import key_hash, make_key
from keytrace.format.schema import TierEvent
from keytrace.judge.definitions import (
    DURABLE_EVENTS,
    IN_FLIGHT_TIER_WORK,
    OWN_TIER_WORK,
    PROMOTION_AS_STORE,
    KeyFacts,
    cause,
    held_by_others,
    resident,
    unsettled,
)
from keytrace.judge.ops import as_expr, plain
from keytrace.judge.rules import OFFER_EVENTS

__all__ = ["causes", "store_rows", "wanted_keys"]


def wanted_keys(probes: pl.DataFrame, group_ids: Sequence[int]) -> pl.Series:
    """Every key whose store rows `causes` reads for ``probes``: the probes' keys, and their
    block hashes under each of ``group_ids`` (a key is hash + 4-byte group id, so those keys
    are spelled out rather than hashed row by row)."""
    keys = probes.select("key").unique()
    hashes = keys.select(key_hash(pl.col("key")).alias("h")).unique()["h"].to_list()
    siblings = pl.Series([make_key(h, g) for h in hashes for g in group_ids], dtype=pl.Binary)
    return pl.concat([keys["key"], siblings]).unique()


def store_rows(stores: pl.LazyFrame, keys: pl.Series) -> pl.DataFrame:
    """The store rows of ``keys``, and every reset: one pass, filtered in the reader."""
    return collect(
        stores.filter(pl.col("key").is_in(keys.unique().implode()) | (pl.col("event") == "reset"))
    )


def durable(
    at: pl.DataFrame, tiers: pl.LazyFrame, excluded: pl.DataFrame | None = None
) -> pl.DataFrame:
    """``at`` (inst, s, key: keys at episodes) -> the same rows with ``durable``: a secondary
    tier held the key at the episode (docs/diff.md, "Tiered offloading"): a write-through
    to it completed before ``s`` or its lookup answered HIT before or during the episode
    (``ep == s``), and it reported no eviction of the key since. Per tier, then any tier.

    ``excluded``: (inst, s, tier) of the tiers an episode's ``kv_load_tiers`` kept its
    lookup from (`keytrace.judge.rules.excluded_tiers`); ``durable`` then counts the
    others, and ``excluded`` says the key was held only on excluded tiers."""
    base = at.select("inst", "s", "key").unique()
    if base.height == 0:
        return base.with_columns(pl.lit(False).alias("durable"), pl.lit(False).alias("excluded"))
    keys = base.get_column("key").unique().implode()
    ev = pl.col("event")
    rows = collect(
        tiers.filter(
            pl.col("key").is_in(keys)
            & (
                ev.is_in(plain([*DURABLE_EVENTS, TierEvent.TIER_EVICTED]))
                | ((ev == "lookup") & (pl.col("result") == "HIT"))
            )
        ).select("inst", "seq", "ep", "tier", pl.col("event").cast(pl.String), "key")
    )
    cells = base.join(rows.select("inst", "key", "tier").unique(), on=["inst", "key"])
    by = ["inst", "key", "tier"]
    gone_event = pl.col("event") == "tier_evicted"
    seen = (
        cells.with_columns(
            _latest(cells, rows.filter(~gone_event), by).alias("held"),
            _latest(cells, rows.filter(gone_event), by).alias("gone"),
        )
        .filter(resident(pl.col("held"), pl.col("gone")))
        .select("inst", "s", "key", "tier")
    )
    allowed = seen
    if excluded is not None and excluded.height:
        allowed = seen.join(excluded, on=["inst", "s", "tier"], how="anti")
    on = ["inst", "s", "key"]
    return (
        base.join(allowed.select(*on, pl.lit(True).alias("durable")).unique(), on=on, how="left")
        .join(seen.select(*on, pl.lit(True).alias("anywhere")).unique(), on=on, how="left")
        .with_columns(pl.col("durable").fill_null(False), pl.col("anywhere").fill_null(False))
        .with_columns((pl.col("anywhere") & ~pl.col("durable")).alias("excluded"))
        .drop("anywhere")
    )


def _latest(cells: pl.DataFrame, events: pl.DataFrame, by: list[str]) -> pl.Series:
    """Per row of ``cells`` (``by`` and an episode ``s``), the last ``seq`` of ``events``
    (``by``, ``seq``, ``ep``) before ``s`` or during episode ``s`` (null: none): an as-of
    join and a join on the episode, not a join of every event with every episode. (A
    request whose lookup was deferred 14,000 times has as many episodes and tier rows per
    key: their product took 24 GB.)"""
    idx = pl.int_range(pl.len()).alias("_row")
    left = cells.select(*by, "s").with_columns(idx)
    ev = events.select(*by, "seq", "ep")
    before = left.sort("s").join_asof(
        ev.select(*by, pl.col("seq").alias("_before")).sort("_before"),
        left_on="s",
        right_on="_before",
        by=by,
        strategy="backward",
        allow_exact_matches=False,
        check_sortedness=False,  # both sorted above; polars cannot check it within groups
    )
    during = ev.group_by(*by, pl.col("ep").alias("s")).agg(pl.col("seq").max().alias("_during"))
    out = before.join(during, on=[*by, "s"], how="left").sort("_row")
    return out.select(pl.max_horizontal("_before", "_during")).to_series()


def _tier_facts(
    probes: pl.DataFrame, tiers: pl.LazyFrame, excluded: pl.DataFrame | None = None
) -> pl.DataFrame:
    """Per probe (pid): ``durable``, ``excluded``, ``held``, ``no_room``,
    ``own_promotion_evicted``, ``evicted_now`` (the `keytrace.judge.definitions.KeyFacts` a
    tiered manager adds; ``excluded``: `durable`'s)."""
    ev = pl.col("event")
    keys = probes.get_column("key").unique().implode()
    rows = collect(
        tiers.filter(
            (pl.col("key").is_in(keys) & ev.is_in(["promotion_no_room", "promotion_evicted"]))
            | ev.is_in(["promotions_held", "promotions_released"])
        ).select("inst", "seq", "ep", pl.col("event").cast(pl.String), "req_id", "key")
    )
    base = probes.select(
        "pid", "inst", "s", "key", *(["req_id"] if "req_id" in probes.columns else [])
    )
    out = base.join(durable(base, tiers, excluded), on=["inst", "s", "key"], how="left")
    # per (key, episode) pair, not per (event, episode): a deferred lookup repeats its
    # promotions, and their product with the episodes does not fit in memory
    no_room = (
        base.join(
            rows.filter(ev == "promotion_no_room").select("inst", "key", pl.col("ep").alias("s")),
            on=["inst", "key", "s"],
            how="semi",
        )
        .select("pid", pl.lit(True).alias("no_room"))
        .unique("pid")
    )
    if "req_id" in base.columns:
        mine = rows.filter(ev == "promotion_evicted")
        on = ["inst", "key", "req_id"]
        first = mine.group_by(*on).agg(pl.col("seq").min().alias("first"))
        now = mine.select(*on, pl.col("ep").alias("s"), pl.lit(True).alias("evicted_now"))
        own = (
            base.join(first, on=on, how="left")
            .join(now.unique(), on=[*on, "s"], how="left")
            .with_columns(pl.col("evicted_now").fill_null(False))
            .filter((pl.col("first") < pl.col("s")) | pl.col("evicted_now"))
            .select("pid", pl.lit(True).alias("own_promotion_evicted"), "evicted_now")
            .unique("pid")
        )
    else:
        own = pl.DataFrame(
            schema={"pid": pl.Int64, "own_promotion_evicted": pl.Boolean, "evicted_now": pl.Boolean}
        )
    flags = rows.filter(ev.is_in(["promotions_held", "promotions_released"])).select(
        "inst", pl.col("seq").alias("at"), "event"
    )
    held = (
        base.join(flags, on="inst")
        .filter(pl.col("at") < pl.col("s"))
        .group_by("pid")
        .agg(
            resident(
                pl.col("at").filter(ev == "promotions_held").max(),
                pl.col("at").filter(ev == "promotions_released").max(),
            ).alias("held")
        )
    )
    for extra in (no_room, own, held):
        out = out.join(extra, on="pid", how="left")
    return out.select(
        "pid",
        *(
            pl.col(c).fill_null(False)
            for c in (
                "durable",
                "excluded",
                "held",
                "no_room",
                "own_promotion_evicted",
                "evicted_now",
            )
        ),
    )


def crowding(tiers: pl.LazyFrame) -> pl.DataFrame:
    """(inst, s, held) for each episode whose promotions found no room in the primary: the
    most primary slots other work in flight held at such a moment
    (`keytrace.judge.definitions.held_by_others`, over the tier rows before it)."""
    c = pl.col
    ev = c("event").cast(pl.String)
    work = collect(
        tiers.filter(ev.is_in(plain(IN_FLIGHT_TIER_WORK)) & c("key").is_not_null()).select(
            "inst",
            "seq",
            "req_id",
            "key",
            ev.str.starts_with("cascade").alias("cascade"),
            ev.replace_strict(
                dict(zip(plain(IN_FLIGHT_TIER_WORK), IN_FLIGHT_TIER_WORK.values(), strict=True)),
                default=0,
                return_dtype=pl.Int64,
            ).alias("d"),
            # what the row moves in its request's own count (`OWN_TIER_WORK`), else d
            ev.replace_strict(
                dict(zip(plain(OWN_TIER_WORK), OWN_TIER_WORK.values(), strict=True)),
                default=None,
                return_dtype=pl.Int64,
            ).alias("d_own"),
        )
    ).sort("seq")
    work = work.with_columns(c("d_own").fill_null(c("d")))
    # a key written through to several tiers at once pins one primary slot: a write-through
    # row moves the count of slots only when its key's jobs in flight go from 0 or to 0
    jobs = pl.when(c("cascade")).then(c("d")).otherwise(0).cum_sum().over("inst", "key")
    slot = (jobs > 0).cast(pl.Int64) - (jobs - c("d") > 0).cast(pl.Int64)
    running = work.select(
        "inst",
        "seq",
        pl.when(c("cascade")).then(slot).otherwise(0).cum_sum().over("inst").alias("cas"),
        pl.when(c("cascade")).then(0).otherwise(c("d")).cum_sum().over("inst").alias("prom"),
    )
    own = (
        work.filter(~c("cascade"))
        .select("inst", "req_id", "seq", c("d_own").cum_sum().over("inst", "req_id").alias("own"))
        .filter(c("req_id").is_not_null())
    )
    full = collect(
        tiers.filter((ev == "promotion_no_room") & c("ep").is_not_null()).select(
            "inst", "seq", "ep", "req_id"
        )
    ).sort("seq")
    # every frame is in seq order, so within each instance (and request) too
    asof = {
        "on": "seq",
        "strategy": "backward",
        "allow_exact_matches": False,
        "check_sortedness": False,
    }
    at = full.join_asof(running, by="inst", **asof).join_asof(  # type: ignore[arg-type]
        own,
        by=["inst", "req_id"],
        **asof,  # type: ignore[arg-type]
    )
    held = held_by_others(c("cas").fill_null(0), c("prom").fill_null(0), c("own").fill_null(0))
    return at.group_by("inst", c("ep").alias("s")).agg(held.max().alias("held"))


def _offered_elsewhere_in(base: pl.DataFrame, rows: pl.DataFrame) -> pl.DataFrame:
    """(pid, other_engine) of the probes (pid, inst, t, key) whose key another instance
    offered before the episode's wall clock, read from store ``rows`` of every instance."""
    return (
        base.join(rows, on="key")
        .filter(
            (pl.col("inst_right") != pl.col("inst"))
            & (pl.col("ts") < pl.col("t"))
            & pl.col("event").is_in(plain(OFFER_EVENTS))
        )
        .select("pid", pl.lit(True).alias("other_engine"))
        .unique("pid")
    )


def offered_elsewhere(base: pl.DataFrame, others: FirstOffers) -> pl.DataFrame:
    """`_offered_elsewhere_in` from the cross-engine first offers
    (`keytrace.analysis.partition.FirstOffers`): the first offer not on the probe's
    instance came before its wall clock. A key the table does not answer for (derived from
    another request's records) is read from the whole trace, when there is one."""
    base = base.select("pid", "inst", "t", "key")
    answered = base.join(others.asked, on="key", how="semi")
    c = pl.col
    known = (
        answered.join(others.first, on="key")
        .filter(((c("inst1") != c("inst")) & (c("ts1") < c("t"))) | (c("ts2") < c("t")))
        .select("pid", pl.lit(True).alias("other_engine"))
    )
    rest = base.join(others.asked, on="key", how="anti")
    if rest.height == 0 or others.fleet is None:
        return known.unique("pid")
    rows = store_rows(frames.stores(others.fleet), rest.get_column("key"))
    return pl.concat([known, _offered_elsewhere_in(rest, rows)]).unique("pid")


def gid_in(gids: Sequence[int]) -> pl.Expr | bool:
    """The ``gid`` column is one of ``gids`` (False, a plain value, when there are none:
    a definition then evaluates as for plain values where it can)."""
    return pl.col("gid").is_in(list(gids)) if gids else False


def causes(
    probes: pl.DataFrame,
    stores: pl.LazyFrame,
    group_ids: Sequence[int],
    tiers: pl.LazyFrame | None = None,
    others: FirstOffers | None = None,
    recurrent: Sequence[int] = (),
    excluded: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """``probes`` plus ``cause`` (see the module doc). Touches only the probes' keys (and
    their block hashes under ``group_ids``): two passes over ``stores``, one for those
    keys' rows, one for each group's first preparation. ``stores`` may be any part of the
    store rows holding every row before the probes' episodes (`keytrace.analysis.diff`
    passes the rows up to a batch's end).

    ``tiers`` (`keytrace.analysis.frames.tiers`, for a tiered trace): promotions count as
    stores into the primary, and the tier facts of ``docs/diff.md`` ("Tiered offloading")
    are read from them; probes may then carry ``req_id`` (the episode's request), ``fits``
    (whether its chunks fit the primary; True when absent) and ``result`` (the episode's
    own lookup result for the key).

    ``others``: ``stores`` holds one instance's rows only (the differ's per-engine
    judgement, `keytrace.analysis.partition`); whether another instance offered a key
    before the episode is read from this table instead (`offered_elsewhere`). None:
    ``stores`` holds every instance's rows and is read for it.

    ``excluded``: (inst, s, tier) of the secondary tiers an episode's ``kv_load_tiers``
    kept its lookup from (`durable`).
    """
    if probes.height == 0:
        return probes.with_columns(pl.lit(None, dtype=pl.String).alias("cause"))
    keys = probes.select("key").unique()
    ev = pl.col("event")
    rows = store_rows(stores, wanted_keys(probes, group_ids))
    first_prep = collect(
        stores.filter(ev == "prepared")
        .group_by("inst", "gid")
        .agg(pl.col("seq").min().alias("first_prep"))
    )
    hist = rows.join(keys, on="key", how="semi").select("inst", "seq", "ts", "event", "key")
    stored_hist = hist
    if tiers is not None:
        promoted = collect(
            tiers.filter(
                pl.col("key").is_in(keys["key"].implode())
                & pl.col("event").is_in(plain(PROMOTION_AS_STORE))
            ).select(
                "inst",
                "seq",
                "ts",
                pl.col("event")
                .cast(pl.String)
                .replace_strict(
                    dict(
                        zip(
                            plain(PROMOTION_AS_STORE),
                            plain(PROMOTION_AS_STORE.values()),
                            strict=True,
                        )
                    )
                ),
                "key",
            )
        )
        if promoted.height:
            hist = pl.concat([hist.with_columns(pl.col("event").cast(pl.String)), promoted])
    resets = rows.filter(ev == "reset").select("inst", "seq")
    other_gid = rows.filter(ev == "completed").select(
        "inst", "seq", pl.col("gid").alias("other_gid"), key_hash(pl.col("key")).alias("h")
    )
    base = probes.select("pid", "inst", "s", "t", "key", "gid")

    # this instance, before s
    ev = pl.col("event")
    own = (
        base.join(hist, on=["inst", "key"])
        .filter(pl.col("seq") < pl.col("s"))
        .group_by("pid")
        .agg(
            pl.col("seq").filter(ev == "completed").max().alias("completed"),
            pl.col("seq").filter(ev == "evicted").max().alias("evicted"),
            pl.col("seq").filter(ev == "prepared").max().alias("prepared"),
            pl.col("seq").filter(ev == "failed").max().alias("failed_at"),
            (ev == "rejected").any().alias("rejected"),
        )
    )
    last_reset = (
        base.join(resets.select("inst", pl.col("seq").alias("reset")), on="inst")
        .filter(pl.col("reset") < pl.col("s"))
        .group_by("pid")
        .agg(pl.col("reset").max())
    )
    # other instances, before the episode's wall clock: the store path there decided to
    # write the key (whether it is still resident there or not, this engine never had it)
    other = (
        _offered_elsewhere_in(base, stored_hist)
        if others is None
        else offered_elsewhere(base, others)
    )
    # the hash under another group id, while this group id never reached the store path
    skew = (
        base.with_columns(key_hash(pl.col("key")).alias("h"))
        .join(other_gid, on=["inst", "h"])
        .filter((pl.col("seq") < pl.col("s")) & (pl.col("other_gid") != pl.col("gid")))
        .select("pid", pl.lit(True).alias("other_gid_stored"))
        .unique("pid")
    )
    facts = (
        probes.join(own, on="pid", how="left")
        .join(last_reset, on="pid", how="left")
        .join(other, on="pid", how="left")
        .join(skew, on="pid", how="left")
        .join(first_prep, on=["inst", "gid"], how="left")
    )
    tiered = {}
    if tiers is not None:
        facts = facts.join(_tier_facts(probes, tiers, excluded), on="pid", how="left")
        tiered = {
            "durable": pl.col("durable"),
            "excluded": pl.col("excluded"),
            "held": pl.col("held"),
            "no_room": pl.col("no_room"),
            "own_promotion_evicted": pl.col("own_promotion_evicted"),
            "evicted_now": pl.col("evicted_now"),
            "fits": pl.col("fits").fill_null(True) if "fits" in probes.columns else True,
            "crowded": (
                pl.col("crowded").fill_null(False) if "crowded" in probes.columns else False
            ),
            "unsettled": unsettled(pl.col("result")) if "result" in probes.columns else False,
            "unasked": pl.col("result").is_null() if "result" in probes.columns else False,
        }
    c = pl.col
    facts_of = KeyFacts(
        s=c("s"),
        completed=c("completed"),
        evicted=c("evicted"),
        reset=c("reset"),
        prepared=c("prepared"),
        failed=c("failed_at"),
        rejected=c("rejected").fill_null(False),
        other_engine=c("other_engine").fill_null(False),
        sibling_stored=c("other_gid_stored").fill_null(False),
        own_first_prepared=c("first_prep"),
        token_end=c("token_end"),
        keyable_end=c("keyable_end"),
        recurrent=gid_in(recurrent),
        **tiered,
    )
    return facts.with_columns(as_expr(cause(facts_of)).alias("cause")).select(
        *probes.columns, "cause"
    )
