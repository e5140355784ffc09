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
from keytrace.format.schema import SCAN_EPISODE, SCAN_UNQUERIED


def _str(col: str) -> pl.Expr:
    return pl.col(col).cast(pl.String)


_EPISODE_COLUMNS = {
    "local_tokens": "S",
    "external_tokens": "X",
    "accepted_tokens": "A",
    "num_prompt_tokens": "P",
    "num_tokens": "N",
    "num_hashes": "H",
    "max_new_tokens": "max_new",
}


def episodes(trace: Trace) -> pl.LazyFrame:
    """One row per lookup episode (v1: the ``episode`` kind; v2: lookup rows with scan -1)."""
    if trace.version == 1:
        ep = trace.frame("episode").with_columns(pl.lit(None, dtype=pl.Int64).alias("spb"))
    else:
        ep = (
            trace.frame("lookup")
            .filter(pl.col("scan") == SCAN_EPISODE)
            .rename({"shared_prefix_boundary": "spb"})
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
        *(pl.col(c).alias(a) for c, a in _EPISODE_COLUMNS.items()),
        pl.col("spb").cast(pl.Int64),
    )


def scans(trace: Trace) -> pl.LazyFrame:
    """One summary row per scan (see `keytrace.analysis.scans`): v2 records them; for v1
    they are derived from the raw lookup rows."""
    if trace.version == 1:
        from keytrace.analysis.scans import scan_summaries

        return scan_summaries(lookups(trace))
    return (
        trace.frame("lookup")
        .filter(pl.col("scan") >= 0)
        .select(
            pl.col("instance_id").alias("inst"),
            pl.col("episode").alias("s"),
            _str("req_id").alias("req_id"),
            "scan",
            pl.col("group_id").alias("gid"),
            pl.col("n_keys").alias("n"),
            "n_hit",
            "n_pending",
            "n_retry",
            "n_miss",
            "lead_hits",
            "term_seq",
            "term_chunk",
            "term_end_token",
            "term_key",
            _str("term_result").alias("term_result"),
        )
    )


_RAW = ("seqs", "end_tokens", "chunks", "keys", "results")
_FLAT = {
    "seqs": "seq",
    "end_tokens": "end_token",
    "chunks": "chunk",
    "keys": "key",
    "results": "result",
}


def lookups(trace: Trace, *, gid: int | None = None, heads_only: bool = False) -> pl.LazyFrame:
    """One row per ``manager.lookup`` call: inst, s, req_id, scan, seq, gid, chunk,
    end_token, key, result. ``gid`` keeps one group (v2 skips other groups' row groups
    before anything is exploded); ``heads_only`` reads only where each scan started."""
    if trace.version == 1:
        lk = trace.frame("lookup")
        if gid is not None:
            lk = lk.filter(pl.col("group_id") == gid)
        return lk.select(
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
    rows = trace.frame("lookup").filter(pl.col("scan") >= 0)
    if gid is not None:
        rows = rows.filter(pl.col("group_id") == gid)
    parts = ["head"] if heads_only else ["head", "tail"]
    return pl.concat([_explode(rows, prefix) for prefix in parts])


def unqueried(trace: Trace) -> pl.LazyFrame:
    """Keys an episode needed in groups vLLM never scanned (v2; none in v1): inst, s,
    req_id, gid, chunk, end_token, key."""
    if trace.version == 1:
        return pl.LazyFrame(
            schema={
                "inst": pl.Int64,
                "s": pl.Int64,
                "req_id": pl.String,
                "gid": pl.Int32,
                "chunk": pl.Int64,
                "end_token": pl.Int64,
                "key": pl.Binary,
            }
        )
    rows = trace.frame("lookup").filter(pl.col("scan") == SCAN_UNQUERIED)
    return _explode(rows, "head").select("inst", "s", "req_id", "gid", "chunk", "end_token", "key")


def _explode(rows: pl.LazyFrame, prefix: str) -> pl.LazyFrame:
    cols = [f"{prefix}_{c}" for c in _RAW]
    return (
        rows.select(
            pl.col("instance_id").alias("inst"),
            pl.col("episode").alias("s"),
            _str("req_id").alias("req_id"),
            "scan",
            pl.col("group_id").alias("gid"),
            *cols,
        )
        .filter(pl.col(cols[0]).is_not_null())
        .explode(cols)
        .rename({f"{prefix}_{c}": _FLAT[c] for c in _RAW})
        .select("inst", "s", "req_id", "scan", "seq", "gid", "chunk", "end_token", "key", "result")
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
