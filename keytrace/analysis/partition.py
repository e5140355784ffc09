"""A trace of many engines, judged engine by engine: the few facts that cross engines.

Every verdict of an episode reads its own recorder instance's rows (its lookups, its store
history by sequence number, its tier rows), except three things another engine can change:

1. **routing** (the lost-token account of a cold episode): another instance offered, before
   the episode's wall clock, the full-attention key of one of its request boundaries that
   this episode's request also offered. The fact: every instance's *boundary offers*
   (one row per request boundary: instance, key, boundary, first wall clock), the
   `keytrace.analysis.lost.Routing` ``elsewhere`` table.
2. **other_engine** (the cause of a needed key): another instance offered the key before
   the episode's wall clock. A needed key that did not hit is nearly always a key at the
   head of one of the episode's scans that did not answer HIT, or one the recorder listed
   for it; so each partition first names those keys (``asked``: `asked_keys`), and every
   partition then gives, for just those keys, when each of its instances first offered
   each (a probe key outside them is read from the whole trace). Per key the table keeps
   the earliest offer (instance, wall clock) and the earliest on any *other* instance
   (`FirstOffers`): an episode on X at t saw another engine's offer iff the first offer
   not on X came before t, i.e. ``(inst1 != X and ts1 < t) or ts2 < t``
   (`keytrace.analysis.history.offered_elsewhere`).
3. **keyless chunks** (`keytrace.analysis.unknown`): a needed chunk whose key the episode
   never recorded is derived from, or settled by, requests that share its prefix, on any
   engine. This reads other engines' rows of just the keys concerned, from the whole
   trace (``fleet``); on traces of schema 2 it is rare (vLLM's key lists are recorded).
   A key derived so is looked up in the whole trace too, for (2).

The unit of work is a *partition*: a set of instances judged together (`plan`: packed by
rows, so many small engines do not each pay a judgement's fixed cost). Within one, every
instance is still judged from its own rows (every join is on the instance) and from the
facts about the others; a partition of every instance is the whole trace, which needs no
facts at all. So the work divides into: per partition, its exports (`exports`: boundary
offers, asked keys); once, their union (`CrossEngine`); per partition, its first offers of
the asked keys (`first_offers_of`); once, `FirstOffers`; per partition, the judgement
(`keytrace.analysis.diff.judge_partition`). The runner (`keytrace.analysis.runners`) maps
the per-partition steps over a process pool or a Ray cluster; the report is the same bytes
however the instances are partitioned and whoever runs them (merged in one order: sequence
number, then instance). Pure: returns data, never prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from keytrace.analysis import frames
from keytrace.analysis.boundaries import boundary_offers
from keytrace.format.reader import Trace
from keytrace.format.schema import SCAN_PROOF, SCAN_UNQUERIED
from keytrace.format.shape import lookup_rows
from keytrace.judge.rules import OFFER_EVENTS, Group

__all__ = [
    "CrossEngine",
    "Exports",
    "FirstOffers",
    "cross_engine",
    "exports",
    "first_offers_of",
    "plan",
]

_KEYS = pl.Schema({"key": pl.Binary})


@dataclass(frozen=True)
class Exports:
    """What one partition contributes to the cross-engine facts (`exports`)."""

    offers: pl.DataFrame
    """`keytrace.analysis.boundaries.boundary_offers` of its instances (their own chains
    read them whole; the other partitions read their ``elsewhere`` projection)."""
    asked: pl.DataFrame
    """(key): keys its episodes asked for and did not get, or listed (`asked_keys`)."""
    episodes: int
    """Its lookup episodes (for progress)."""


@dataclass(frozen=True)
class FirstOffers:
    """When the ``asked`` keys were first offered: per key ``inst1``/``ts1``, the earliest
    offer (recorder instance, wall clock), and ``ts2``, the earliest on an instance other
    than ``inst1`` (null: none). ``asked``: every key the table answers for (a key no
    instance offered has no row); ``fleet``: the whole trace, read for a key outside
    ``asked`` (a derived key). None of it is read when the trace is one partition."""

    first: pl.DataFrame
    asked: pl.DataFrame
    fleet: Trace | None = None


ELSEWHERE_SCHEMA = {
    "other": pl.Int64,
    "key": pl.Binary,
    "b": pl.Int64,
    "first_ts": pl.Int64,
    "held_ts": pl.Int64,
}
"""`CrossEngine.elsewhere`: per instance, boundary and key, its first offer and its first
completed store of the key (wall clock; null: none completed)."""


@dataclass(frozen=True)
class CrossEngine:
    """The facts every instance's judgement reads besides its own rows (module doc)."""

    elsewhere: pl.DataFrame
    """(other, key, b, first_ts, held_ts): `keytrace.analysis.lost.Routing` ``elsewhere``."""
    offers: FirstOffers
    partitions: int


def plan(rows: dict[int, int], partitions: int) -> list[tuple[int, ...]]:
    """The instances (``rows``: rows per instance) in at most ``partitions`` sets of about
    equal rows (largest first, each to the lightest set), each sorted, in order of their
    first instance: the same plan for the same trace and count."""
    bins: list[list[int]] = [[] for _ in range(max(1, min(partitions, len(rows))))]
    load = [0] * len(bins)
    for inst in sorted(rows, key=lambda i: (-rows[i], i)):
        k = min(range(len(bins)), key=lambda b: (load[b], b))
        bins[k].append(inst)
        load[k] += rows[inst]
    return sorted((tuple(sorted(b)) for b in bins if b), key=lambda b: b[0])


def exports(view: Trace, shared: tuple[list[Group], bool]) -> Exports:
    """One partition's exports; ``view``: `Trace.of_instances` of it (or the whole trace, the
    one partition); ``shared``: the
    trace's groups, and whether the trace has other partitions (else nothing is asked)."""
    groups, several = shared
    offers = boundary_offers(view, groups)
    n = frames.collect(frames.episodes(view).select(pl.len())).item()
    asked = asked_keys(view) if several else pl.DataFrame(schema=_KEYS)
    return Exports(offers, asked, int(n))


def asked_keys(view: Trace) -> pl.DataFrame:
    """(key), distinct: the keys a needed chunk of ``view``'s episodes is nearly always
    probed under: a key in a scan's head whose lookup was not HIT (vLLM starts a scan where
    a hit would end, so the needed chunks are at the head: `keytrace.format.schema.HEAD`;
    a window scan's long run of misses to chunk 0 is in the tail, never needed), a scan's
    terminal key, a key the recorder listed (unqueried groups, proofs). Any other probe key
    (a tail lookup, a derived key) is looked up in the whole trace instead
    (`keytrace.analysis.history.offered_elsewhere`), so this set decides the cost, never a
    verdict."""
    rows = lookup_rows(view)
    scanned = rows.filter(pl.col("scan") >= 0)
    called = [
        scanned.select(pl.col("head_keys").alias("key"), pl.col("head_results").alias("r"))
        .explode("key", "r")
        .filter(pl.col("key").is_not_null() & (pl.col("r").cast(pl.String) != "HIT"))
        .select("key")
    ]
    terminal = scanned.select(pl.col("term_key").alias("key")).drop_nulls()
    listed = (
        rows.filter(pl.col("scan").is_in([SCAN_UNQUERIED, SCAN_PROOF]))
        .select(pl.col("head_keys").alias("key"))
        .explode("key")
        .drop_nulls()
    )
    return frames.collect(pl.concat([*called, terminal, listed]).unique())


def cross_engine(every: Sequence[Exports]) -> CrossEngine:
    """The routing facts of all instances' exports (the first-offer table follows, once
    the asked keys are known: `asked_of`, `first_offers_of`, `first_offers`)."""
    offers = [e.offers for e in every if e.offers.height]
    elsewhere = (
        pl.concat(offers)
        .group_by("inst", "key", "b")
        .agg(pl.col("first_ts").min(), pl.col("held_ts").min())
        .rename({"inst": "other"})
        .sort("other", "key", "b")
        if offers
        else pl.DataFrame(schema=ELSEWHERE_SCHEMA)
    )
    empty = FirstOffers(_first_schema(), pl.DataFrame(schema=_KEYS))
    return CrossEngine(elsewhere, empty, len(every))


def asked_of(every: Sequence[Exports]) -> pl.DataFrame:
    """(key): the union of the instances' asked keys, sorted (the same bytes whoever runs)."""
    asked = [e.asked for e in every if e.asked.height]
    return pl.concat(asked).unique().sort("key") if asked else pl.DataFrame(schema=_KEYS)


def first_offers_of(view: Trace, asked: pl.DataFrame) -> pl.DataFrame:
    """(key, inst, ts): when each of ``view``'s instances first offered each of ``asked``."""
    return frames.collect(
        frames.stores(view)
        .filter(pl.col("event").is_in(OFFER_EVENTS) & pl.col("key").is_in(asked["key"].implode()))
        .group_by("key", "inst")
        .agg(pl.col("ts").min())
    )


def first_offers(per_instance: Sequence[pl.DataFrame]) -> pl.DataFrame:
    """`FirstOffers.first` from every instance's `first_offers_of`."""
    parts = [f for f in per_instance if f.height]
    if not parts:
        return _first_schema()
    each = pl.concat(parts).sort("key", "ts", "inst")
    first = each.group_by("key", maintain_order=True).agg(
        pl.col("inst").first().alias("inst1"), pl.col("ts").first().alias("ts1")
    )
    second = (
        each.join(first, on="key")
        .filter(pl.col("inst") != pl.col("inst1"))
        .group_by("key")
        .agg(pl.col("ts").min().alias("ts2"))
    )
    return first.join(second, on="key", how="left").sort("key")


def _first_schema() -> pl.DataFrame:
    return pl.DataFrame(
        schema={"key": pl.Binary, "inst1": pl.Int64, "ts1": pl.Int64, "ts2": pl.Int64}
    )
