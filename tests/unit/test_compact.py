"""`keytrace compact` streams: one part in memory at a time, each written as its own row
group(s) in the directory form's read order, so the compacted files give the same report."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from keytrace.analysis.diff import diff
from keytrace.errors import TraceError
from keytrace.format import compact as compact_mod
from keytrace.format.compact import compact
from keytrace.format.reader import open_trace
from keytrace.format.schema import SCHEMA_VERSION
from tests.factories import TINY, new_builder


def _multi_part_trace(d: Path) -> Path:
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    fa = [(c, "HIT") for c in range(6)]
    for n, chain in enumerate("cdef"):
        b.prime(f"p{n}", chain, 100, swa_chunks={1: [5]})
        b.episode(
            f"r{n}", 100, external=0, chain=chain, scans=[(0, fa), (1, [(5, "HIT"), (4, "MISS")])]
        )
        b.rec.writer.flush()  # parts of their own
    b.close()
    return d


def test_one_row_group_set_per_part_and_the_same_report(tmp_path: Path) -> None:
    d = _multi_part_trace(tmp_path / "t")
    trace = open_trace(str(d))
    res = compact([str(d)], str(tmp_path / "c"))
    for kind in ("store", "lookup"):
        parts = trace.parts_of(kind)
        assert len(parts) >= 4
        f = pq.ParquetFile(res.files[kind])
        assert (
            f.metadata.num_rows
            == res.rows[kind]
            == sum(pq.ParquetFile(p.path).metadata.num_rows for p in parts)
        )
        # never merged into one big row group: at least one per part (lookup: per group)
        assert f.metadata.num_row_groups >= len(parts)
        assert f.schema_arrow.metadata[b"keytrace.schema_version"] == str(SCHEMA_VERSION).encode()
    files = [res.files["store"], res.files["lookup"]]
    assert diff(open_trace(files), all_episodes=True) == diff(trace, all_episodes=True)


def test_a_failure_leaves_neither_file_nor_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _multi_part_trace(tmp_path / "t")
    calls = []

    def boom(w: object, table: object) -> None:
        calls.append(1)
        if len(calls) == 2:  # the second part
            raise OSError("disk full")

    monkeypatch.setattr(compact_mod, "write_row_groups", boom)
    out = tmp_path / "c"
    with pytest.raises(OSError, match="disk full"):
        compact([str(d)], str(out))
    assert os.listdir(out) == []


def test_existing_output_needs_force(tmp_path: Path) -> None:
    d = _multi_part_trace(tmp_path / "t")
    compact([str(d)], str(tmp_path / "c"))
    with pytest.raises(TraceError, match="already exists"):
        compact([str(d)], str(tmp_path / "c"))
    assert compact([str(d)], str(tmp_path / "c"), force=True).rows


def test_a_compacted_file_is_read_in_batches_of_row_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One big file is cut into runs of row groups (a slice the Parquet reader prunes by),
    so the per-batch queries stay bounded on the compacted form too, with the same report."""
    from keytrace.analysis import frames

    d = _multi_part_trace(tmp_path / "t")
    res = compact([str(d)], str(tmp_path / "c"))
    trace = open_trace([res.files["store"], res.files["lookup"]])
    batches = trace.batches("lookup", 1)
    groups = pq.ParquetFile(res.files["lookup"]).metadata.num_row_groups
    assert len(batches) == groups > 1
    slices = [b.parts_of("lookup")[0].row_slice for b in batches]
    assert slices[0] == (0, slices[0][1]) and all(s is not None for s in slices)
    assert sum(s[1] for s in slices) == res.rows["lookup"]  # type: ignore[index]
    # the rows of the batches are the file's rows, in order
    whole = trace.frame("lookup").collect()
    pieces = [b.frame("lookup").collect() for b in batches]
    assert pl.concat(pieces).equals(whole)
    report = diff(trace, all_episodes=True)
    monkeypatch.setattr(frames, "LOOKUP_BATCH_BYTES", 1)
    assert diff(trace, all_episodes=True) == report
    assert len(trace.batches("lookup", 1 << 30)) == 1
