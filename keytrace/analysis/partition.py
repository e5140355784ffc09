"""A trace of many engines, judged engine by engine: the few facts that cross engines.

Every verdict of an episode reads its own recorder instance's rows (its lookups, its store
history by sequence number, its tier rows), except three things another engine can change:

1. **routing** (the lost-token account of a cold episode): another instance offered, before
   the episode's wall clock, the full-attention key of one of its request boundaries that
   this episode's request also offered. The fact: every instance's *boundary offers*
   (one row per request boundary: instance, key, boundary, first wall clock), the
   `keytrace.analysis.lost.Routing` ``elsewhere`` table.
2. **other_engine** (the cause of a needed key): another instance offered the key before
   the episode's wall clock. A needed key that did not hit is a key the episode's lookups
   asked for and did not get, or one the recorder listed for it; so each instance first
   names those keys (``asked``: its lookups' keys without a HIT, its scans' terminal keys,
   its listed keys), and every instance then gives, for just those keys, when it first
   offered each. Per key the table keeps the earliest offer (instance, wall clock) and the
   earliest on any *other* instance (`FirstOffers`): an episode on X at t saw another
   engine's offer iff the first offer not on X came before t, i.e. ``(inst1 != X and
   ts1 < t) or ts2 < t`` (`keytrace.analysis.history.offered_elsewhere`).
3. **keyless chunks** (`keytrace.analysis.unknown`): a needed chunk whose key the episode
   never recorded is derived from, or settled by, requests that share its prefix, on any
   engine. This reads other engines' rows of just the keys concerned, from the whole
   trace (``fleet``); on traces of schema 2 it is rare (vLLM's key lists are recorded).
   A key derived so is looked up in the whole trace too, for (2).

So the work divides into: per instance, its exports (`exports`: boundary offers, asked
keys); once, their union (`CrossEngine`); per instance, its first offers of the asked keys
(`first_offers_of`); once, `FirstOffers`; per instance, the judgement
(`keytrace.analysis.diff.judge_instance`). The runner (`keytrace.analysis.runners`) maps
the per-instance steps over a process pool or a Ray cluster; what it returns is the same
whatever runs it, and the report is merged in one order (sequence number, then instance).
Pure: returns data, never prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from keytrace.analysis import frames
from keytrace.analysis.boundaries import boundary_offers
from keytrace.analysis.rules import OFFER_EVENTS, Group
from keytrace.format.reader import Trace
from keytrace.format.schema import SCAN_PROOF, SCAN_UNQUERIED
from keytrace.format.shape import lookup_rows

__all__ = ["CrossEngine", "Exports", "FirstOffers", "cross_engine", "exports", "first_offers_of"]

_KEYS = pl.Schema({"key": pl.Binary})


@dataclass(frozen=True)
class Exports:
    """What one instance contributes to the cross-engine facts (`exports`)."""

    instance: int
    offers: pl.DataFrame
    """`keytrace.analysis.boundaries.boundary_offers` of the instance (its own chains read
    them whole; the other instances read their ``elsewhere`` projection)."""
    asked: pl.DataFrame
    """(key): the keys its episodes asked for and did not get, or listed."""
    episodes: int
    """Its lookup episodes (for progress)."""


@dataclass(frozen=True)
class FirstOffers:
    """When the ``asked`` keys were first offered: per key ``inst1``/``ts1``, the earliest
    offer (recorder instance, wall clock), and ``ts2``, the earliest on an instance other
    than ``inst1`` (null: none). ``asked``: every key the table answers for (a key no
    instance offered has no row); ``fleet``: the whole trace, read for a key outside
    ``asked`` (a derived key). None of it is read on a trace of one instance."""

    first: pl.DataFrame
    asked: pl.DataFrame
    fleet: Trace | None = None


@dataclass(frozen=True)
class CrossEngine:
    """The facts every instance's judgement reads besides its own rows (module doc)."""

    elsewhere: pl.DataFrame
    """(other, key, b, first_ts): `keytrace.analysis.lost.Routing` ``elsewhere``."""
    offers: FirstOffers
    instances: int


def exports(view: Trace, groups: list[Group]) -> Exports:
    """One instance's exports; ``view``: `Trace.of_instance` of it."""
    offers = boundary_offers(view, groups)
    n = frames.collect(frames.episodes(view).select(pl.len())).item()
    return Exports(_instance(view), offers, asked_keys(view), int(n))


def asked_keys(view: Trace) -> pl.DataFrame:
    """(key), distinct: every key a needed chunk of ``view``'s episodes can be probed
    under without a derivation: a lookup call's key whose result was not HIT, a scan's
    terminal key, a key the recorder listed (unqueried groups, proofs). Only the key and
    result lists are exploded (`keytrace.analysis.frames.lookup_keys` explains the cost)."""
    rows = lookup_rows(view)
    scanned = rows.filter(pl.col("scan") >= 0)
    called = [
        scanned.select(pl.col(f"{p}_keys").alias("key"), pl.col(f"{p}_results").alias("r"))
        .explode("key", "r")
        .filter(pl.col("key").is_not_null() & (pl.col("r").cast(pl.String) != "HIT"))
        .select("key")
        for p in ("head", "tail")
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
        .agg(pl.col("first_ts").min())
        .rename({"inst": "other"})
        .sort("other", "key", "b")
        if offers
        else pl.DataFrame(
            schema={"other": pl.Int64, "key": pl.Binary, "b": pl.Int64, "first_ts": pl.Int64}
        )
    )
    empty = FirstOffers(_first_schema(), pl.DataFrame(schema=_KEYS))
    return CrossEngine(elsewhere, empty, len(every))


def asked_of(every: Sequence[Exports]) -> pl.DataFrame:
    """(key): the union of the instances' asked keys, sorted (the same bytes whoever runs)."""
    asked = [e.asked for e in every if e.asked.height]
    return pl.concat(asked).unique().sort("key") if asked else pl.DataFrame(schema=_KEYS)


def first_offers_of(view: Trace, asked: pl.DataFrame) -> pl.DataFrame:
    """(key, inst, ts): when ``view``'s instance first offered each of ``asked``."""
    return frames.collect(
        frames.stores(view)
        .filter(pl.col("event").is_in(OFFER_EVENTS) & pl.col("key").is_in(asked["key"].implode()))
        .group_by("key", "inst")
        .agg(pl.col("ts").min())
    )


def first_offers(per_instance: Sequence[pl.DataFrame], asked: pl.DataFrame) -> pl.DataFrame:
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


def _instance(view: Trace) -> int:
    if view.instance is None:
        raise ValueError("exports() takes a Trace.of_instance view")
    return view.instance
