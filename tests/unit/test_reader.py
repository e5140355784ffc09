"""Reading traces: validation, skipping unreadable parts, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keytrace.analysis import frames
from keytrace.analysis.geometry import synthetic_header
from keytrace.cli import main
from keytrace.errors import SchemaVersionError, TraceError, UnknownResultError
from keytrace.format.reader import open_trace, raise_unknown_results
from tests.factories import TINY, new_builder


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    b = new_builder(tmp_path / "t")
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [4, 5]})
    b.close()
    return tmp_path / "t"


def _one_part(d: Path, kind: str) -> Path:
    return sorted((d / f"kind={kind}").glob("*.parquet"))[0]


def _rewrite(
    src: Path,
    dst: Path,
    *,
    meta: dict[bytes, bytes] | None = None,
    drop: str | None = None,
    result: str | None = None,
    results_column: str = "head_results",
    add_hit: bool = False,
) -> None:
    t = pq.read_table(src)
    md = dict(t.schema.metadata)
    if meta:
        md.update(meta)
    if drop:
        t = t.drop_columns([drop])
    if result:  # every scan's raw results (v2: lists)
        col = t.column(results_column).to_pylist()
        t = t.set_column(
            t.schema.get_field_index(results_column),
            results_column,
            pa.array(
                [None if r is None else [result] * len(r) for r in col], pa.list_(pa.string())
            ),
        )
    if add_hit:  # one more HIT counted than the scan's n_keys
        i = t.schema.get_field_index("n_hit")
        n = [None if v is None else v + 1 for v in t.column("n_hit").to_pylist()]
        t = t.set_column(i, t.schema.field(i), pa.array(n, t.schema.field(i).type))
    pq.write_table(t.replace_schema_metadata(md), dst)


def _cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["diff", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err  # exactly one line, never a traceback
    assert "Traceback" not in err
    return err


def test_argument_order_and_kinds_from_metadata(trace_dir: Path, tmp_path: Path) -> None:
    store, lookup = _one_part(trace_dir, "store"), _one_part(trace_dir, "lookup")
    a = open_trace([str(store), str(lookup)])
    b = open_trace([str(lookup), str(store)])
    assert {p.kind for p in a.parts} == {p.kind for p in b.parts} == {"store", "lookup"}
    # a renamed file is still recognised by its metadata, not its name
    odd = tmp_path / "whatever.parquet"
    shutil.copy(store, odd)
    assert open_trace(str(odd)).kinds == ["store"]


def test_glob(trace_dir: Path) -> None:
    assert open_trace(str(trace_dir / "kind=*" / "*.parquet")).rows("store") > 0


def test_errors_one_line_exit_2(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "no such file" in _cli_error(capsys, str(tmp_path / "missing"))
    assert "matches nothing" in _cli_error(capsys, str(tmp_path / "nothing-*.parquet"))
    (tmp_path / "emptydir").mkdir()
    assert "no keytrace trace" in _cli_error(capsys, str(tmp_path / "emptydir"))
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    assert "empty file" in _cli_error(capsys, str(empty))
    junk = tmp_path / "junk.parquet"
    junk.write_text("hello, I am not parquet at all\n" * 10)
    assert "junk.parquet" in _cli_error(capsys, str(junk))
    torn = tmp_path / "torn.parquet"
    torn.write_bytes(_one_part(trace_dir, "store").read_bytes()[:-100])
    assert "torn.parquet" in _cli_error(capsys, str(torn))
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    assert "not a keytrace trace" in _cli_error(capsys, str(plain))


def test_schema_version_messages_pinned(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    future = tmp_path / "future.parquet"
    _rewrite(_one_part(trace_dir, "store"), future, meta={b"keytrace.schema_version": b"6"})
    with pytest.raises(SchemaVersionError) as e:
        open_trace(str(future))
    assert str(e.value) == (
        f"{future}: trace schema version 6 is newer than this keytrace reads (schema versions 1, 2, 3, 4, 5); upgrade keytrace"
    )
    old = tmp_path / "old.parquet"
    _rewrite(_one_part(trace_dir, "store"), old, meta={b"keytrace.schema_version": b"0"})
    with pytest.raises(SchemaVersionError) as e:
        open_trace(str(old))
    assert str(e.value) == (
        f"{old}: trace schema version 0 is older than this keytrace reads (schema versions 1, 2, 3, 4, 5); "
        "re-record with this keytrace"
    )
    assert "newer" in _cli_error(capsys, str(future))


def test_missing_columns_and_unknown_results(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nocol = tmp_path / "nocol.parquet"
    _rewrite(_one_part(trace_dir, "lookup"), nocol, drop="head_results")
    assert "lacks column(s) head_results" in _cli_error(capsys, str(nocol))
    weird = tmp_path / "weird.parquet"
    _rewrite(_one_part(trace_dir, "lookup"), weird, result="MAYBE")
    assert "unknown lookup result value(s) MAYBE" in _cli_error(capsys, str(weird))


def test_unknown_tail_results_are_caught_where_they_are_read(tmp_path: Path) -> None:
    # the long tail lists (past HEAD = 64 calls) are checked where the differ explodes them
    b = new_builder(tmp_path / "t")
    b.prime("r1", "c", 2_048)
    b.episode("r2", 2_048, external=0, scans=[(0, [(c, "HIT") for c in range(100)])], chain="c")
    b.close()
    part = _one_part(tmp_path / "t", "lookup")
    assert any(pq.read_table(part).column("tail_results").to_pylist())
    weird = tmp_path / "weird-tail.parquet"
    _rewrite(part, weird, result="MAYBE", results_column="tail_results")
    trace = open_trace(str(weird))  # heads and counts are intact
    with pytest.raises(UnknownResultError):
        frames.collect(frames.lookups(trace))
    with pytest.raises(
        TraceError, match=r"weird-tail.parquet: unknown lookup result value\(s\) MAYBE"
    ):
        raise_unknown_results(trace)


def test_scan_counts_that_do_not_add_up(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a result outside the four names shows as a count short of n_keys; here one too many
    bad = tmp_path / "miscounted.parquet"
    _rewrite(_one_part(trace_dir, "lookup"), bad, add_hit=True)
    assert "miscounted.parquet: unknown lookup result value(s) (scan counts do not add up)" in (
        _cli_error(capsys, str(bad))
    )


def test_mixed_geometries_and_versions(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    b = new_builder(other, header={**synthetic_header(TINY), "blocks_per_chunk": 2})
    b.prime("r9", "c", 64)
    b.close()
    err = _cli_error(capsys, str(trace_dir), str(other))
    assert "different geometries" in err and "blocks_per_chunk" in err
    newer = tmp_path / "newer"
    b = new_builder(newer, header={**synthetic_header(TINY), "vllm_version": "0.34.0"})
    b.prime("r9", "c", 64)
    b.close()
    assert "different vLLM versions" in _cli_error(capsys, str(trace_dir), str(newer))


def test_unreadable_part_among_good_ones(
    trace_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = trace_dir / "kind=store" / "zz-torn.parquet"
    bad.write_bytes(_one_part(trace_dir, "store").read_bytes()[:50])
    trace = open_trace(str(trace_dir))
    assert trace.incomplete and trace.skipped == [str(bad)]
    assert any(str(bad) in w for w in trace.warnings)
    # no verdict on evidence known to be partial: exit 2, one error line
    code = main(["diff", str(trace_dir)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"skipped unreadable part {bad}" in err
    assert err.splitlines()[-1] == (
        f"keytrace: error: the trace is incomplete: part {bad} unreadable; no verdict on "
        "partial evidence (--allow-incomplete judges what is there)"
    )
    # asked for, the verdict is given and says what it rests on
    code = main(["diff", str(trace_dir), "--allow-incomplete"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("AGREE (on INCOMPLETE evidence): ")
    assert "evidence incomplete" in out


def test_only_store_rows_cannot_decide(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "nothing to diff" in _cli_error(capsys, str(trace_dir / "kind=store"))


def test_header_roundtrip(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["header", str(trace_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == synthetic_header(TINY)


def test_one_schema_version_per_trace(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = Path(__file__).resolve().parents[1] / "data" / "v1" / "store.parquet"
    err = _cli_error(capsys, str(_one_part(trace_dir, "store")), str(v1))
    assert "schema version 1 mixed with version 5" in err or "mixed with version 1" in err
