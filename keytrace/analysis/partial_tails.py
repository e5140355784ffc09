"""Partial tails in the differ: the rules of `keytrace.judge.partial` over polars columns.

Three steps, each run only on a trace with partial tails on (`partial_tails_on`), so every
other trace is judged by exactly the queries it was before:

- `chains`: each episode's intended tails, the tails chain requests offered before it of a
  key the episode probed (any group's: a boundary key is ``hash[T/h - 1]`` with the group's
  id, so equal keys are an equal prefix through ``T``);
- `with_expected`: ``L_p``, ``E_p`` and ``E = max(E_c, E_p)`` (and the same without the
  request's load cap, ``E_free``);
- `needed`: for a shortfall below a partial ``E``, what the hit needs
  (`keytrace.judge.partial.partial_needed`: the complete chunks, and every group's key at
  ``E`` as a row of ``tpc = h`` whose chunk ends at ``E``), and the binding probe at ``E``
  (its first MISS, else its first HIT_PENDING or RETRY: `probe_terminal`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from keytrace.analysis import frames
from keytrace.format.keys import gid_tail, key_hash
from keytrace.format.reader import Trace
from keytrace.judge import definitions as d
from keytrace.judge.ops import as_expr
from keytrace.judge.partial import (
    expected_with_partial,
    is_partial,
    offer_boundary,
    partial_block,
    partial_cap,
    partial_in_reach,
    partial_tails_on,
    probe_terminal,
)
from keytrace.judge.rules import (
    PARTIAL_ANCHOR_COMPLETE,
    STORE_OFFERS,
    Group,
    load_cap,
    partial_anchor_of,
)

KEY = ["inst", "s"]

__all__ = [
    "binding",
    "chains",
    "complete_needed",
    "enabled",
    "offers",
    "with_chains",
    "with_expected",
    "with_keys",
]


def enabled(header: Mapping[str, Any]) -> bool:
    """The trace stored and looked up partial tails (and says its block)."""
    return partial_tails_on(header) and partial_block(header) > 0


def _tph(header: Mapping[str, Any]) -> int:
    return int(header.get("tokens_per_hash") or 1)


def offers(trace: Trace, bs: int) -> pl.LazyFrame:
    """(inst, key, T, first_seq): every partial-tail key a request offered, at its tail
    ``T`` (`offer_boundary`), when first offered on its instance."""
    return (
        frames.stores(trace)
        .filter(pl.col("chunk").is_null() & pl.col("event").is_in(STORE_OFFERS))
        .with_columns(as_expr(offer_boundary(pl.col("end_token"), pl.col("chunk"), bs)).alias("T"))
        .drop_nulls("T")
        .group_by("inst", "key", "T")
        .agg(pl.col("seq").min().alias("first_seq"))
    )


def chains(trace: Trace, header: Mapping[str, Any]) -> pl.DataFrame:
    """(inst, s, partial_b): per episode, the tails it probed that a request offered the
    same key for before it (the episode's intended tails, docs/diff.md "Partial tails")."""
    bs = partial_block(header)
    probes = (
        frames.lookups(trace)
        .filter(pl.col("chunk").is_null() & pl.col("end_token").is_not_null())
        .filter(is_partial(pl.col("end_token"), bs))
        .select("inst", "s", "key")
        .unique()
    )
    return frames.collect(
        probes.join(offers(trace, bs), on=["inst", "key"])
        .filter(pl.col("first_seq") < pl.col("s"))
        .group_by(KEY)
        .agg(pl.col("T").unique().alias("partial_b"))
    )


def with_chains(own: pl.DataFrame, trace: Trace, header: Mapping[str, Any]) -> pl.DataFrame:
    """The batch's chains (`keytrace.analysis.diff._chains`) with each episode's intended
    tails as ``partial_b`` (`chains`)."""
    return own.join(chains(trace, header), on=KEY, how="full", coalesce=True)


def with_expected(out: pl.LazyFrame, header: Mapping[str, Any]) -> pl.LazyFrame:
    """``out`` (`keytrace.analysis.diff._episodes`' episodes with L, F, top, E, E_free and
    their intended tails ``partial_b``: `with_chains`) with
    ``L_p``, ``E_p`` and E raised to it where it is larger (`expected_with_partial`); the
    same for ``E_free`` where the request capped its load (the partial cap without the load
    cap, under the complete-chunk ceiling without it)."""
    bs, tph = partial_block(header), _tph(header)
    S, P, H, max_new = pl.col("S"), pl.col("P"), pl.col("H"), pl.col("max_new")
    capped = load_cap(pl.col("max_load"), pl.col("skip"))
    free_top = as_expr(d.free_ceiling(pl.col("L"), pl.col("F"), pl.col("L_free")))

    L_p = partial_cap(P, H, tph, S, max_new, capped)
    L_p_free = partial_cap(P, H, tph, S, max_new, None)
    base = out.with_columns(
        as_expr(L_p).alias("L_p"), as_expr(L_p_free).alias("L_p_free"), free_top.alias("top_free")
    )
    T = pl.col("T")

    def best(top: str, cap: str, name: str) -> pl.LazyFrame:
        return (
            base.select(*KEY, "S", top, cap, "partial_b")
            .explode("partial_b")
            .rename({"partial_b": "T"})
            .filter(partial_in_reach(T, S, pl.col(top), pl.col(cap), bs) & is_partial(T, bs))
            .group_by(KEY)
            .agg(T.max().alias(name))
        )

    asked = pl.col("max_load").is_not_null() | pl.col("skip").fill_null(False)
    return (
        base.join(best("top", "L_p", "E_p"), on=KEY, how="left")
        .join(best("top_free", "L_p_free", "E_p_free"), on=KEY, how="left")
        .with_columns(
            as_expr(expected_with_partial(pl.col("E"), pl.col("E_p"))).cast(pl.Int64).alias("E"),
            pl.when(asked)
            .then(as_expr(expected_with_partial(pl.col("E_free"), pl.col("E_p_free"))))
            .otherwise(pl.col("E_free"))
            .cast(pl.Int64)
            .alias("E_free"),
        )
        .drop("L_p_free", "E_p_free", "top_free", "partial_b")
    )


def _partial_episodes(sf: pl.DataFrame, bs: int) -> pl.DataFrame:
    return sf.filter(is_partial(pl.col("E"), bs)).select(*KEY, "S", "E")


def _probes_at_E(view: Trace, eps: pl.DataFrame) -> dict[tuple[int, int], list[tuple[Any, ...]]]:
    """Per partial-E episode, its lookup calls at E (gid, key, result, seq), in call order:
    the probe of boundary E (one call per group, up to the first MISS)."""
    calls = frames.collect(
        frames.lookups(view)
        .join(eps.lazy().select(*KEY, "E"), on=KEY)
        .filter(pl.col("end_token") == pl.col("E"))
        .select(*KEY, "gid", "key", pl.col("result").cast(pl.String), "seq")
        .sort("seq")
    )
    out: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    for inst, s, gid, key, result, seq in calls.iter_rows():
        out.setdefault((inst, s), []).append((gid, key, result, seq))
    return out


def binding(
    view: Trace, sf: pl.DataFrame, bind: pl.DataFrame, header: Mapping[str, Any]
) -> pl.DataFrame:
    """``bind`` (`keytrace.analysis.scans.binding`) with, for a shortfall below a partial E
    the lookup probed, the probe at E binding: its group and terminal call
    (`keytrace.judge.partial.probe_terminal`; the key's chunk is written as the one of
    ``h`` tokens ending at E, as `needed` lists it)."""
    bs, tph = partial_block(header), _tph(header)
    eps = _partial_episodes(sf, bs)
    if eps.height == 0:
        return bind
    probes = _probes_at_E(view, eps)
    rows = []
    for inst, s, _S, E in eps.iter_rows():
        calls = probes.get((inst, s), [])
        i = probe_terminal([c[2] for c in calls])
        if i is None:
            continue
        gid, key, result, seq = calls[i]
        rows.append((inst, s, gid, seq, E // tph - 1, key, result))
    if not rows:
        return bind
    over = pl.DataFrame(
        rows,
        schema={
            "inst": pl.Int64,
            "s": pl.Int64,
            "bind_gid": bind.schema["bind_gid"],
            "term_seq": bind.schema["term_seq"],
            "term_chunk": bind.schema["term_chunk"],
            "term_key": bind.schema["term_key"],
            "term_result": pl.String,
        },
        orient="row",
    ).with_columns(pl.col("term_result").cast(bind.schema["term_result"]))
    return pl.concat([bind.join(over, on=KEY, how="anti"), over.select(bind.columns)])


def complete_needed(
    needed: pl.DataFrame, sf: pl.DataFrame, groups: list[Group], header: Mapping[str, Any]
) -> pl.DataFrame:
    """`keytrace.analysis.diff._needed`'s rows with, for a partial E, the recurrent groups'
    complete chunks as a partial hit needs them (`keytrace.judge.partial.partial_needed`):
    none on vLLM 0.34.0, the state at E's block start on 0.33.0 when it is above S (the
    full-attention chunks ``[S, Tb)`` are `needed_range`'s already)."""
    bs = partial_block(header)
    eps = _partial_episodes(sf, bs)
    recurrent = [g for g in groups if g.recurrent]
    if eps.height == 0 or not recurrent:
        return needed
    gids = [g.gid for g in recurrent]
    keep = needed.join(eps.select(KEY), on=KEY, how="anti").vstack(
        needed.join(eps.select(KEY), on=KEY, how="semi").filter(~pl.col("gid").is_in(gids))
    )
    if partial_anchor_of(header) != PARTIAL_ANCHOR_COMPLETE:
        return keep
    Tb = pl.col("E") // bs * bs
    aligned = (
        eps.filter(Tb > pl.col("S"))
        .join(pl.DataFrame({"gid": gids}, schema={"gid": pl.Int32}), how="cross")
        .select(*KEY, "gid", (Tb // bs - 1).alias("chunk"), pl.lit(bs).alias("tpc"))
    )
    return keep.vstack(aligned.select(keep.columns).cast(keep.schema))


def with_keys(
    view: Trace,
    needed: pl.DataFrame,
    sf: pl.DataFrame,
    groups: list[Group],
    header: Mapping[str, Any],
) -> pl.DataFrame:
    """``needed`` (with the episode's lookups of its chunks joined) and, for a partial E,
    every group's key at E as one more row (``tpc = h``, the chunk of ``h`` tokens ending
    at E): the key the probe at E asked (its result and call), or, for a group the probe
    never reached, the key derived from the block hash the probe's keys share."""
    bs, tph = partial_block(header), _tph(header)
    eps = _partial_episodes(sf, bs)
    if eps.height == 0:
        return needed
    probes = _probes_at_E(view, eps)
    binds = dict(((i, s), g) for i, s, g in needed.select(*KEY, "bind_gid").unique(KEY).iter_rows())
    rows = []
    for inst, s, _S, E in eps.iter_rows():
        calls = probes.get((inst, s), [])
        asked = {c[0]: c for c in calls}
        base = key_hash(bytes(calls[0][1])) if calls else None
        for g in groups:
            if g.gid in asked:
                _gid, key, result, seq = asked[g.gid]
            else:
                key = bytes(base) + gid_tail(g.gid) if base is not None else None
                result = seq = None
            rows.append((inst, s, g.gid, E // tph - 1, tph, key, result, seq, binds.get((inst, s))))
    extra = pl.DataFrame(
        rows,
        schema={
            "inst": pl.Int64,
            "s": pl.Int64,
            "gid": pl.Int32,
            "chunk": pl.Int64,
            "tpc": pl.Int64,
            "key": pl.Binary,
            "result": pl.String,
            "seq": pl.Int64,
            "bind_gid": pl.Int32,
        },
        orient="row",
    ).with_columns((pl.col("gid") == pl.col("bind_gid")).fill_null(False).alias("binding"))
    extra = extra.with_columns(
        *(pl.col(c).cast(needed.schema[c]) for c in extra.columns if c in needed.schema)
    )
    for c, dtype in needed.schema.items():
        if c not in extra.columns:
            extra = extra.with_columns(pl.lit(None, dtype).alias(c))
    return pl.concat([needed, extra.select(needed.columns)])
