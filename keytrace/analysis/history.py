"""Why a key a lookup needed was (not) there: the store history of a key at a moment.

A *probe* is one key needed by one episode: ``(pid, inst, s, t, key, gid, token_end,
keyable_end)``: the episode's recorder instance, sequence number and wall clock, the key
and its group, the token its chunk ends at, and how far the earlier requests on the
episode's chain reached (a chunk ending beyond that was never keyable by them).

`causes` adds ``cause`` to every probe: it gathers, per probe, the facts
`keytrace.analysis.definitions.KeyFacts` names from the store rows, and the one definition
(`keytrace.analysis.definitions.cause`, the table ``CAUSES``) turns them into a cause, with
this precedence (docs/diff.md):

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

from keytrace.analysis.definitions import KeyFacts, cause
from keytrace.analysis.frames import collect
from keytrace.analysis.rules import OFFER_EVENTS
from keytrace.format.keys import key_hash, make_key

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
    )
    return facts.with_columns(cause(facts_of).alias("cause")).select(*probes.columns, "cause")
