"""How a trace's rows are buffered and encoded: which columns of each kind are per call and
which per row (`KEY_COLUMNS`, `DERIVED`), the hot path's buffer (`Buffer`), a buffer as an
Arrow table (`to_table`, off the hot path on the writer's thread) and a table as a Parquet
part (`write_parquet`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc  # here, not at the first flush: its import costs ~35 ms
import pyarrow.parquet as pq

from keytrace.format.schema import SCHEMAS


class Buffer:
    """Buffer for one row kind.

    ``calls`` holds one tuple per recorded *call* (the per-call columns, in order);
    ``key_cols`` hold one value per *row*; ``counts`` says how many rows each call produced.
    Per-call values are transposed and repeated at flush time, so the hot path is one tuple
    append plus, for multi-key calls, one ``list.extend`` per per-row column.
    """

    __slots__ = ("calls", "counts", "key_cols", "rows")

    def __init__(self, key_names: tuple[str, ...]) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.key_cols: dict[str, list[Any]] = {n: [] for n in key_names}
        self.counts: list[int] = []
        self.rows = 0


def extent(buf: Buffer) -> tuple[int, int, int]:
    """(rows, first seq, last seq) of a buffer (every call's first value is its seq)."""
    seqs = [call[0] for call in buf.calls]
    return buf.rows, min(seqs), max(seqs)


# Which columns of each kind are per-row ("key") rather than per-call; everything else is
# per-call. Derived columns (group_id, chunk_idx) are computed at flush from key/end_token.
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "store": ("key", "end_token"),
    "load": ("key", "end_token"),
    "tier": ("key", "end_token"),
    "lookup": (),
    "step": (),
}
DERIVED: dict[str, tuple[str, ...]] = {
    "store": ("group_id", "chunk_idx"),
    "load": ("group_id", "chunk_idx"),
    "tier": ("group_id", "chunk_idx"),
    # v2 lookup rows: chunk indices follow from end tokens and the group's chunk size
    "lookup": (
        "term_chunk",
        "last_hit_chunk",
        "head_chunks",
        "tail_chunks",
        "min_chunk",
        "max_chunk",
        "tail_min_chunk",
        "tail_max_chunk",
    ),
    "step": (),
}


@functools.cache
def call_columns(kind: str) -> tuple[str, ...]:
    """Per-call columns the caller must supply for ``kind`` (schema order)."""
    skip = set(KEY_COLUMNS[kind]) | set(DERIVED[kind])
    return tuple(n for n in SCHEMAS[kind].names if n not in skip)


def to_table(kind: str, buf: Buffer, tokens_per_chunk: Mapping[int, int]) -> pa.Table:
    """One buffer of ``kind`` as an Arrow table of the kind's schema: per-call values
    repeated per row, the derived columns (group id, chunk indices, a scan's chunk span)
    computed from keys and end tokens."""
    schema = SCHEMAS[kind]
    counts = np.asarray(buf.counts, dtype=np.int64)
    expand = bool(len(counts)) and bool((counts != 1).any())
    arrays: dict[str, pa.Array[Any]] = {}
    names = call_columns(kind)
    transposed: list[tuple[Any, ...]] = (
        list(zip(*buf.calls, strict=True)) if buf.calls else [() for _ in names]
    )
    # a call of several rows (a store call's keys) repeats its values: one index for all
    rows: Any = pa.array(np.repeat(np.arange(len(counts)), counts)) if expand else None
    types = _types(kind)
    for name, values in zip(names, transposed, strict=True):
        # a dictionary column is built as one from the values (no plain array first)
        arr = pa.array(values, type=types[name])
        arrays[name] = arr if rows is None else arr.take(rows)
    for name, per_row in buf.key_cols.items():
        arrays[name] = pa.array(per_row, type=types[name])
    if "group_id" in DERIVED[kind]:
        arrays["group_id"] = group_ids_of(arrays["key"])
    if "chunk_idx" in DERIVED[kind]:
        arrays["chunk_idx"] = chunk_idx(tokens_per_chunk, arrays["group_id"], arrays["end_token"])
    if "term_chunk" in DERIVED[kind]:
        gid = arrays["group_id"]
        arrays["term_chunk"] = chunk_idx(tokens_per_chunk, gid, arrays["term_end_token"])
        arrays["last_hit_chunk"] = chunk_idx(tokens_per_chunk, gid, arrays["last_hit_end_token"])
        for prefix in ("head", "tail"):
            ends = arrays[f"{prefix}_end_tokens"]
            per_row = pa.array(np.repeat(gid.to_numpy(zero_copy_only=False), _lengths(ends)))
            flat = chunk_idx(tokens_per_chunk, per_row, pc.list_flatten(ends))
            arrays[f"{prefix}_chunks"] = pa.ListArray.from_arrays(
                _offsets(ends), flat, mask=ends.is_null()
            )
        # the chunk span a scan covered, whole and in its tail: a reader decides from
        # these whether it needs a scan's lists at all
        head_lo, head_hi = _span(arrays["head_chunks"])
        tail_lo, tail_hi = _span(arrays["tail_chunks"])
        arrays["min_chunk"] = pc.min_element_wise(head_lo, tail_lo)
        arrays["max_chunk"] = pc.max_element_wise(head_hi, tail_hi)
        arrays["tail_min_chunk"], arrays["tail_max_chunk"] = tail_lo, tail_hi
    return pa.Table.from_arrays([arrays[n] for n in schema.names], schema=schema)


@functools.cache
def _types(kind: str) -> dict[str, pa.DataType]:
    """Column name -> Arrow type of ``kind`` (``Schema.field`` by name costs a lookup in
    C++ per column and part)."""
    return {f.name: f.type for f in SCHEMAS[kind]}


def chunk_idx(
    tokens_per_chunk: Mapping[int, int], group_ids: pa.Array[Any], end_tokens: pa.Array[Any]
) -> pa.Array[Any]:
    """``end_token // tpc - 1`` per row where the end token is a chunk boundary of its
    group, null otherwise (a partial key)."""
    gid = group_ids.to_numpy(zero_copy_only=False)
    end = end_tokens.to_numpy(zero_copy_only=False)
    tpc = np.zeros(len(gid), dtype=np.float64)
    for g, t in tokens_per_chunk.items():
        tpc[gid == g] = t
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = (tpc > 0) & ~np.isnan(end.astype(np.float64))
        endf = np.where(ok, end.astype(np.float64), 0)
        tpcs = np.where(ok, tpc, 1)
        aligned = ok & (np.mod(endf, tpcs) == 0)
        chunk = np.where(aligned, endf // tpcs - 1, 0).astype(np.int64)
    return pa.array(chunk, mask=~aligned, type=pa.int64())


def group_ids_of(keys: pa.Array[Any]) -> pa.Array[Any]:
    """Vectorised ``int.from_bytes(key[-4:], 'big')`` over a binary array (nulls stay null)."""
    if len(keys) == 0:
        return pa.array([], type=pa.int32())
    offsets_buf, data_buf = keys.buffers()[1], keys.buffers()[2]
    assert offsets_buf is not None  # a non-empty binary array always has offsets
    offsets = np.frombuffer(memoryview(offsets_buf), dtype=np.int32)[
        keys.offset : keys.offset + len(keys) + 1
    ]
    data = (
        np.frombuffer(memoryview(data_buf), dtype=np.uint8) if data_buf else np.zeros(0, np.uint8)
    )
    ends = offsets[1:]
    valid = (ends - offsets[:-1]) >= 4
    ends = np.where(valid, ends, 4)
    b = [
        data[np.maximum(ends - k, 0)].astype(np.uint32)
        if len(data)
        else np.zeros(len(ends), np.uint32)
        for k in (4, 3, 2, 1)
    ]
    gid = (b[0] << 24) | (b[1] << 16) | (b[2] << 8) | b[3]
    mask = ~valid
    if keys.null_count:
        mask |= ~np.asarray(keys.is_valid())
    return pa.array(gid.astype(np.int32), mask=mask, type=pa.int32())


_PLAIN = {"key", "term_key", "head_keys", "tail_keys", "head_seqs", "tail_seqs"}
"""Columns never dictionary-encoded: hashes and sequence numbers do not repeat."""


SPLIT_MIN_ROWS = 16_384
"""The rows from which a part the writer closes gets one row group per group id (lookup
rows, `write_row_groups`). A reader skips a group's row group only to save reading it;
below this a part is read whole in a moment anyway, while each row group costs the writer
a column writer per column (55 for lookup rows): one row group halves the instructions of
writing a small lookup part, on the serving process (`tools/bench_recorder.py --profile`).
`keytrace compact` always splits."""


def write_parquet(table: pa.Table, fh: Any, split_min_rows: int = SPLIT_MIN_ROWS) -> None:
    """One closed Parquet file. A lookup part (v2) of at least ``split_min_rows`` rows gets
    one row group per group id, sorted, so a reader asking for one group (the differ's
    full-attention keys) skips the others by their statistics."""
    with parquet_writer(fh, table.schema) as w:
        write_row_groups(w, table, split_min_rows)


def parquet_writer(fh: Any, schema: pa.Schema) -> pq.ParquetWriter:
    """A Parquet writer with the trace's encoding: zstd, dictionaries except for hashes,
    delta packing for growing integers (`delta_columns`), statistics only where a reader
    can prune by them (`statistics_columns`)."""
    # a list of columns is what pyarrow accepts; its stubs only know the bool form
    delta = delta_columns(schema)
    opts: dict[str, Any] = {
        "use_dictionary": [c for c in schema.names if c not in _PLAIN and c not in delta],
        "write_statistics": statistics_columns(schema),
        "column_encoding": delta,
    }
    return pq.ParquetWriter(fh, schema, compression="zstd", **opts)


_DELTA_SCALARS = ("seq", "ts_ns")
"""Scalar columns that only grow within a part: delta-encoded (`delta_columns`)."""


def delta_columns(schema: pa.Schema) -> dict[str, str]:
    """Column path -> ``DELTA_BINARY_PACKED`` for the integer columns whose neighbours are
    close: sequence numbers and clocks, and every integer list (a scan's sequence numbers,
    end tokens and chunks step by one call or one chunk). Delta-packed, they reach zstd an
    eighth of their plain size: a part costs the serving process ~13% fewer
    instructions and is ~12% smaller (`tools/bench_recorder.py`). A list's values are
    named by their Parquet path (``name.list.element``); dictionaries do not apply to
    them."""
    out: dict[str, str] = {}
    for f in schema:
        if f.name in _DELTA_SCALARS and pa.types.is_integer(f.type):
            out[f.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_list(f.type) and pa.types.is_integer(f.type.value_type):
            out[f"{f.name}.list.element"] = "DELTA_BINARY_PACKED"
    return out


def statistics_columns(schema: pa.Schema) -> list[str]:
    """The columns whose min/max a part records: every scalar column but binary ones.
    A block hash is uniformly random, so a row group's min and max span almost the whole
    key space and never let a reader skip it; lists are never filtered by range. Their
    statistics cost a tenth of the writer's instructions (`tools/bench_recorder.py
    --profile`), on the serving process."""
    return [
        f.name
        for f in schema
        if not (
            pa.types.is_binary(f.type)
            or pa.types.is_large_binary(f.type)
            or pa.types.is_list(f.type)
            or pa.types.is_large_list(f.type)
        )
    ]


def write_row_groups(w: pq.ParquetWriter, table: pa.Table, split_min_rows: int = 0) -> None:
    """``table`` as one row group, or for lookup rows (v2) of at least ``split_min_rows``
    rows one per group id."""
    if "scan" not in table.column_names or len(table) == 0 or len(table) < split_min_rows:
        w.write_table(table, row_group_size=max(len(table), 1))
        return
    table = table.sort_by([("group_id", "ascending")])
    gid = table.column("group_id").to_numpy(zero_copy_only=False)
    gid = np.where(np.isnan(gid.astype(np.float64)), -1, gid).astype(np.int64)
    bounds = np.flatnonzero(np.diff(gid)) + 1
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(table)], strict=True):
        w.write_table(table.slice(lo, hi - lo), row_group_size=hi - lo)


def _lengths(lists: pa.Array[Any]) -> np.ndarray[Any, Any]:
    """Entries per list (0 for a null list)."""
    return np.asarray(pc.list_value_length(lists).fill_null(0), dtype=np.int64)


def _span(lists: pa.Array[Any]) -> tuple[pa.Array[Any], pa.Array[Any]]:
    """Per list: the smallest and largest non-null entry (null when it has none)."""
    lengths = _lengths(lists)
    flat = pc.list_flatten(lists)
    valid = ~np.asarray(flat.is_null(), dtype=bool)
    values = np.asarray(flat.fill_null(0), dtype=np.int64)
    big = np.iinfo(np.int64).max
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    nonempty = lengths > 0
    lo = np.full(len(lengths), big, dtype=np.int64)
    hi = np.full(len(lengths), -big, dtype=np.int64)
    if nonempty.any():
        lo[nonempty] = np.minimum.reduceat(np.where(valid, values, big), starts[nonempty])
        hi[nonempty] = np.maximum.reduceat(np.where(valid, values, -big), starts[nonempty])
    return pa.array(lo, mask=lo == big), pa.array(hi, mask=hi == -big)


def _offsets(lists: pa.Array[Any]) -> pa.Int32Array:
    """Offsets rebuilding lists of the same shape around a flat array."""
    ends = np.concatenate([[0], np.cumsum(_lengths(lists))]).astype(np.int32)
    return pa.array(ends, type=pa.int32())
