"""Per-group / per-kind counts of a trace (pure: returns data, never prints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import polars as pl

from keytrace.analysis import frames
from keytrace.format.reader import Trace
from keytrace.judge.rules import group_label


@dataclass(frozen=True)
class GroupCounts:
    group_id: int
    label: str
    tokens_per_chunk: int | None
    stored: int  # completed store rows
    prepared: int
    rejected: int
    evicted: int
    looked_up: int
    hits: int
    misses: int
    pending: int
    retries: int


@dataclass(frozen=True)
class EpisodeLine:
    req_id: str
    local_tokens: int
    external_tokens: int | None
    accepted_tokens: int | None
    num_prompt_tokens: int


@dataclass(frozen=True)
class Summary:
    header: dict[str, Any]
    rows: dict[str, int]
    parts: int
    instances: int
    groups: list[GroupCounts]
    episodes: list[EpisodeLine] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def summarize(trace: Trace, *, max_episodes: int = 20) -> Summary:
    """Counts per group of store events and lookup results, and the first episodes."""
    st = (
        trace.frame("store")
        .filter(pl.col("group_id").is_not_null())
        .group_by("group_id", "event")
        .agg(pl.len().alias("n"))
        .pipe(frames.collect)
    )
    lk = (
        frames.lookups(trace)
        .group_by(pl.col("gid").alias("group_id"), "result")
        .agg(pl.len().alias("n"))
        .pipe(frames.collect)
    )

    def count(df: pl.DataFrame, gid: int, col: str, val: str) -> int:
        sel = df.filter((pl.col("group_id") == gid) & (pl.col(col).cast(pl.String) == val))
        return int(sel["n"].sum()) if sel.height else 0

    groups = []
    for g in trace.header.get("groups", []):
        gid = g["group_id"]
        groups.append(
            GroupCounts(
                group_id=gid,
                label=group_label(g["kind"], bool(g.get("is_eagle"))),
                tokens_per_chunk=g.get("tokens_per_chunk"),
                stored=count(st, gid, "event", "completed"),
                prepared=count(st, gid, "event", "prepared"),
                rejected=count(st, gid, "event", "rejected"),
                evicted=count(st, gid, "event", "evicted"),
                looked_up=sum(
                    count(lk, gid, "result", r) for r in ("HIT", "MISS", "HIT_PENDING", "RETRY")
                ),
                hits=count(lk, gid, "result", "HIT"),
                misses=count(lk, gid, "result", "MISS"),
                pending=count(lk, gid, "result", "HIT_PENDING"),
                retries=count(lk, gid, "result", "RETRY"),
            )
        )
    ep = frames.episodes(trace).sort("s").head(max_episodes).pipe(frames.collect)
    episodes = [
        EpisodeLine(
            req_id=str(r["req_id"]),
            local_tokens=r["S"],
            external_tokens=r["X"],
            accepted_tokens=r["A"],
            num_prompt_tokens=r["P"],
        )
        for r in ep.iter_rows(named=True)
    ]
    return Summary(
        header=trace.header,
        rows=_counts(trace),
        parts=len(trace.parts),
        instances=len({p.source.get("instance") for p in trace.parts}),
        groups=groups,
        episodes=episodes,
        warnings=list(trace.warnings),
    )


def _counts(trace: Trace) -> dict[str, int]:
    """What the trace holds, in logical rows: store events, key lookups, episodes, loads
    and step rows (the same for every schema version)."""
    return {
        "store": trace.rows("store"),
        "lookup": int(
            frames.scans(trace).select(pl.col("n").sum()).pipe(frames.collect).item() or 0
        ),
        "episode": frames.episodes(trace).select(pl.len()).pipe(frames.collect).item(),
        "load": trace.rows("load"),
        "step": trace.rows("step"),
    }
