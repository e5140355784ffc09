"""Every readable schema version in the current one's shape: what the analysis layer reads.

`Trace.frame` gives a kind's rows as they are stored; `lookup_rows` gives the lookup side
as schema v2 lays it out, whatever version wrote it, so nothing above this layer asks which
version a trace is:

- v2 (current): the ``lookup`` kind as stored: one row per scan (a summary and the raw
  calls as ``head_*``/``tail_*`` lists), one per episode (``scan == -1``), and the keys the
  recorder listed (``scan < -1``);
- v1: one ``lookup`` row per ``manager.lookup`` call and a separate ``episode`` kind. Each
  scan's calls become one v2 scan row (every call in the head lists; the summary computed
  by `scan_summaries`, as the v2 recorder computes it), and each episode row a v2 episode
  row. v1 recorded neither listed keys nor the GPU prefix cache's
  ``shared_prefix_boundary``: those are absent, as they were.

The store, load and step kinds have one shape in every version; the ``tier`` kind exists
from v3 on (`tier_rows`: empty for older traces).
"""

from __future__ import annotations

import polars as pl

from keytrace.format.reader import Trace
from keytrace.format.schema import SCAN_ENDING, SCAN_EPISODE, SCHEMA_VERSION, SCHEMAS_BY_VERSION

__all__ = ["has_episodes", "lookup_rows", "scan_summaries", "tier_rows"]


def _schema(kind: str) -> dict[str, pl.DataType]:
    empty = pl.from_arrow(SCHEMAS_BY_VERSION[SCHEMA_VERSION][kind].empty_table())
    assert isinstance(empty, pl.DataFrame)
    return dict(empty.schema)


def lookup_rows(trace: Trace) -> pl.LazyFrame:
    """The lookup side of ``trace`` in the current schema's shape (see the module
    docstring)."""
    if trace.version >= 2:  # v2 and v3 lay the lookup kind out alike
        return trace.frame("lookup")
    schema = _schema("lookup")
    scans = _v1_scans(trace.frame("lookup"))
    episodes = trace.frame("episode").with_columns(pl.lit(SCAN_EPISODE).alias("scan"))
    return pl.concat(
        [
            frame.select(
                (
                    pl.col(name).cast(dtype)
                    if name in frame.collect_schema().names()
                    else pl.lit(None, dtype=dtype).alias(name)
                )
                for name, dtype in schema.items()
            )
            for frame in (scans, episodes)
        ]
    )


def has_episodes(trace: Trace) -> bool:
    """Whether ``trace`` holds its episodes (v1 keeps them in parts of their own, which a
    user may leave out; v2 in the lookup parts)."""
    return bool(trace.parts_of("lookup" if trace.version >= 2 else "episode"))


def tier_rows(trace: Trace) -> pl.LazyFrame:
    """The ``tier`` kind (schema v3); none for older traces, which recorded no tier."""
    if "tier" in SCHEMAS_BY_VERSION[trace.version]:
        return trace.frame("tier")
    return pl.LazyFrame(schema=_schema("tier"))


def scan_summaries(calls: pl.LazyFrame) -> pl.LazyFrame:
    """One row per (instance, episode, scan) from one row per lookup call (columns
    ``instance_id``, ``episode``, ``scan``, ``seq``, ``group_id``, ``chunk_idx``,
    ``end_token``, ``key``, ``result``): the summary the v2 recorder writes. In call order,
    ``lead_hits`` counts the HITs before the first non-HIT; the *terminal* call is the first
    of `SCAN_ENDING`, else the first non-HIT (``term_*``, ``term_pos`` its index);
    ``last_hit_*`` is the last HIT; ``min_chunk``/``max_chunk`` the range scanned."""
    res = pl.col("result").cast(pl.String)
    ends = res.is_in(SCAN_ENDING)
    nonhit = res != "HIT"
    term = pl.when(ends.any()).then(ends).otherwise(nonhit)
    hit = res == "HIT"
    return (
        calls.sort("seq")
        .group_by("instance_id", "episode", "scan", maintain_order=True)
        .agg(
            pl.col("group_id").first(),
            pl.len().alias("n_keys"),
            hit.sum().alias("n_hit"),
            (res == "HIT_PENDING").sum().alias("n_pending"),
            (res == "RETRY").sum().alias("n_retry"),
            (res == "MISS").sum().alias("n_miss"),
            hit.cast(pl.Int32).cum_prod().sum().alias("lead_hits"),
            term.arg_true().first().alias("term_pos"),
            pl.col("seq").filter(term).first().alias("term_seq"),
            pl.col("end_token").filter(term).first().alias("term_end_token"),
            pl.col("chunk_idx").filter(term).first().alias("term_chunk"),
            pl.col("key").filter(term).first().alias("term_key"),
            res.filter(term).first().alias("term_result"),
            pl.col("seq").filter(hit).last().alias("last_hit_seq"),
            pl.col("end_token").filter(hit).last().alias("last_hit_end_token"),
            pl.col("chunk_idx").filter(hit).last().alias("last_hit_chunk"),
            pl.col("chunk_idx").min().alias("min_chunk"),
            pl.col("chunk_idx").max().alias("max_chunk"),
        )
    )


_FIRST = ("seq", "ts_ns", "instance", "engine_id", "dp_rank", "pid", "step", "req_id", "secondary")
"""Per-call columns a v1 scan row takes from its first call."""


def _v1_scans(calls: pl.LazyFrame) -> pl.LazyFrame:
    """v1's per-call lookup rows as v2 scan rows: the summary, and every call in the head."""
    ordered = calls.sort("seq")
    raw = ordered.group_by("instance_id", "episode", "scan", maintain_order=True).agg(
        *(pl.col(c).first() for c in _FIRST),
        pl.col("seq").alias("head_seqs"),
        pl.col("end_token").alias("head_end_tokens"),
        pl.col("chunk_idx").alias("head_chunks"),
        pl.col("key").alias("head_keys"),
        pl.col("result").cast(pl.String).alias("head_results"),
    )
    return raw.join(
        scan_summaries(calls), on=["instance_id", "episode", "scan"], maintain_order="left"
    )
