"""Needed chunks whose key the episode never looked up: derive the key, or settle the cause.

vLLM stops at the first group that returns 0, and the recorder lists the rest (trace
format v2, ``scan = -2``) only up to where it expected the hit; a few needed chunks can
still lack a key (v1 traces: every unqueried one). Both functions here read only the rows
of the requests and keys concerned, never the whole trace: `records_of` semi-joins before
a lookup list is exploded, `holders_of` filters by key before it is.
"""

from __future__ import annotations

import polars as pl

from keytrace.analysis import frames
from keytrace.format.keys import key_gid, key_hash, make_key
from keytrace.format.reader import Trace
from keytrace.judge.rules import STORE_OFFERS

KEY = ["inst", "s"]


def records_of(trace: Trace, requests: pl.LazyFrame) -> pl.LazyFrame:
    """(inst, req_id, end_token, key) of every lookup and store row of ``requests``
    (inst, req_id), keyed rows only."""
    reqs = requests.select("inst", "req_id").unique()
    return pl.concat(
        [
            frames.lookups(trace, requests=reqs).select("inst", "req_id", "end_token", "key"),
            frames.stores(trace)
            .join(reqs, on=["inst", "req_id"], how="semi")
            .select("inst", "req_id", "end_token", "key"),
        ]
    ).filter(pl.col("end_token").is_not_null() & pl.col("key").is_not_null())


def holders_of(trace: Trace, keys: pl.Series) -> pl.LazyFrame:
    """(inst, req_id, key), distinct: every request that looked up, offered or stored one
    of ``keys`` (so shares the prefix through it)."""
    wanted = keys.cast(pl.Binary).unique()
    gids = sorted({key_gid(bytes(k)) for k in wanted.to_list()})
    return (
        pl.concat(
            [
                frames.lookups(trace, gids=gids, having=wanted).select("inst", "req_id", "key"),
                # an eviction row names the request whose store pushed the key out, not
                # one that shares its prefix
                frames.stores(trace)
                .filter(pl.col("event").is_in(STORE_OFFERS))
                .select("inst", "req_id", "key"),
            ]
        )
        .filter(pl.col("key").is_in(wanted.implode()))
        .unique()
    )


def _sharers(trace: Trace, anchors: pl.DataFrame, keep: list[str]) -> pl.LazyFrame:
    """``keep`` columns of each slot, with (r_inst, r_req) for every request that holds the
    slot's anchor key (so shares the prefix through it)."""
    return (
        anchors.lazy()
        .join(holders_of(trace, anchors["anchor"]), left_on="anchor", right_on="key")
        .select(*keep, pl.col("inst_right").alias("r_inst"), pl.col("req_id").alias("r_req"))
    )


def derive_keys(
    trace: Trace, needed: pl.DataFrame, sf: pl.DataFrame, fleet: Trace | None = None
) -> pl.DataFrame:
    """Keys of needed chunks the episode never looked up (vLLM stopped in another group).

    A key is the block hash of the chunk's last hash block plus the group id, and every
    chunk that ends at the same token of the same prefix has that block hash, in any
    group. Sources, in order:

    1. the request's own recorded keys (its lookups in any of its episodes, e.g. before a
       preemption; its store rows of any event and time) ending at that token;
    2. keys ending at that token recorded by any request that also recorded one of this
       request's keys ending *at or after* it: content-addressed chained keys mean that
       request shares the whole prefix through the chunk.

    A derived key has no lookup result; its cause comes from the store history as usual.
    """
    missing = needed.filter(pl.col("key").is_null()).with_columns(
        ((pl.col("chunk") + 1) * pl.col("tpc")).alias("end")
    )
    if missing.height == 0:
        return needed
    slots = missing.select(*KEY, "gid", "chunk", "end").lazy()
    mine = sf.join(missing.select(KEY).unique(), on=KEY).select("inst", "req_id", "s").lazy()
    own = records_of(trace, mine).join(mine, on=["inst", "req_id"]).select(*KEY, "end_token", "key")
    own = own.pipe(frames.collect).lazy()
    direct = slots.join(own, left_on=[*KEY, "end"], right_on=[*KEY, "end_token"]).select(
        *KEY, "gid", "chunk", "key"
    )
    anchors = (
        slots.join(own, on=KEY)
        .filter(pl.col("end_token") >= pl.col("end"))
        .group_by(*KEY, "gid", "chunk", "end")
        .agg(pl.col("key").sort_by("end_token").first().alias("anchor"))
        .pipe(frames.collect)
    )
    everyone = fleet if fleet is not None else trace
    sharers = _sharers(everyone, anchors, [*KEY, "gid", "chunk", "end"]).pipe(frames.collect)
    theirs = records_of(
        everyone,
        sharers.select(pl.col("r_inst").alias("inst"), pl.col("r_req").alias("req_id")).lazy(),
    ).select(pl.col("inst").alias("r_inst"), pl.col("req_id").alias("r_req"), "end_token", "key")
    shared = (
        sharers.lazy()
        .join(theirs, left_on=["r_inst", "r_req", "end"], right_on=["r_inst", "r_req", "end_token"])
        .select(*KEY, "gid", "chunk", "key")
    )
    found = (
        pl.concat(
            [
                direct.with_columns(pl.lit(0).alias("rank")),
                shared.with_columns(pl.lit(1).alias("rank")),
            ]
        )
        .group_by(*KEY, "gid", "chunk")
        .agg(pl.col("key").sort_by("rank").first())
        .pipe(frames.collect)
    )
    derived = [
        (i, s, gid, chunk, make_key(key_hash(bytes(k)), gid))
        for i, s, gid, chunk, k in found.iter_rows()
    ]
    if not derived:
        return needed
    d = pl.DataFrame(
        derived,
        schema={
            "inst": pl.Int64,
            "s": pl.Int64,
            "gid": pl.Int32,
            "chunk": pl.Int64,
            "dkey": pl.Binary,
        },
        orient="row",
    )
    return (
        needed.join(d, on=[*KEY, "gid", "chunk"], how="left")
        .with_columns(pl.coalesce("key", "dkey").alias("key"))
        .drop("dkey")
    )


def settle_offers(
    trace: Trace, needed: pl.DataFrame, sf: pl.DataFrame, fleet: Trace | None = None
) -> pl.DataFrame:
    """For a needed chunk whose key stays unknown: was it provably never offered?

    Any request that can have offered *this* chunk shares the request's prefix through its
    end, so it also shares the request's last known key before the chunk (chained keys).
    If no request sharing that key offered this group's chunk at this index before the
    episode (on its engine; elsewhere before its wall clock), nobody did: the cause follows
    without the key (``never_offered``/``not_keyable``, set by the differ); ``unoffered``
    marks those chunks. If one of them did, the key may be theirs or not, and the chunk
    stays unknown (a request sharing a *later* key of this request would prove it theirs
    only for requests at least that long, so that shortcut is not taken). ``fleet``: as
    in `derive_keys`.
    """
    unknown = needed.filter(pl.col("key").is_null()).with_columns(
        ((pl.col("chunk") + 1) * pl.col("tpc")).alias("end")
    )
    if unknown.height == 0:
        return needed.with_columns(pl.lit(False).alias("unoffered"))
    slots = unknown.select(*KEY, "gid", "chunk", "end").lazy()
    mine = sf.join(unknown.select(KEY).unique(), on=KEY).select("inst", "req_id", "s").lazy()
    own = records_of(trace, mine).join(mine, on=["inst", "req_id"]).select(*KEY, "end_token", "key")
    anchors = (
        slots.join(own, on=KEY)
        .filter(pl.col("end_token") < pl.col("end"))
        .group_by(*KEY, "gid", "chunk")
        .agg(pl.col("key").sort_by("end_token").last().alias("anchor"))
        .pipe(frames.collect)
    )
    everyone = fleet if fleet is not None else trace
    sharers = _sharers(everyone, anchors, [*KEY, "gid", "chunk"])
    offers = (
        frames.stores(everyone)
        .filter(pl.col("event").is_in(STORE_OFFERS))
        .select(
            pl.col("inst").alias("r_inst"),
            pl.col("req_id").alias("r_req"),
            "gid",
            "chunk",
            "seq",
            "ts",
        )
    )
    offered = (
        sharers.join(offers, on=["r_inst", "r_req", "gid", "chunk"])
        .join(sf.select(*KEY, "t").lazy(), on=KEY)
        .filter(
            ((pl.col("r_inst") == pl.col("inst")) & (pl.col("seq") < pl.col("s")))
            | ((pl.col("r_inst") != pl.col("inst")) & (pl.col("ts") < pl.col("t")))
        )
        .select(*KEY, "gid", "chunk")
        .unique()
    )
    settled = (
        anchors.lazy()
        .select(*KEY, "gid", "chunk")
        .join(offered, on=[*KEY, "gid", "chunk"], how="anti")
        .with_columns(pl.lit(True).alias("unoffered"))
        .pipe(frames.collect)
    )
    return needed.join(settled, on=[*KEY, "gid", "chunk"], how="left").with_columns(
        pl.col("unoffered").fill_null(False)
    )
