"""The three views of a trace the differ reads, with uniform names (lazy, never collected here).

- `episodes`: one row per lookup episode (a ``get_num_new_matched_tokens`` call);
- `lookups`: one row per ``manager.lookup`` call;
- `stores`: one row per key per store event.

Column names are short and fixed: ``inst`` (the recorder's int64 instance id: joins never
hash strings), ``s`` (an episode's sequence number), ``t`` (its wall clock, ns), ``S``
(local tokens), ``X`` (external tokens; null = deferred), ``A`` (accepted), ``P`` (prompt
tokens), ``N`` (num_tokens), ``H`` (block hashes), ``max_new``, ``spb`` (the request's
``shared_prefix_boundary``; null when the trace does not carry it).

Sequence numbers order the rows of one process; across processes (two engines) only the
wall clock ``t``/``ts`` orders events, which is what "offered on another engine before that
moment" uses.
"""

from __future__ import annotations

import polars as pl

from keytrace.format.reader import Trace


def _str(col: str) -> pl.Expr:
    return pl.col(col).cast(pl.String)


def episodes(trace: Trace) -> pl.LazyFrame:
    ep = trace.frame("episode")
    spb = (
        pl.col("shared_prefix_boundary")
        if "shared_prefix_boundary" in ep.collect_schema().names()
        else pl.lit(None, dtype=pl.Int64)
    )
    return ep.select(
        pl.col("instance_id").alias("inst"),
        _str("instance").alias("instance"),
        _str("engine_id").alias("engine_id"),
        "dp_rank",
        _str("req_id").alias("req_id"),
        pl.col("episode").alias("s"),
        pl.col("ts_ns").alias("t"),
        "step",
        pl.col("local_tokens").alias("S"),
        pl.col("external_tokens").alias("X"),
        pl.col("accepted_tokens").alias("A"),
        pl.col("num_prompt_tokens").alias("P"),
        pl.col("num_tokens").alias("N"),
        pl.col("num_hashes").alias("H"),
        pl.col("max_new_tokens").alias("max_new"),
        spb.cast(pl.Int64).alias("spb"),
    )


def lookups(trace: Trace) -> pl.LazyFrame:
    return trace.frame("lookup").select(
        pl.col("instance_id").alias("inst"),
        pl.col("episode").alias("s"),
        _str("req_id").alias("req_id"),
        "scan",
        "seq",
        pl.col("group_id").alias("gid"),
        pl.col("chunk_idx").alias("chunk"),
        "end_token",
        "key",
        _str("result").alias("result"),
    )


def stores(trace: Trace) -> pl.LazyFrame:
    return trace.frame("store").select(
        pl.col("instance_id").alias("inst"),
        "seq",
        pl.col("ts_ns").alias("ts"),
        _str("event").alias("event"),
        _str("req_id").alias("req_id"),
        pl.col("group_id").alias("gid"),
        pl.col("chunk_idx").alias("chunk"),
        "end_token",
        "key",
    )
