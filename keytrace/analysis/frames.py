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

from collections.abc import Sequence

import polars as pl
import pyarrow as pa

from keytrace.errors import UnknownResultError
from keytrace.format.reader import Trace
from keytrace.format.schema import (
    LOOKUP_RESULTS,
    SCAN_EPISODE,
    SCAN_PROOF,
    SCAN_UNQUERIED,
    LookupResult,
)
from keytrace.format.shape import lookup_rows, tier_rows


def collect(lf: pl.LazyFrame) -> pl.DataFrame:
    """Run a query on polars' streaming engine; its result owns its binary columns (see
    `owned`). Every query the differ runs goes through here."""
    try:
        return owned(_copy_binary(lf).collect(engine="streaming"))
    except pl.exceptions.InvalidOperationError as exc:
        if "to `enum` failed" in str(exc):  # the strict result cast in `_explode`
            raise UnknownResultError(
                f"lookup rows hold a result value this keytrace does not know "
                f"(expected {', '.join(LOOKUP_RESULTS)})"
            ) from exc
        raise


def collect_all(lfs: Sequence[pl.LazyFrame]) -> list[pl.DataFrame]:
    """`collect` for several queries, one after the other: run together (``pl.collect_all``)
    they hold their whole inputs at once (measured: 5x the peak memory at 50M rows)."""
    return [collect(lf) for lf in lfs]


def _copy_binary(lf: pl.LazyFrame) -> pl.LazyFrame:
    # A slice is a copy: as the last step of the plan it runs on each output batch, so the
    # batch lets go of the pages its keys were decoded into as it flows (see `owned`).
    cols = [c for c, t in lf.collect_schema().items() if t == pl.Binary]
    return lf.with_columns(pl.col(c).bin.slice(0) for c in cols) if cols else lf


def owned(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with its binary columns copied into buffers of their own.

    Polars keeps long binary values as views into the buffers they were decoded into, so a
    few thousand keys selected from a 50M-row scan keep every page they came from alive,
    during the query and after it: memory then grows with the trace, not with the result.
    Copying the (small) result lets those pages go, which keeps the differ's peak memory
    flat in trace size. (`collect` also copies inside the plan, for the peak during it.)
    """
    cols = [c for c, t in df.schema.items() if t == pl.Binary]
    if not cols or df.height == 0:
        return df
    table = df.select(cols).to_arrow()
    return df.with_columns(
        pl.Series(c, table.column(c).cast(pa.binary()), dtype=pl.Binary) for c in cols
    )


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
    """One row per lookup episode (the lookup rows with scan -1)."""
    ep = (
        lookup_rows(trace)
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
        *(_or_null(ep, c, a) for c, a in _LIMIT_COLUMNS.items()),
        _or_null(ep, "skip_reading_kv", "skip", pl.Boolean),
        _or_null(ep, "kv_load_tiers", "load_tiers", pl.String),
    )


_LIMIT_COLUMNS = {"max_load_tokens": "max_load", "max_offload_tokens": "max_offload"}
"""Episode columns of schema v4 (what the request asked of the connector); null before."""


def _or_null(
    frame: pl.LazyFrame, column: str, alias: str, dtype: pl.DataType | type[pl.DataType] = pl.Int64
) -> pl.Expr:
    """``column`` as ``alias``, or a null where the trace's schema has no such column."""
    if column in frame.collect_schema().names():
        return pl.col(column).cast(dtype).alias(alias)
    return pl.lit(None, dtype).alias(alias)


def scans(trace: Trace) -> pl.LazyFrame:
    """One summary row per scan (see `keytrace.analysis.scans`)."""
    return (
        lookup_rows(trace)
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
            "last_hit_seq",
            "last_hit_chunk",
            "min_chunk",
            "max_chunk",
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


def lookups(
    trace: Trace,
    *,
    gids: Sequence[int] | None = None,
    heads_only: bool = False,
    requests: pl.LazyFrame | None = None,
    having: pl.Series | None = None,
) -> pl.LazyFrame:
    """One row per ``manager.lookup`` call: inst, s, req_id, scan, seq, gid, chunk,
    end_token, key, result.

    Each restriction is applied before a scan's lists are exploded: ``gids`` keeps those
    groups (their row groups only are read), ``heads_only`` reads only where each scan
    started, ``requests`` (inst, req_id) keeps those requests' scans, and ``having`` keeps
    the scans that looked up at least one of those keys (the caller filters the calls).
    """
    rows = lookup_rows(trace).filter(pl.col("scan") >= 0)
    if gids is not None:
        rows = rows.filter(pl.col("group_id").is_in(list(gids)))
    parts = ["head"] if heads_only else ["head", "tail"]
    exploded = []
    for prefix in parts:
        these = rows
        if having is not None:
            hit = pl.col(f"{prefix}_keys").list.set_intersection(having.implode()).list.len() > 0
            these = these.filter(hit.fill_null(False))
        exploded.append(_explode(these, prefix, semi=requests))
    return pl.concat(exploded)


def lookup_keys(trace: Trace, gid: int) -> pl.LazyFrame:
    """(inst, s, key): every key group ``gid``'s scans looked up, and the keys the recorder
    listed for it (on a tiered manager, a full-attention prefix past where its scan
    stopped), nothing else. Only the key lists are exploded: exploding a scan's five lists
    together costs 4x one list (measured: 0.22 s -> 0.05 s for the anchor group at 50M
    rows)."""
    scanned = (pl.col("scan") >= 0) | (pl.col("scan") == SCAN_UNQUERIED)
    rows = lookup_rows(trace).filter(scanned & (pl.col("group_id") == gid))
    return pl.concat(
        rows.select(
            pl.col("instance_id").alias("inst"),
            pl.col("episode").alias("s"),
            pl.col(f"{prefix}_keys").alias("key"),
        )
        .explode("key")
        .drop_nulls("key")
        for prefix in ("head", "tail")
    )


# On-disk bytes of lookup parts read per query in `lookups_in`: shortfall episodes sit in
# nearly every row group of a long trace, so one query over all parts decodes every head list
# at once (measured at 150M rows: +290 MB peak). Batches of 32 MiB keep the peak flat, and
# cost nothing in time (1.75 s -> 1.60 s for that step at 150M rows).
LOOKUP_BATCH_BYTES = 32 << 20


def lookups_in(trace: Trace, ranges: pl.LazyFrame) -> pl.LazyFrame:
    """The lookups of chunks ``[lo, hi)`` of group ``gid`` in episode ``(inst, s)``, one
    range per row of ``ranges``: the rows `lookups` gives, restricted before anything is
    exploded. A scan's tail lists are exploded only when their chunk span meets the range
    (vLLM starts scans where a hit would end, so the chunks a verdict needs are nearly
    always in the head, and a failing window scan's long run to chunk 0 is never read).
    The lookup parts are read in batches (`LOOKUP_BATCH_BYTES`), each collected."""
    inside = (pl.col("chunk") >= pl.col("lo")) & (pl.col("chunk") < pl.col("hi"))
    want = collect(ranges.select("inst", "s", "gid", "lo", "hi"))
    episodes = want.get_column("s").unique().implode()
    found = [
        collect(_ranges(batch, want, episodes).filter(inside).drop("lo", "hi"))
        for batch in trace.batches("lookup", LOOKUP_BATCH_BYTES)
    ]
    return pl.concat(found).lazy()


def _ranges(trace: Trace, want: pl.DataFrame, episodes: pl.Series) -> pl.LazyFrame:
    # An is_in filter, unlike a join, reaches the Parquet reader: the list columns of other
    # scans are never decoded. The join then makes it exact (seqs are per process).
    def scans_of(sel: pl.DataFrame, on: list[str]) -> pl.LazyFrame:
        return (
            lookup_rows(trace)
            .filter((pl.col("scan") >= 0) & pl.col("episode").is_in(episodes))
            .rename({"instance_id": "inst", "episode": "s", "group_id": "gid"})
            .join(sel.lazy(), on=on)
        )

    rows = scans_of(want, ["inst", "s", "gid"])
    parts = [_explode(rows, "head", keep=["lo", "hi"])]
    # tails only of the scans whose tail span (two int columns) meets the range
    meets = (pl.col("tail_min_chunk") < pl.col("hi")) & (pl.col("tail_max_chunk") >= pl.col("lo"))
    tails = collect(rows.filter(meets).select("inst", "s", "gid", "scan", "lo", "hi"))
    if tails.height:
        parts.append(
            _explode(scans_of(tails, ["inst", "s", "gid", "scan"]), "tail", keep=["lo", "hi"])
        )
    return pl.concat(parts)


def unqueried(trace: Trace) -> pl.LazyFrame:
    """Keys an episode needed in groups vLLM never scanned (none in a v1 trace): inst, s,
    req_id, gid, chunk, end_token, key."""
    return listed(trace).filter(pl.col("scan") == SCAN_UNQUERIED).drop("scan")


def proofs(trace: Trace) -> pl.LazyFrame:
    """Proof keys of chunks an episode needed, listed under a candidate fix that accepts
    them (``eagle_proof_key`` only; none otherwise), in `unqueried`'s columns."""
    return listed(trace).filter(pl.col("scan") == SCAN_PROOF).drop("scan")


def listed(trace: Trace) -> pl.LazyFrame:
    """Every key the recorder *listed* rather than looked up, in one pass: `unqueried`'s
    columns plus ``scan`` (`SCAN_UNQUERIED` or `SCAN_PROOF`) saying which kind it is."""
    rows = lookup_rows(trace).filter(pl.col("scan").is_in([SCAN_UNQUERIED, SCAN_PROOF]))
    return _explode(rows, "head").select(
        "inst", "s", "req_id", "gid", "chunk", "end_token", "key", "scan"
    )


def _explode(
    rows: pl.LazyFrame,
    prefix: str,
    keep: list[str] | None = None,
    semi: pl.LazyFrame | None = None,
) -> pl.LazyFrame:
    """Scan rows (raw or already renamed to inst/s/gid) to one row per call; ``semi``
    (columns among inst, s, req_id, gid) keeps the matching scans before exploding."""
    cols = [f"{prefix}_{c}" for c in _RAW]
    names = rows.collect_schema().names()
    ident = [
        pl.col(raw if raw in names else short).alias(short)
        for raw, short in (("instance_id", "inst"), ("episode", "s"), ("group_id", "gid"))
    ]
    extra = keep or []
    picked = rows.select(*ident, _str("req_id").alias("req_id"), "scan", *cols, *extra)
    if semi is not None:
        picked = picked.join(semi, on=semi.collect_schema().names(), how="semi")
    return (
        picked.filter(pl.col(cols[0]).is_not_null())
        .explode(cols)
        .rename({f"{prefix}_{c}": _FLAT[c] for c in _RAW})
        # strict: the reader checks heads and counts at open, the raw rows are checked here,
        # where a verdict reads them (see `keytrace.format.reader._check_values`)
        .with_columns(pl.col("result").cast(pl.Enum(LookupResult)).cast(pl.String))
        .select(
            "inst",
            "s",
            "req_id",
            "scan",
            "seq",
            "gid",
            "chunk",
            "end_token",
            "key",
            "result",
            *extra,
        )
    )


def stores(trace: Trace, *, at: pl.DataFrame | None = None) -> pl.LazyFrame:
    """One row per key per store event. ``event`` stays categorical: every use compares it
    with literals, and a string cast of every store row costs more than the key column's
    whole read.

    ``at`` (req_id, chunk): keep (at least) the rows of those requests' chunks, chosen by
    the Parquet reader on one integer per row before any key is decoded; join on them for
    exactness (inst is not part of the filter). Measured on the boundary offers at 50M
    rows: 0.31 s -> 0.24 s, and the query's peak from +110 MB to +38 MB (+44 MB at 150M).
    """
    raw = trace.frame("store")
    if at is not None:
        codes = at.select(_request_chunk(pl.col("req_id"), pl.col("chunk")).unique())
        raw = raw.filter(
            _request_chunk(pl.col("req_id"), pl.col("chunk_idx")).is_in(codes.to_series().implode())
        )
    return raw.select(
        pl.col("instance_id").alias("inst"),
        "seq",
        pl.col("ts_ns").alias("ts"),
        "event",
        _str("req_id").alias("req_id"),
        pl.col("group_id").alias("gid"),
        pl.col("chunk_idx").alias("chunk"),
        "end_token",
        "key",
    )


def _request_chunk(req_id: pl.Expr, chunk: pl.Expr) -> pl.Expr:
    """(request, chunk) as one Int64: the chunk in the high half, the request's categorical
    code in the low one. Polars' categories are one mapping per process (since 1.32: the
    pinned minimum), so a trace's dictionary-encoded ``req_id`` and a cast string agree on
    codes without a string being compared per row."""
    code = req_id.cast(pl.Categorical).to_physical().cast(pl.Int64)
    return chunk.cast(pl.Int64) * (1 << 32) + code


def tiers(trace: Trace) -> pl.LazyFrame:
    """One row per key per tier event (schema v3's ``tier`` kind; none before): inst, seq,
    ts, event, req_id, ep (the lookup episode in progress, if any), tier, gid, chunk,
    end_token, key, result. ``event`` and ``result`` stay categorical (compared with
    literals only)."""
    return tier_rows(trace).select(
        pl.col("instance_id").alias("inst"),
        "seq",
        pl.col("ts_ns").alias("ts"),
        "event",
        _str("req_id").alias("req_id"),
        pl.col("episode").alias("ep"),
        "tier",
        pl.col("group_id").alias("gid"),
        pl.col("chunk_idx").alias("chunk"),
        "end_token",
        "key",
        "result",
    )


def is_tiered(trace: Trace) -> bool:
    """The trace was recorded on a tiered manager (its header lists secondary tiers)."""
    return bool(trace.header.get("secondary_tiers"))
