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


README_QUERY = """
SELECT group_id, result, count(*) AS n FROM (
  SELECT group_id, unnest(list_concat(head_results, coalesce(tail_results, []))) AS result
  FROM read_parquet('{trace}/kind=lookup/*.parquet') WHERE scan >= 0
) GROUP BY ALL ORDER BY group_id, result
"""


def test_duckdb_reads_the_directory(trace_dir: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    # the README's query: lookup results per group, from the raw lists of every scan
    rows = duckdb.sql(README_QUERY.format(trace=trace_dir)).fetchall()
    assert (0, "HIT", 6) in rows and (0, "MISS", 2) in rows
    s = summarize(open_trace(str(trace_dir)))
    assert sum(n for _, _, n in rows) == sum(g.looked_up for g in s.groups)
    total = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{trace_dir}/kind=store/*.parquet')"
    ).fetchall()
    assert total == [(open_trace(str(trace_dir)).rows("store"),)]


TERMINAL_QUERY = """
SELECT req_id, group_id, term_chunk, term_result, n_keys
FROM read_parquet('{trace}/kind=lookup/*.parquet') WHERE scan >= 0 AND term_pos IS NOT NULL
"""


def test_duckdb_terminal_query_from_the_format_doc(trace_dir: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trace-format.md").read_text()
    assert TERMINAL_QUERY.strip().replace("{trace}", "TRACE") in doc
    # r1's cold scan misses chunk 0 at once; r2's prime and r3's resend hit all the way
    rows = duckdb.sql(TERMINAL_QUERY.format(trace=trace_dir)).fetchall()
    assert sorted(rows) == [("r1", 0, 0, "MISS", 1), ("r2", 0, 0, "MISS", 1)]


def test_pyarrow_dataset_reads_a_kind_with_its_partition(trace_dir: Path) -> None:
    lookup = ds.dataset(str(trace_dir / "kind=lookup"), format="parquet")
    table = lookup.to_table(columns=["scan", "n_keys", "engine_id"])
    s = summarize(open_trace(str(trace_dir)))
    assert sum(n or 0 for n in table.column("n_keys").to_pylist()) == sum(
        g.looked_up for g in s.groups
    )
    assert set(table.column("engine_id").to_pylist()) == {"A", "B"}
    # with hive partitioning the folder name becomes a "kind" column
    parts = ds.dataset(str(trace_dir / "kind=lookup"), format="parquet", partitioning="hive")
    assert parts.count_rows() == open_trace(str(trace_dir)).rows("lookup")


def test_progress_only_when_asked(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(trace_dir), "--progress"]) == 0
    assert "keytrace: episodes" in capsys.readouterr().err
    assert main(["diff", str(trace_dir), "--json"]) == 0
    assert capsys.readouterr().err == ""
