"""Rewrite a v2 trace as the v1 trace the old recorder would have written for the same run.

Tests use it to prove the format change kept every verdict: v1 had one lookup row per key
vLLM queried (``seq`` per call) and a separate ``episode`` kind; v2 packs each scan into one
row with head/tail lists and puts episodes in the lookup kind. v2 also records two facts v1 could
not hold: needed keys vLLM never queried (``scan == -2``; v1 derived what it could from the
keys it saw) and the GPU prefix cache's ``shared_prefix_boundary``. `without_v2_facts`
removes them, giving the v2 trace of exactly what a v1 recorder saw.
"""

from __future__ import annotations

import json
import os
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from keytrace.format.reader import open_trace
from keytrace.format.schema import (
    SCAN_EPISODE,
    SCAN_UNQUERIED,
    SCHEMAS_BY_VERSION,
    canonical_json,
    part_metadata,
)

_COMMON = ["seq", "ts_ns", "instance", "instance_id", "engine_id", "dp_rank", "pid", "step"]


def downgrade(src: str, dst: str) -> None:
    """Write ``dst`` (a directory) as the v1 form of the v2 or v3 trace at ``src``, part by
    part (each keeps its own source: which process and engine wrote it); v1 has no tier
    rows."""
    assert open_trace(src).version >= 2
    os.makedirs(dst, exist_ok=True)
    for i, part in enumerate(p for p in open_trace(src).parts if p.kind != "tier"):
        trace = open_trace(part.path)
        frame = trace.collect(part.kind)
        tables = {part.kind: frame}
        if part.kind == "lookup":
            tables = {
                "lookup": _flat_lookups(frame),
                "episode": frame.filter(pl.col("scan") == SCAN_EPISODE),
            }
        for kind, rows in tables.items():
            schema = SCHEMAS_BY_VERSION[1][kind]
            table = pa.Table.from_arrays(
                [rows[n].to_arrow().cast(schema.field(n).type) for n in schema.names],
                schema=schema,
            )
            meta = part_metadata(kind, trace.header, _source(part.source), "downgrade", version=1)
            out = os.path.join(dst, f"{kind}-{i:05d}.parquet")
            pq.write_table(table.replace_schema_metadata(meta), out)


def _flat_lookups(lookup: pl.DataFrame) -> pl.DataFrame:
    """One row per queried key, in call order: the head lists, then the tail lists."""
    scans = lookup.filter(pl.col("scan") >= 0)
    parts = []
    for prefix in ("head", "tail"):
        cols = [f"{prefix}_{c}" for c in ("seqs", "end_tokens", "chunks", "keys", "results")]
        part = (
            scans.select(
                *[c for c in _COMMON if c != "seq"],
                "episode",
                "scan",
                "req_id",
                "group_id",
                "secondary",
                *cols,
            )
            .filter(pl.col(cols[0]).list.len() > 0)
            .explode(cols)
            .rename(
                dict(zip(cols, ["seq", "end_token", "chunk_idx", "key", "result"], strict=True))
            )
        )
        parts.append(part)
    return pl.concat(parts).sort("seq", maintain_order=True)


def _source(source: dict[str, Any]) -> dict[str, Any]:
    return json.loads(canonical_json(source))


def without_v2_facts(src: str, dst: str) -> None:
    """Copy the v2 or v3 trace at ``src`` to ``dst`` without what v1 could not record (the
    unqueried keys, the junction, tier rows)."""
    os.makedirs(dst, exist_ok=True)
    for i, part in enumerate(p for p in open_trace(src).parts if p.kind != "tier"):
        table = pq.read_table(part.path)
        if part.kind == "lookup":
            frame = pl.from_arrow(table)
            assert isinstance(frame, pl.DataFrame)
            frame = frame.filter(pl.col("scan") != SCAN_UNQUERIED).with_columns(
                pl.lit(None, pl.Int64).alias("shared_prefix_boundary")
            )
            table = pa.Table.from_arrays(
                [frame[n].to_arrow().cast(table.schema.field(n).type) for n in table.schema.names],
                schema=table.schema,
            )
        pq.write_table(table, os.path.join(dst, f"{part.kind}-{i:05d}.parquet"))
