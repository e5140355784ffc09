"""What each lookup scan and each episode's scans say, as a few columns per scan.

A *scan* is one call of vLLM's per-group lookup helper (``_maximal_prefix_lookup`` for a
full-attention group, left to right, stopping at the first MISS; ``_sliding_window_lookup``
for a windowed group, right to left). Per scan, in call order:

- ``lead_hits``: HITs before the first non-HIT (a full-attention scan's resident prefix,
  by the manager's own word);
- the *terminal* row: the first MISS or RETRY, else the first non-HIT (``term_*``);
- the last HIT in call order (``last_hit_*``: a window scan's leftmost hit);
- the chunk range scanned (``min_chunk``, ``max_chunk``) and the counts per result.

These are the per-scan summary rows the recorder writes (for a v1 trace
`keytrace.format.shape.scan_summaries` derives them from the raw lookup rows).
"""

from __future__ import annotations

import polars as pl

from keytrace.analysis import definitions
from keytrace.analysis.rules import Group

SCAN_COLUMNS = (
    "inst",
    "s",
    "scan",
    "gid",
    "n",
    "n_hit",
    "n_pending",
    "n_retry",
    "n_miss",
    "lead_hits",
    "term_seq",
    "term_chunk",
    "term_key",
    "term_result",
    "last_hit_seq",
    "last_hit_chunk",
    "min_chunk",
    "max_chunk",
)


def resident_prefix(
    scans: pl.LazyFrame, episodes: pl.LazyFrame, groups: list[Group]
) -> pl.LazyFrame:
    """F per episode (`keytrace.analysis.definitions.resident_prefix`), from the leading
    HITs of each full-attention group's first scan in the episode: one column per group,
    null where the episode never scanned it; F is null with no full-attention group."""
    fa = [g for g in groups if g.full_attention]
    if not fa:
        return episodes.select("inst", "s", pl.lit(None, dtype=pl.Int64).alias("F"))
    first = (
        scans.filter(pl.col("gid").is_in([g.gid for g in fa]))
        .group_by("inst", "s", "gid")
        .agg(pl.col("lead_hits").sort_by("scan").first())
    )
    out = episodes.select("inst", "s", "S")
    for g in fa:
        lead = first.filter(pl.col("gid") == g.gid).select(
            "inst", "s", pl.col("lead_hits").alias(f"lead{g.gid}")
        )
        out = out.join(lead, on=["inst", "s"], how="left")
    F = definitions.resident_prefix(pl.col("S"), groups, lambda gid: pl.col(f"lead{gid}"))
    return out.select("inst", "s", F.cast(pl.Int64).alias("F"))


def binding(scans: pl.LazyFrame) -> pl.LazyFrame:
    """Per episode: the binding scan and its terminal row.

    The binding scan is the last scan (in call order) that saw a non-HIT result; its
    terminal row is the first MISS or RETRY, else its first non-HIT. An episode whose
    every lookup was a HIT binds on the group of its last scan, with no terminal key.
    """
    last_bad = (
        scans.filter(definitions.binds(pl.col("n_hit"), pl.col("n")))
        .sort("scan")
        .group_by("inst", "s")
        .agg(
            pl.col("gid").last().alias("bind_gid"),
            pl.col("term_seq", "term_chunk", "term_key", "term_result").last(),
        )
    )
    last_any = scans.sort("scan").group_by("inst", "s").agg(pl.col("gid").last().alias("last_gid"))
    return (
        last_any.join(last_bad, on=["inst", "s"], how="left")
        .with_columns(pl.coalesce("bind_gid", "last_gid").alias("bind_gid"))
        .drop("last_gid")
    )
