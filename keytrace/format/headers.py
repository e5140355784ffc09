"""The headers of a trace folder's parts, read without polars: what the live alarm, in a
serving process, knows of the engines that recorded into the same folder before it."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pyarrow.parquet as pq

from keytrace.format.schema import META_HEADER


def folder_headers(directory: str | None) -> list[dict[str, Any]]:
    """The distinct headers of the parts already in a local trace folder. Never raises:
    unreadable parts and remote or missing folders give nothing."""
    if not directory or not os.path.isdir(directory):
        return []
    seen: dict[str, dict[str, Any]] = {}
    try:
        paths = glob.glob(os.path.join(directory, "kind=*", "*.parquet"))
    except OSError:
        return []
    for path in sorted(paths):
        try:
            meta = pq.read_schema(path).metadata or {}
            raw = meta.get(META_HEADER, b"").decode()
            if raw and raw not in seen:
                seen[raw] = json.loads(raw)
        except Exception:
            continue
    return list(seen.values())
