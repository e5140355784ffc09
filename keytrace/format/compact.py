"""Merge a trace directory's parts into one file per row kind, header kept."""

from __future__ import annotations

import os
from dataclasses import dataclass

from keytrace._version import __version__
from keytrace.errors import TraceError
from keytrace.format.reader import open_trace
from keytrace.format.schema import SCHEMAS_BY_VERSION, part_metadata
from keytrace.format.writer import write_parquet


@dataclass(frozen=True)
class CompactResult:
    files: dict[str, str]
    rows: dict[str, int]
    skipped: list[str]


def compact(paths: list[str], out_dir: str, *, force: bool = False) -> CompactResult:
    """Write ``out_dir/<kind>.parquet`` for every kind present (temporary name + rename)."""
    trace = open_trace(paths)
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, str] = {}
    rows: dict[str, int] = {}
    for kind in trace.kinds:
        dest = os.path.join(out_dir, f"{kind}.parquet")
        if os.path.exists(dest) and not force:
            raise TraceError(f"{dest}: already exists; pass --force to overwrite")
        schema = SCHEMAS_BY_VERSION[trace.version][kind]
        table = trace.frame(kind).sort("seq").collect().to_arrow().cast(schema)
        sources = sorted({p.source.get("instance", "?") for p in trace.parts_of(kind)})
        meta = part_metadata(
            kind, trace.header, {"compacted_from": sources}, __version__, version=trace.version
        )
        table = table.replace_schema_metadata(meta)
        tmp = dest + ".tmp"
        with open(tmp, "wb") as fh:
            write_parquet(table, fh)
        os.replace(tmp, dest)
        files[kind] = dest
        rows[kind] = table.num_rows
    return CompactResult(files=files, rows=rows, skipped=list(trace.skipped))
