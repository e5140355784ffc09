"""The chunk maps the differ returns with its report (``diff(..., maps=N)``): per reported
shortfall and per group, what the store kept, what lookup needed and got, chunk by chunk, on
a token window around E (the data `keytrace.report.html` draws).

For each group the window holds every chunk that overlaps ``[lo, hi)``; ``lo`` is a little
left of the leftmost chunk a sliding-window group needed (a full-attention group needs
every chunk from S, which would drown the picture), ``hi`` a little right of max(E, L),
clipped to the prompt. Each chunk carries:

- ``key``: the key the verdict names for it (a needed chunk), else the one the episode
  looked up, else the request's own key for it derived from its other rows
  (`keytrace.analysis.unknown.derive_keys`, as the differ derives an unqueried key);
- ``stored``: that key's state on the episode's engine at the episode, by the differ's own
  definition (`keytrace.analysis.history.causes`): ``resident``, ``in_flight``,
  ``evicted``, ``failed`` (the store failed), ``rejected``, or null (never there);
- ``lookup``: the last result the episode's own lookups got for it, or null;
- ``needed`` / ``cause``: from the verdict; ``terminal``: the binding group's terminal key.

Every choice is ordered (by sequence number, or by content: derived keys are content
addressed), so a trace always draws the same page.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from keytrace.analysis import frames, unknown
from keytrace.analysis.history import causes
from keytrace.analysis.results import (
    EpisodeList,
    EpisodeMap,
    EpisodeVerdict,
    MapChunk,
    MapLane,
    hex_key,
)
from keytrace.format.reader import Trace
from keytrace.judge.definitions import SHORTFALLS, Verdict
from keytrace.judge.ops import eq, negate, plain
from keytrace.judge.rules import Group

DEFAULT_LIMIT = 200
"""Episodes drawn at most (the first mismatch always among them): a fleet trace has
thousands of shortfalls, and a page with all of them would be too heavy to open."""

STORED_STATE = {
    "resident": "resident",
    "in_flight": "in_flight",
    "evicted": "evicted",
    "store_failed": "failed",
    "rejected": "rejected",
}
"""A key's cause at the episode -> what its chunk shows as stored (other causes: nothing
was there on this engine)."""

KEY = ["inst", "s"]
CELL = [*KEY, "gid", "chunk"]


def chunk_maps(
    trace: Trace, groups: list[Group], episodes: EpisodeList, limit: int = DEFAULT_LIMIT
) -> list[EpisodeMap]:
    """Maps of the reported shortfall episodes (mismatches first, then explained; each in
    sequence order), at most ``limit``."""
    shown = _pick(episodes, limit)
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
    cells = _cells(trace, groups, shown, win, looked)
    out = []
    for v in shown:
        lo, hi = windows[(v.instance_id, v.episode)]
        lanes = [
            _lane(v, g, lo, hi, cells.get((v.instance_id, v.episode, g.gid), {})) for g in groups
        ]
        out.append(EpisodeMap(episode=v, token_lo=lo, token_hi=hi, lanes=lanes))
    return out


def _pick(episodes: EpisodeList, limit: int) -> list[EpisodeVerdict]:
    """The first ``limit`` shortfalls with an E, mismatches first, by sequence number: chosen
    on the report's columns, so only they become objects."""
    rows = episodes.rows.with_row_index("i").filter(
        pl.col("verdict").cast(pl.String).is_in(plain(SHORTFALLS))
        & pl.col("E").is_not_null()
        & (pl.col("E") != 0)
    )
    order = rows.sort(
        negate(eq(pl.col("verdict").cast(pl.String), Verdict.MISMATCH)),
        "episode",
        maintain_order=True,
    )
    return [episodes[int(i)] for i in order.head(max(limit, 0))["i"]]


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


def _looked_up(trace: Trace, win: pl.DataFrame) -> pl.DataFrame:
    """(inst, s, gid, chunk, result, lkey): the episode's last lookup of each window chunk."""
    return (
        frames.lookups_in(trace, win.lazy())
        .group_by(CELL)
        .agg(pl.col("result", "key").sort_by("seq").last())
        .rename({"key": "lkey"})
        .pipe(frames.collect)
    )


def _cells(
    trace: Trace,
    groups: list[Group],
    shown: Sequence[EpisodeVerdict],
    win: pl.DataFrame,
    looked: pl.DataFrame,
) -> dict[tuple[int, int, int], dict[int, tuple[str | None, str | None, str | None]]]:
    """(inst, s, gid) -> chunk -> (key hex, stored state, lookup result) for every window
    chunk with a key (see the module docstring)."""
    tpc = {g.gid: g.tpc for g in groups}
    needed = pl.DataFrame(
        [
            (v.instance_id, v.episode, n.group_id, n.chunk, bytes.fromhex(n.key))
            for v in shown
            for n in v.needed
            if n.key
        ],
        schema={
            "inst": pl.Int64,
            "s": pl.Int64,
            "gid": pl.Int32,
            "chunk": pl.Int64,
            "nkey": pl.Binary,
        },
        orient="row",
    )
    grid = (
        win.with_columns(pl.int_ranges("lo", "hi").alias("chunk"))
        .explode("chunk")
        .drop_nulls("chunk")
        .select(*CELL, pl.col("gid").replace_strict(tpc, return_dtype=pl.Int64).alias("tpc"))
        .join(needed, on=CELL, how="left")
        .join(looked, on=CELL, how="left")
        .with_columns(pl.coalesce("nkey", "lkey").alias("key"))
    )
    episodes = frames.collect(
        frames.episodes(trace)
        .join(win.lazy().select(KEY).unique(), on=KEY, how="semi")
        .select(*KEY, "req_id", "t")
    )
    grid = unknown.derive_keys(trace, grid, episodes)
    probes = (
        grid.filter(pl.col("key").is_not_null())
        .join(episodes, on=KEY)
        .select(
            *KEY,
            "t",
            "key",
            "gid",
            ((pl.col("chunk") + 1) * pl.col("tpc")).alias("token_end"),
            pl.lit(None, dtype=pl.Int64).alias("keyable_end"),  # not keyable: none either way
        )
        .unique()
        .with_row_index("pid")
        .with_columns(pl.col("pid").cast(pl.Int64))
    )
    group_ids = [g.gid for g in groups]
    state = causes(probes, frames.stores(trace), group_ids).select(
        *KEY, "key", "gid", pl.col("cause").replace_strict(STORED_STATE, default=None)
    )
    rows = grid.join(state.unique([*KEY, "key", "gid"]), on=[*KEY, "key", "gid"], how="left")
    out: dict[tuple[int, int, int], dict[int, tuple[str | None, str | None, str | None]]] = {}
    for i, s, gid, chunk, key, stored, result in rows.select(
        *CELL, "key", "cause", "result"
    ).iter_rows():
        out.setdefault((i, s, gid), {})[chunk] = (hex_key(key), stored, result)
    return out


def _lane(
    v: EpisodeVerdict,
    g: Group,
    lo: int,
    hi: int,
    cells: dict[int, tuple[str | None, str | None, str | None]],
) -> MapLane:
    needed = {n.chunk: n for n in v.needed if n.group_id == g.gid}
    t = v.terminal
    chunks = []
    for c in range(lo // g.tpc, -(-hi // g.tpc)):
        n = needed.get(c)
        key, stored, result = cells.get(c, (None, None, None))
        chunks.append(
            MapChunk(
                chunk=c,
                token_start=c * g.tpc,
                token_end=(c + 1) * g.tpc,
                key=key,
                stored=stored,
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
        eagle=g.drop,  # draws the peek chunk: only a group that drops a block queries one
        chunks=chunks,
    )
