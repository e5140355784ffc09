"""Why a key a lookup needed was (not) there: the store history of a key at a moment.

A *probe* is one key needed by one episode: ``(pid, inst, s, t, key, gid, token_end,
keyable_end)``: the episode's recorder instance, sequence number and wall clock, the key
and its group, the token its chunk ends at, and how far the earlier requests on the
episode's chain reached (a chunk ending beyond that was never keyable by them).

`causes` adds ``cause`` to every probe, with this precedence (docs/diff.md):

``resident``      completed on the instance before s, not evicted or reset since
``in_flight``     prepared before s and not yet settled (completed or failed) at s
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

from keytrace.analysis.frames import collect
from keytrace.analysis.rules import EXPLAINED_CAUSES, OFFER_EVENTS, RULE_CAUSES

__all__ = ["EXPLAINED_CAUSES", "OFFER_EVENTS", "RULE_CAUSES", "causes", "resident"]


def resident(completed: pl.Expr, removed: pl.Expr) -> pl.Expr:
    """*Resident*: a completion after the last removal (the one definition keytrace uses)."""
    return completed.is_not_null() & (removed.is_null() | (completed > removed))


def _hash(key: pl.Expr) -> pl.Expr:
    return key.bin.slice(0, key.bin.size() - 4)


def wanted_keys(probes: pl.DataFrame, group_ids: Sequence[int]) -> pl.Series:
    """Every key whose store rows `causes` reads for ``probes``: the probes' keys, and their
    block hashes under each of ``group_ids`` (a key is hash + 4-byte group id, so those keys
    are spelled out rather than hashed row by row)."""
    keys = probes.select("key").unique()
    hashes = keys.select(_hash(pl.col("key")).alias("h")).unique()["h"].to_list()
    siblings = pl.Series(
        [bytes(h) + int(g).to_bytes(4, "big") for h in hashes for g in group_ids],
        dtype=pl.Binary,
    )
    return pl.concat([keys["key"], siblings]).unique()


def store_rows(stores: pl.LazyFrame, keys: pl.Series) -> pl.DataFrame:
    """The store rows of ``keys``, and every reset: one pass, filtered in the reader."""
    return collect(
        stores.filter(pl.col("key").is_in(keys.unique().implode()) | (pl.col("event") == "reset"))
    )


def causes(probes: pl.DataFrame, stores: pl.LazyFrame, group_ids: Sequence[int]) -> pl.DataFrame:
    """``probes`` plus ``cause`` (see the module doc). Touches only the probes' keys (and
    their block hashes under ``group_ids``): two passes over ``stores``, one for those
    keys' rows, one for each group's first preparation. ``stores`` may be any part of the
    store rows holding every row before the probes' episodes (`keytrace.analysis.diff`
    passes the rows up to a batch's end).
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
    resets = rows.filter(ev == "reset").select("inst", "seq")
    other_gid = rows.filter(ev == "completed").select(
        "inst", "seq", pl.col("gid").alias("other_gid"), _hash(pl.col("key")).alias("h")
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
        base.join(hist, on="key")
        .filter(
            (pl.col("inst_right") != pl.col("inst"))
            & (pl.col("ts") < pl.col("t"))
            & ev.is_in(OFFER_EVENTS)
        )
        .select("pid", pl.lit(True).alias("other_engine"))
        .unique("pid")
    )
    # the hash under another group id, while this group id never reached the store path
    skew = (
        base.with_columns(_hash(pl.col("key")).alias("h"))
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
    removed = pl.max_horizontal("evicted", "reset")
    # A completion needs no term here: a completed key is resident (checked first) unless a
    # removal followed the completion, and then that removal also follows the preparation.
    in_flight = (
        pl.col("prepared").is_not_null()
        & (removed.is_null() | (pl.col("prepared") > removed))
        & (pl.col("failed_at").is_null() | (pl.col("failed_at") < pl.col("prepared")))
    )
    own_gid_stored = pl.col("first_prep").is_not_null() & (pl.col("first_prep") < pl.col("s"))
    cause = (
        pl.when(resident(pl.col("completed"), removed))
        .then(pl.lit("resident"))
        .when(in_flight)
        .then(pl.lit("in_flight"))
        .when(pl.col("completed").is_not_null())
        .then(pl.lit("evicted"))
        .when(pl.col("other_engine").fill_null(False))
        .then(pl.lit("other_engine"))
        .when(pl.col("failed_at").is_not_null())
        .then(pl.lit("store_failed"))
        .when(pl.col("rejected").fill_null(False))
        .then(pl.lit("rejected"))
        .when(pl.col("other_gid_stored").fill_null(False) & ~own_gid_stored)
        .then(pl.lit("other_group"))
        .when(pl.col("keyable_end").is_not_null() & (pl.col("token_end") <= pl.col("keyable_end")))
        .then(pl.lit("never_offered"))
        .otherwise(pl.lit("not_keyable"))
    )
    return facts.with_columns(cause.alias("cause")).select(*probes.columns, "cause")
