"""Where the store path meant later lookups to hit: the intended boundaries of an episode.

Every request keeps sliding-window tails for its own boundary (its own cap, `store_boundary`)
and, when the GPU prefix cache reported one, for its ``shared_prefix_boundary`` junction
(aligned down): ``reachable_boundaries`` in ``_build_store_jobs``. A boundary ``b`` of an
earlier request ``r'`` is *intended* for an episode when ``r'`` shares the episode's prefix
through ``b``. Keys are chained, content-addressed hashes, so that is exactly: ``r'``
offered (before the episode) the same anchor-group key for the chunk ending at ``b`` as the
episode looked up. The anchor is the first full-attention group (else the first group).

Only one key per (request, boundary) is joined against the episode's anchor lookups, so the
cost is one pass over the anchor group's store rows (`boundary_offers`, shared with the
routing account) and one over its lookup rows. ``r'`` may be the episode's own
request (a preempted request that stored before it was resumed): it stored before ``s``.
"""

from __future__ import annotations

import polars as pl

from keytrace.analysis import frames
from keytrace.format.reader import Trace
from keytrace.judge.definitions import DURABLE_EVENTS, anchor, boundary_chunk, junction_kept
from keytrace.judge.identity import on_shared_tier
from keytrace.judge.ops import lit
from keytrace.judge.rules import STORE_OFFERS, Group, align_down, store_boundary

__all__ = [
    "anchor",
    "anchor_offers",
    "boundary_offers",
    "chain",
    "request_boundaries",
    "shared_boundaries",
    "shared_writes",
]


def request_boundaries(episodes: pl.LazyFrame, groups: list[Group]) -> pl.LazyFrame:
    """(inst, req_id, P, b, since, until): every request's own boundary (from its first
    episode on), and each junction an episode of it carried, from that episode to the
    request's next one (``until``; null: none, or an own boundary).

    vLLM's store path keeps tails for the junction the request carries *when it stores*,
    and every lookup sets it afresh (`keytrace.judge.definitions.carried_junction`): a
    ``shared_prefix_boundary`` first reported by a later episode (a request resumed after
    preemption) says nothing about what the request stored before, and one an earlier
    episode reported says nothing about what it stores after it looked up again;
    `boundary_offers` counts only offers inside the window. (The live alarm's chain book
    keeps the junction a request carries the same way.)"""
    req = episodes.group_by("inst", "req_id").agg(pl.col("P").max(), pl.col("s").min())
    own = req.select(
        "inst",
        "req_id",
        "P",
        store_boundary(groups, pl.col("P")).alias("b"),
        pl.col("s").alias("since"),
        pl.lit(None, pl.Int64).alias("until"),
    )
    at = align_down(pl.col("spb"), groups)
    kept = lit(junction_kept(groups, at, pl.col("S") + pl.col("X")))
    junction = (
        episodes.sort("s")
        .with_columns(pl.col("s").shift(-1).over("inst", "req_id").alias("until"))
        .filter((pl.col("spb") > 0) & kept)
        .join(req.select("inst", "req_id", "P"), on=["inst", "req_id"])
        .select("inst", "req_id", "P", at.alias("b"), pl.col("s").alias("since"), "until")
    )
    return pl.concat([own, junction]).filter(pl.col("b") > 0)


def anchor_offers(stores: pl.LazyFrame, groups: list[Group]) -> pl.LazyFrame:
    """The anchor group's store rows that offered a key (any offer event, not evictions)."""
    return stores.filter(
        (pl.col("gid") == anchor(groups).gid) & pl.col("event").is_in(STORE_OFFERS)
    )


def boundary_offers(trace: Trace, groups: list[Group]) -> pl.DataFrame:
    """(inst, req_id, b, key, P, first_seq, first_ts, held_ts): the anchor-group key each
    request offered (any offer event) for the chunk ending at each of its boundaries ``b``,
    when it first did (sequence number and wall clock), and when its store of it first
    completed (``held_ts``, wall clock; null: it never did, a failed or rejected offer). One pass over the store rows serves both
    `chain` (same instance, by sequence number) and the routing account in
    `keytrace.analysis.lost` (other instances, by wall clock)."""
    a = anchor(groups)
    # Small sides are collected before they meet a whole kind: joined lazily, the streaming
    # engine holds the big side while the small one is still being computed.
    bounds = frames.collect(
        request_boundaries(frames.episodes(trace), groups).with_columns(
            boundary_chunk(pl.col("b"), a.tpc).alias("chunk")
        )
    )
    return frames.collect(
        anchor_offers(frames.stores(trace, at=bounds), groups)
        .join(bounds.lazy(), on=["inst", "req_id", "chunk"])
        .filter(
            (pl.col("seq") > pl.col("since"))
            & (pl.col("until").is_null() | (pl.col("seq") < pl.col("until")))
        )
        .group_by("inst", "req_id", "b", "key")
        .agg(
            pl.col("P").first(),
            pl.col("seq").min().alias("first_seq"),
            pl.col("ts").min().alias("first_ts"),
            pl.col("ts").filter(pl.col("event") == "completed").min().alias("held_ts"),
        )
    )


def chain(lookups: pl.LazyFrame, offers: pl.DataFrame) -> pl.LazyFrame:
    """Per episode: its intended ``boundaries``, the ``chain`` requests and ``chain_P`` (the
    longest prompt among them: how far they could key chunks). ``lookups``: (inst, s, key)
    of the anchor group (`frames.lookup_keys`). ``offers``: `boundary_offers`,
    joined against the anchor group's lookups as a small literal table (a lazy join would
    hold the store pages for the whole query)."""
    return (
        lookups.select("inst", "s", "key")
        .join(offers.lazy(), on=["inst", "key"])
        .filter(pl.col("first_seq") < pl.col("s"))
        .sort("first_seq")
        .group_by("inst", "s")
        .agg(
            pl.col("b").unique().alias("boundaries"),
            pl.col("req_id").unique(maintain_order=True).alias("chain"),
            pl.col("P").max().alias("chain_P"),
        )
    )


def shared_writes(offers: pl.DataFrame, tiers: pl.LazyFrame, shared: pl.DataFrame) -> pl.DataFrame:
    """(other, key, b, written): each boundary key (``offers``: (inst, key, b, first_ts),
    every instance's, as `keytrace.analysis.partition.CrossEngine.elsewhere` holds them) an
    instance wrote through to a tier another instance shares (``shared``: (inst, other,
    tier), the scope rule's pairs); ``written``: from when the boundary was both offered
    and on the tier (the later of its first offer and the first completed write, wall
    clock)."""
    if shared.height == 0 or offers.height == 0:
        return pl.DataFrame(
            schema={"other": pl.Int64, "key": pl.Binary, "b": pl.Int64, "written": pl.Int64}
        )
    places = shared.select(pl.col("other").alias("inst"), "tier").unique()
    written = (
        tiers.filter(pl.col("event").cast(pl.String).is_in([str(e) for e in DURABLE_EVENTS]))
        .join(offers.select("key").unique().lazy(), on="key")
        .join(places.lazy(), on=["inst", "tier"])
        .group_by("inst", "key")
        .agg(pl.col("ts").min().alias("written"))
    )
    # the boundary was intended (offered for it) and the key on the tier: the later of both
    return frames.collect(
        offers.lazy()
        .group_by("inst", "key", pl.col("b").cast(pl.Int64))
        .agg(pl.col("first_ts").min())
        .join(written, on=["inst", "key"])
        .select(
            pl.col("inst").alias("other"),
            "key",
            "b",
            pl.max_horizontal("written", "first_ts").alias("written"),
        )
    )


def shared_boundaries(
    lookups: pl.LazyFrame, episodes: pl.LazyFrame, writes: pl.DataFrame, shared: pl.DataFrame
) -> pl.LazyFrame:
    """(inst, s, shared_b): per episode the boundaries whose anchor key another instance
    wrote through to a tier this one reads, before the episode (`on_shared_tier`): intended
    for it as if its own chain had stored them. ``lookups``: (inst, s, key) of the anchor
    group; ``writes``: `shared_writes`."""
    pairs = shared.select("inst", "other").unique()
    return (
        lookups.select("inst", "s", "key")
        .join(episodes.select("inst", "s", "t"), on=["inst", "s"])
        .join(writes.lazy(), on="key")
        .join(pairs.lazy(), on=["inst", "other"])
        .filter(on_shared_tier(pl.col("written"), pl.col("t")))
        .group_by("inst", "s")
        .agg(pl.col("b").unique().alias("shared_b"))
    )
