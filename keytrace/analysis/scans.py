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

from keytrace.judge import definitions
from keytrace.judge.ops import as_expr
from keytrace.judge.rules import Group

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
    scans: pl.LazyFrame,
    episodes: pl.LazyFrame,
    groups: list[Group],
    leads: pl.LazyFrame | None = None,
) -> pl.LazyFrame:
    """F per episode (`keytrace.judge.definitions.resident_prefix`), from the leading
    HITs of each full-attention group's first scan in the episode: one column per group,
    null where the episode never scanned it; F is null with no full-attention group.
    ``leads`` (inst, s, gid, lead_hits), for a tiered trace: the leading keys resident in
    any tier (`tiered_leads`), instead of the scans' own HIT counts."""
    fa = [g for g in groups if g.full_attention]
    if not fa:
        return episodes.select("inst", "s", pl.lit(None, dtype=pl.Int64).alias("F"))
    first = (
        leads
        if leads is not None
        else (
            scans.filter(pl.col("gid").is_in([g.gid for g in fa]))
            .group_by("inst", "s", "gid")
            .agg(pl.col("lead_hits").sort_by("scan").first())
        )
    )
    out = episodes.select("inst", "s", "S")
    for g in fa:
        lead = first.filter(pl.col("gid") == g.gid).select(
            "inst", "s", pl.col("lead_hits").alias(f"lead{g.gid}")
        )
        out = out.join(lead, on=["inst", "s"], how="left")
    F = definitions.resident_prefix(pl.col("S"), groups, lambda gid: pl.col(f"lead{gid}"))
    return out.select("inst", "s", as_expr(F).cast(pl.Int64).alias("F"))


def tiered_cells(calls: pl.DataFrame, listed: pl.DataFrame) -> pl.DataFrame:
    """(inst, s, gid, chunk, key, result): a full-attention group's chunks in an episode on
    a tiered manager, as its first scan looked them up (``calls``: inst, s, scan, gid,
    chunk, key, result) and, past where it stopped, as the recorder listed them
    (``listed``: inst, s, gid, chunk, key; no result)."""
    first = calls.join(
        calls.group_by("inst", "s", "gid").agg(pl.col("scan").min()),
        on=["inst", "s", "gid", "scan"],
    ).select("inst", "s", "gid", "chunk", "key", "result")
    rest = listed.select(
        "inst", "s", "gid", "chunk", "key", pl.lit(None, dtype=pl.String).alias("result")
    ).join(first, on=["inst", "s", "gid", "chunk"], how="anti")
    return pl.concat([first, rest]).drop_nulls("chunk")


def tiered_leads(cells: pl.DataFrame, durable: pl.DataFrame, starts: pl.DataFrame) -> pl.DataFrame:
    """(inst, s, gid, lead_hits): how many chunks from S on (``starts``: inst, s, gid,
    first, the chunk S falls in) were resident in some tier, in a row: HIT in the primary,
    or held by a secondary tier (``durable``: inst, s, key, durable, as
    `keytrace.analysis.history.durable` says). ``cells``: `tiered_cells`."""
    ok = definitions.lead_ok(pl.col("result"), pl.col("durable").fill_null(False))
    in_row = pl.col("chunk") == pl.col("first") + pl.int_range(pl.len()).over("inst", "s", "gid")
    return (
        cells.join(durable, on=["inst", "s", "key"], how="left")
        .join(starts, on=["inst", "s", "gid"])
        .filter(pl.col("chunk") >= pl.col("first"))
        .sort("inst", "s", "gid", "chunk")
        .with_columns((ok & in_row).alias("ok"))
        .group_by("inst", "s", "gid")
        .agg(pl.col("ok").cast(pl.Int32).cum_prod().sum().cast(pl.Int32).alias("lead_hits"))
    )


def binding(scans: pl.LazyFrame) -> pl.LazyFrame:
    """Per episode: the binding scan (`keytrace.judge.definitions.binding_rank`: the last
    scan in call order that saw a non-HIT result, else the last scan) and its terminal row
    (the first MISS or RETRY, else its first non-HIT; null for a scan that only hit)."""
    rank = definitions.binding_rank(pl.col("n_hit"), pl.col("n"), pl.col("scan"))
    bound = definitions.binds(pl.col("n_hit"), pl.col("n"))
    return scans.group_by("inst", "s").agg(
        pl.col("gid").sort_by(rank).last().alias("bind_gid"),
        *(
            pl.when(bound).then(pl.col(c)).otherwise(None).sort_by(rank).last()
            for c in ("term_seq", "term_chunk", "term_key", "term_result")
        ),
    )
