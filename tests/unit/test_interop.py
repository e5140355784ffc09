"""A trace directory is a plain hive-partitioned Parquet dataset: other tools read it as is."""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as ds
import pytest

from keytrace.analysis.summary import summarize
from keytrace.cli import main
from keytrace.format.reader import open_trace
from tests.factories import new_builder


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    a = new_builder(tmp_path / "t", engine_id="A", dp_rank=0)
    b = new_builder(tmp_path / "t", engine_id="B", dp_rank=1)
    a.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [4, 5]})
    b.prime("r2", "d", 64, swa_chunks={1: [2, 3]})
    a.episode(
        "r3",
        100,
        external=96,
        chain="c",
        scans=[(0, [(c, "HIT") for c in range(6)]), (1, [(5, "HIT"), (4, "HIT")])],
    )
    a.close()
    b.close()
    return tmp_path / "t"


def test_duckdb_reads_the_directory(trace_dir: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    # the README's one-liner
    rows = duckdb.sql(
        f"SELECT kind, group_id, result, count(*) AS n FROM read_parquet('{trace_dir}/kind=lookup/*.parquet', "
        "hive_partitioning=true) GROUP BY ALL ORDER BY group_id, result"
    ).fetchall()
    assert ("lookup", 0, "HIT", 6) in rows and ("lookup", 0, "MISS", 2) in rows
    total = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{trace_dir}/kind=store/*.parquet')"
    ).fetchall()
    assert total == [(open_trace(str(trace_dir)).rows("store"),)]


def test_pyarrow_dataset_reads_a_kind_with_its_partition(trace_dir: Path) -> None:
    lookup = ds.dataset(str(trace_dir / "kind=lookup"), format="parquet")
    table = lookup.to_table(columns=["group_id", "result", "engine_id"])
    s = summarize(open_trace(str(trace_dir)))
    assert table.num_rows == sum(g.looked_up for g in s.groups)
    assert set(table.column("engine_id").to_pylist()) == {"A", "B"}
    # with hive partitioning the folder name becomes a "kind" column
    episodes = ds.dataset(str(trace_dir / "kind=episode"), format="parquet", partitioning="hive")
    assert episodes.count_rows() == open_trace(str(trace_dir)).rows("episode")


def test_progress_only_when_asked(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(trace_dir), "--progress"]) == 0
    assert "keytrace: episodes" in capsys.readouterr().err
    assert main(["diff", str(trace_dir), "--json"]) == 0
    assert capsys.readouterr().err == ""
