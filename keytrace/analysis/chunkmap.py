"""The chunk map of a reported episode: per group, what the store wrote and what lookup
needed and got, chunk by chunk, on a token window around E (data for `keytrace diff --html`).

For each group the window holds every chunk that overlaps ``[lo, hi)``; ``lo`` is a little
left of the leftmost chunk a sliding-window group needed (a full-attention group needs
every chunk from S, which would drown the picture), ``hi`` a little right of max(E, L),
clipped to the prompt. Each chunk carries:

- ``stored``: its state on the episode's engine just before the episode, from the store
  rows of the requests on the episode's chain and of the request itself: ``resident``
  (completed, not evicted since), ``evicted``, ``in_flight`` (prepared, not completed),
  ``rejected`` / ``failed`` (offered, not written), or null (never offered by them);
- ``lookup``: the last result the episode's own lookups got for it, or null;
- ``needed`` / ``cause``: from the verdict (`keytrace.analysis.diff`), one source of truth;
- ``terminal``: the binding group's terminal key.

Analysis returns data; `keytrace.report.html` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import polars as pl

from keytrace.analysis import frames
from keytrace.analysis.results import DiffReport, EpisodeVerdict, hex_key
from keytrace.analysis.rules import Group, groups_from_header
from keytrace.format.reader import Trace

Cell = tuple[Any, Any]
"""(state or result, key bytes) of one chunk, before it becomes a `MapChunk`."""

DEFAULT_LIMIT = 200
"""Episodes drawn at most (the first mismatch always among them): a fleet trace has
thousands of shortfalls, and a page with all of them would be too heavy to open."""


@dataclass(frozen=True)
class MapChunk:
    chunk: int
    token_start: int
    token_end: int
    key: str | None
    stored: str | None
    lookup: str | None
    needed: bool
    cause: str | None
    terminal: bool


@dataclass(frozen=True)
class MapLane:
    group_id: int
    label: str
    kind: str
    tokens_per_chunk: int
    sliding_window: int | None
    eagle: bool
    chunks: list[MapChunk] = field(default_factory=list)


@dataclass(frozen=True)
class EpisodeMap:
    episode: EpisodeVerdict
    token_lo: int
    token_hi: int
    lanes: list[MapLane]


def chunk_maps(trace: Trace, report: DiffReport, *, limit: int = DEFAULT_LIMIT) -> list[EpisodeMap]:
    """Maps of the report's shortfall episodes (mismatches first, then explained; each in
    sequence order), at most ``limit``."""
    groups = groups_from_header(report.header)
    shown = _pick(report, limit)
    if not shown or not groups:
        return []
    windows = {(v.instance_id, v.episode): _window(v, groups) for v in shown}
    win = pl.DataFrame(
        [
            (v.instance_id, v.episode, g.gid, lo // g.tpc, -(-hi // g.tpc))
            for v in shown
            for g in groups
            for lo, hi in [windows[(v.instance_id, v.episode)]]
        ],
        schema={"inst": pl.Int64, "s": pl.Int64, "gid": pl.Int32, "lo": pl.Int64, "hi": pl.Int64},
        orient="row",
    )
    looked = _looked_up(trace, win)
    stored = _stored(trace, win, shown)
    out = []
    for v in shown:
        lo, hi = windows[(v.instance_id, v.episode)]
        lanes = [
            _lane(
                v,
                g,
                lo,
                hi,
                looked.get((v.instance_id, v.episode, g.gid), {}),
                stored.get((v.instance_id, v.episode, g.gid), {}),
            )
            for g in groups
        ]
        out.append(EpisodeMap(episode=v, token_lo=lo, token_hi=hi, lanes=lanes))
    return out


def _pick(report: DiffReport, limit: int) -> list[EpisodeVerdict]:
    short = [v for v in report.episodes if v.verdict in ("mismatch", "explained") and v.E]
    short.sort(key=lambda v: (v.verdict != "mismatch", v.episode))
    return short[: max(limit, 0)]


def _window(v: EpisodeVerdict, groups: list[Group]) -> tuple[int, int]:
    """[lo, hi) in tokens, on chunk boundaries of every group (see the module docstring)."""
    E = v.E or v.L
    big = max(g.tpc for g in groups)
    windowed = {g.gid for g in groups if not g.full_attention}
    starts = [n.token_start for n in v.needed if n.group_id in windowed]
    left = min(starts) if starts else E - 4 * big
    lo = max(0, min(left, E) - 2 * big)
    hi = min(max(E, v.L) + 2 * big, -(-v.num_prompt_tokens // big) * big)
    lo -= lo % big
    hi = max(hi, E + big)
    return lo, hi


def _looked_up(trace: Trace, win: pl.DataFrame) -> dict[tuple[int, int, int], dict[int, Cell]]:
    rows = (
        frames.lookups_in(trace, win.lazy())
        .group_by("inst", "s", "gid", "chunk")
        .agg(pl.col("result", "key").sort_by("seq").last())
        .pipe(frames.collect)
    )
    out: dict[tuple[int, int, int], dict[int, Cell]] = {}
    for inst, s, gid, chunk, result, key in rows.iter_rows():
        out.setdefault((inst, s, gid), {})[chunk] = (result, key)
    return out


def _stored(
    trace: Trace, win: pl.DataFrame, shown: list[EpisodeVerdict]
) -> dict[tuple[int, int, int], dict[int, Cell]]:
    """Per (episode, group, chunk): (state, key) from the chain's store rows before it."""
    chain = pl.DataFrame(
        [(v.instance_id, v.episode, r) for v in shown for r in {*v.chain, v.req_id}],
        schema={"inst": pl.Int64, "s": pl.Int64, "req_id": pl.String},
        orient="row",
    )
    st = frames.stores(trace)
    rows = (
        st.join(chain.lazy(), on=["inst", "req_id"])
        .filter(pl.col("seq") < pl.col("s"))
        .join(win.lazy(), on=["inst", "s", "gid"])
        .filter((pl.col("chunk") >= pl.col("lo")) & (pl.col("chunk") < pl.col("hi")))
        .group_by("inst", "s", "gid", "chunk")
        .agg(
            pl.col("key").first(),
            pl.col("seq").filter(pl.col("event") == "completed").max().alias("done"),
            pl.col("event").sort_by("seq").last().alias("last"),
        )
        .pipe(frames.collect)
    )
    if rows.height == 0:
        return {}
    # removed after it was written, before the episode: an eviction of the key, or a reset
    gone = (
        st.filter(pl.col("event").is_in(["evicted", "reset"]))
        .select("inst", pl.col("seq").alias("gone_seq"), pl.col("key").alias("gone_key"))
        .join(rows.lazy().filter(pl.col("done").is_not_null()), on="inst")
        .filter(
            (pl.col("gone_key").is_null() | (pl.col("gone_key") == pl.col("key")))
            & (pl.col("gone_seq") > pl.col("done"))
            & (pl.col("gone_seq") < pl.col("s"))
        )
        .select("inst", "s", "gid", "chunk")
        .unique()
        .with_columns(pl.lit(True).alias("gone"))
        .pipe(frames.collect)
    )
    rows = rows.join(gone, on=["inst", "s", "gid", "chunk"], how="left")
    out: dict[tuple[int, int, int], dict[int, Cell]] = {}
    for r in rows.iter_rows(named=True):
        if r["done"] is not None:
            state = "evicted" if r["gone"] else "resident"
        elif r["last"] == "prepared":
            state = "in_flight"
        else:
            state = r["last"]  # rejected or failed
        out.setdefault((r["inst"], r["s"], r["gid"]), {})[r["chunk"]] = (state, r["key"])
    return out


def _lane(
    v: EpisodeVerdict,
    g: Group,
    lo: int,
    hi: int,
    looked: dict[int, Cell],
    stored: dict[int, Cell],
) -> MapLane:
    needed = {n.chunk: n for n in v.needed if n.group_id == g.gid}
    t = v.terminal
    chunks = []
    for c in range(lo // g.tpc, -(-hi // g.tpc)):
        n = needed.get(c)
        result, lkey = looked.get(c, (None, None))
        state, skey = stored.get(c, (None, None))
        key = (n.key if n else None) or hex_key(lkey) or hex_key(skey)
        chunks.append(
            MapChunk(
                chunk=c,
                token_start=c * g.tpc,
                token_end=(c + 1) * g.tpc,
                key=key,
                stored=state,
                lookup=result,
                needed=n is not None,
                cause=n.cause if n else None,
                terminal=t is not None and t.group_id == g.gid and t.chunk == c,
            )
        )
    return MapLane(
        group_id=g.gid,
        label=g.label,
        kind=g.kind,
        tokens_per_chunk=g.tpc,
        sliding_window=g.sliding_window,
        eagle=g.eagle,
        chunks=chunks,
    )
