"""The crash-safe writer: round trips, rotation, kills, faults and file modes."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from keytrace.analysis import frames
from keytrace.format.reader import open_trace
from keytrace.format.schema import HEAD, SCHEMA_VERSION, SCHEMAS, LookupResult
from keytrace.format.writer import TraceWriter, call_columns
from tests.factories import TINY, new_builder

HEADER = {"vllm_version": "0.33.0", "groups": [], "blocks_per_chunk": 1}


def _wait_until(done: Callable[[], bool], guard_s: float = 120.0) -> None:
    """Poll until the writer's thread did what the test waits for. ``guard_s`` only keeps a
    broken writer from hanging the suite: it is not a timing claim (a part closes in
    milliseconds on an idle machine; under CI's load it once took over 10 s)."""
    deadline = time.monotonic() + guard_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _step_row(w: TraceWriter, seq: int, req: str = "r") -> tuple[object, ...]:
    """One step row's per-call values: the common columns, then the step columns."""
    return (*w.common(seq, 0, 0), req, 0, 1, 1, 1, False, False, False)


def _parts(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.parquet"))


def test_round_trip_every_kind(tmp_path: Path) -> None:
    # GIVEN a recorder that writes one call of every row kind
    b = new_builder(tmp_path)
    k = b.key("c", 1, 3)
    b.rec.episode_begin("r1", 16, 64, 100, 100, 6, 80)
    b.rec.begin_scan()
    b.rec.lookup(k, "r1", 64, LookupResult.HIT_PENDING, True)
    b.rec.episode_end("r1", 48, True)
    b.rec.accepted("r1", 48)
    b.rec.store_prepared("r1", [k], {k: 64}, [k], [], 7)
    b.rec.store_completed("r1", [k], {k: 64}, 7, True)
    b.rec.reset()
    b.rec.load("prepared", "r1", [k], {k: 64})
    b.rec.step_rows([("r1", 16, 84, 100, 100, False, False, True)])
    b.close()
    # WHEN it is read back
    trace = open_trace(str(tmp_path))
    # THEN every kind is there with the values written
    assert trace.version == SCHEMA_VERSION == 5
    assert trace.kinds == ["store", "lookup", "load", "step"]
    [lk] = frames.lookups(trace).collect().iter_rows(named=True)
    assert (lk["gid"], lk["chunk"], lk["end_token"], lk["result"], lk["key"]) == (
        1,
        3,
        64,
        "HIT_PENDING",
        k,
    )
    [ep] = frames.episodes(trace).collect().iter_rows(named=True)
    assert (ep["S"], ep["X"], ep["A"], ep["max_new"], ep["spb"], ep["req_id"]) == (
        16,
        48,
        48,
        64,
        80,
        "r1",
    )
    st = trace.collect("store").sort("seq")
    assert [str(e) for e in st["event"]] == ["prepared", "completed", "reset"]
    assert st["job_id"].to_list() == [7, 7, None]
    assert st["key"].to_list()[2] is None and st["group_id"].to_list() == [1, 1, None]
    assert trace.collect("load")["chunk_idx"].to_list() == [3]
    step = trace.collect("step").row(0, named=True)
    assert (step["computed_tokens"], step["scheduled_tokens"], step["resumed"]) == (16, 84, True)
    # seq is one process-wide order shared by all kinds: one number per recorded call, in
    # call order (the episode takes its number at episode_begin)
    first = ep["s"]
    assert lk["seq"] == first + 1
    assert trace.collect("store").sort("seq")["seq"].to_list() == [first + 2, first + 3, first + 4]
    assert trace.collect("load")["seq"].to_list() == [first + 5]
    assert trace.collect("step")["seq"].to_list() == [first + 6]


def test_a_scan_row_summarises_its_lookups(tmp_path: Path) -> None:
    # one right-to-left window scan of 70 keys: HIT, HIT, HIT_PENDING, MISS, then HITs
    b = new_builder(tmp_path)
    results = ["HIT", "HIT", "HIT_PENDING", "MISS", *["HIT"] * 66]
    chunks = list(range(69, -1, -1))
    b.rec.episode_begin("r", 0, None, 2000, 2000, 125)
    b.rec.begin_scan()
    for c, r in zip(chunks, results, strict=True):
        b.rec.lookup(b.key("c", 1, c), "r", (c + 1) * 16, LookupResult(r), False)
    b.rec.episode_end("r", 0, False)
    b.close()
    trace = open_trace(str(tmp_path))
    [scan] = frames.scans(trace).collect().iter_rows(named=True)
    assert (scan["gid"], scan["n"], scan["n_hit"], scan["n_pending"], scan["n_miss"]) == (
        1,
        70,
        68,
        1,
        1,
    )
    # leading HITs stop at the first non-HIT; the terminal is the first MISS (chunk 66)
    assert (scan["lead_hits"], scan["term_chunk"], scan["term_result"]) == (2, 66, "MISS")
    assert scan["term_key"] == b.key("c", 1, 66) and scan["term_end_token"] == 67 * 16
    # the last HIT in call order is the leftmost chunk, 0; the scan covered chunks 0-69
    assert (scan["last_hit_chunk"], scan["min_chunk"], scan["max_chunk"]) == (0, 0, 69)
    flat_seqs = frames.lookups(trace).collect().sort("seq")["seq"].to_list()
    assert scan["last_hit_seq"] == flat_seqs[-1]
    raw = trace.collect("lookup").filter(pl.col("scan") == 0).row(0, named=True)
    assert len(raw["head_keys"]) == HEAD and len(raw["tail_keys"]) == 70 - HEAD
    # the tail holds calls 65-70: chunks 5 down to 0
    assert (raw["tail_min_chunk"], raw["tail_max_chunk"]) == (0, 69 - HEAD)
    # the raw rows come back in call order, head then tail
    flat = frames.lookups(trace).collect().sort("seq")
    assert flat["chunk"].to_list() == chunks and flat["result"].to_list() == results
    assert frames.lookups(trace, heads_only=True).collect().height == HEAD


def test_partial_key_has_null_chunk(tmp_path: Path) -> None:
    b = new_builder(tmp_path)
    k = b.key("c", 0, 0)
    b.rec.store_prepared("r", [k], {k: 10}, [k], [], 1)  # 10 is not a multiple of tpc 16
    b.close()
    st = open_trace(str(tmp_path)).collect("store")
    assert st["end_token"].to_list() == [10] and st["chunk_idx"].to_list() == [None]


def test_rotation_by_rows_and_by_time(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "rows", HEADER, max_rows=10, max_seconds=3600)
    for i in range(35):
        w.append("step", 1, (*w.common(i, 0, 0), "r", 0, 1, 1, 1, False, False, False))
        time.sleep(0.001)
    _wait_until(lambda: w.stats.parts_written >= 3)
    assert w.stats.parts_written >= 3  # rotated by the row bound while running
    w.close()
    assert open_trace(str(tmp_path / "rows")).rows("step") == 35

    w2 = TraceWriter(tmp_path / "time", HEADER, max_rows=10**9, max_seconds=0.2)
    w2.append("step", 1, _step_row(w2, 0))
    _wait_until(lambda: w2.stats.parts_written >= 1)
    assert w2.stats.parts_written == 1  # the time bound closed a part without close()
    w2.close()


def test_a_quiet_writer_closes_its_part(tmp_path: Path) -> None:
    # vLLM's default shutdown SIGKILLs the engine core right after SIGTERM: rows recorded
    # before the server went quiet must reach disk without close() or the time bound
    w = TraceWriter(tmp_path / "idle", HEADER, max_rows=10**9, max_seconds=3600, idle_seconds=0.2)
    for i in range(3):
        w.append("step", 1, _step_row(w, i))
    _wait_until(lambda: w.stats.parts_written >= 1)
    assert w.stats.parts_written == 1
    assert open_trace(str(tmp_path / "idle")).rows("step") == 3
    w.append("step", 1, _step_row(w, 3))  # a later row goes to a later part
    _wait_until(lambda: w.stats.parts_written >= 2)
    assert w.stats.parts_written == 2
    w.close()
    assert open_trace(str(tmp_path / "idle")).rows("step") == 4


def test_modes_and_layout(tmp_path: Path) -> None:
    d = tmp_path / "trace"
    w = TraceWriter(d, HEADER)
    w.append("step", 1, _step_row(w, 0))
    key = bytes(32) + (1).to_bytes(4, "big")
    w.append(
        "store", 2, (*w.common(1, 0, 0), "prepared", "r", 7), key=[key, key], end_token=[16, 32]
    )
    w.close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    parts = _parts(d)
    assert [p.parent.name for p in parts] == ["kind=step", "kind=store"]
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in parts)
    md = pq.ParquetFile(parts[0]).schema_arrow.metadata
    assert md[b"keytrace.schema_version"] == str(SCHEMA_VERSION).encode()
    assert md[b"keytrace.kind"] == b"step"
    # keys are stored once, without a dictionary (hashes never repeat); the small string
    # columns are dictionary-encoded; zstd everywhere
    store = pq.ParquetFile(parts[1])
    names = store.schema_arrow.names
    rg = store.metadata.row_group(0)
    cols = {names[i]: rg.column(i) for i in range(rg.num_columns)}
    assert not any("DICTIONARY" in e for e in cols["key"].encodings)
    assert any("DICTIONARY" in e for e in cols["event"].encodings)
    assert {c.compression for c in cols.values()} == {"ZSTD"}
    # min/max only where a reader can prune by them: never a random hash's
    assert cols["key"].statistics is None
    assert cols["seq"].statistics is not None and cols["seq"].statistics.has_min_max
    # growing integers are delta-packed (an eighth of their plain size before zstd)
    assert "DELTA_BINARY_PACKED" in cols["seq"].encodings
    assert "DELTA_BINARY_PACKED" in cols["ts_ns"].encodings


def test_a_small_lookup_part_is_one_row_group_a_big_one_one_per_group(tmp_path: Path) -> None:
    """The writer splits a lookup part by group id only from `SPLIT_MIN_ROWS` rows (each row
    group costs the serving process a column writer per column); compact always splits.
    Both read back as the same rows."""
    import io

    from keytrace.format.encode import SPLIT_MIN_ROWS, write_parquet

    b = new_builder(tmp_path / "t")
    b.prime("p", "c", 100, swa_chunks={1: [5]})
    b.episode("r", 100, external=0, chain="c", scans=[(0, [(0, "HIT")]), (1, [(5, "MISS")])])
    b.close()
    (part,) = _parts(tmp_path / "t" / "kind=lookup")
    small = pq.read_table(part)
    gids = set(small.column("group_id").to_pylist())  # episode rows have none
    assert len(gids) >= 3
    assert pq.ParquetFile(part).metadata.num_row_groups == 1
    # a scan's integer lists (sequence numbers, end tokens, chunks) are delta-packed
    rg = pq.ParquetFile(part).metadata.row_group(0)
    encodings = {rg.column(i).path_in_schema: rg.column(i).encodings for i in range(rg.num_columns)}
    lists = [c for c in encodings if c.endswith(".list.element") and "keys" not in c]
    assert "head_seqs.list.element" in lists and "tail_chunks.list.element" in lists
    assert all("DELTA_BINARY_PACKED" in encodings[c] for c in lists if "results" not in c)
    for split, groups in ((len(small), len(gids)), (len(small) + 1, 1)):
        fh = io.BytesIO()
        write_parquet(small, fh, split)
        fh.seek(0)
        again = pq.ParquetFile(fh)
        assert again.metadata.num_row_groups == groups
        assert sorted(again.read().to_pylist(), key=str) == sorted(small.to_pylist(), key=str)
    assert len(small) < SPLIT_MIN_ROWS


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from keytrace.format.writer import TraceWriter
    w = TraceWriter(sys.argv[1], {"groups": []}, max_rows=100, max_seconds=3600)
    def rows(lo, hi):
        for i in range(lo, hi):
            w.append("step", 1, (*w.common(i, 0, 0), "r", 0, 1, 1, 1, False, False, False))
    for part, (lo, hi) in enumerate([(0, 100), (100, 200)]):  # two closed parts of 100 rows
        rows(lo, hi)
        while w.stats.parts_written < part + 1:
            time.sleep(0.01)
    rows(200, 250)  # 50 rows still in memory when the kill comes
    print("ready", flush=True)
    if sys.argv[2] == "kill":
        time.sleep(60)
    """
)


def test_sigkill_leaves_every_closed_part_readable(tmp_path: Path) -> None:
    # GIVEN a real child process that closed two parts and holds 50 more rows in memory
    d = tmp_path / "t"
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(d), "kill"], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    # a torn temporary file, as a kill mid-write would leave
    (d / "kind=step" / ".torn-000009.parquet.tmp").write_bytes(b"PAR1 half a file")
    # WHEN it is SIGKILLed
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    # THEN both closed parts read back with exactly their rows; the tmp file is noted
    trace = open_trace(str(d))
    assert [p.rows for p in trace.parts] == [100, 100]
    assert trace.collect("step")["seq"].sort().to_list() == list(range(200))
    assert any("temporary" in n for n in trace.notes)


_SIGTERM_CHILD = """
import os, signal, sys, threading, time
from keytrace.format import writer as w

written = threading.Event()
real = w.TraceWriter._write_part
def noting(self, kind, buf, manifest):
    real(self, kind, buf, manifest)
    os.write(1, f"written by {threading.current_thread().name}\\n".encode())
    written.set()
w.TraceWriter._write_part = noting

def say(line):
    # os.write, not print: the signal can land while the main thread is still inside
    # print("ready") (the parent reads the line before that call returns), and a print
    # from the handler would then be a reentrant call into the same buffered stdout
    os.write(1, (line + "\\n").encode())

def vllm_handler(signum, frame):
    say("previous handler ran")
    if sys.argv[2] == "exit":
        raise SystemExit(0)  # vLLM's engine core: unwind, tear down, exit through atexit
    # still in vLLM's handler, keytrace's flush is already running beside it
    say(f"flushed meanwhile {written.wait(60)}")
    os._exit(0)  # skips atexit: only the flush that ran beside the handler saved the rows
signal.signal(signal.SIGTERM, vllm_handler)
tw = w.TraceWriter(sys.argv[1], {"groups": []}, max_rows=10**9, max_seconds=3600, idle_seconds=3600)
for i in range(7):
    tw.append("step", 1, (*tw.common(i, 0, 0), "r", 0, 1, 1, 1, False, False, False))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exit", "stay"])
def test_sigterm_chains_at_once_and_flushes_beside_vllm(tmp_path: Path, how: str) -> None:
    """keytrace's SIGTERM handler does no I/O: it hands the signal to the previous handler
    (vLLM's) at once, and the rows are written by the writer's own thread while that
    handler runs ("stay") or on the way out through atexit ("exit", vLLM's SystemExit)."""
    d = tmp_path / "t"
    p = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_CHILD, str(d), how], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    lines = out.splitlines()
    assert "previous handler ran" in lines
    if how == "stay":  # the flush ran on the writer's thread, beside vLLM's handler
        assert "flushed meanwhile True" in lines and "written by MainThread" not in lines
        assert any(x.startswith("written by keytrace-writer-") for x in lines)
    assert p.returncode == 0 and open_trace(str(d)).rows("step") == 7


def _mount_tmpfs(path: Path, opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


def _write_some(directory: Path, n: int = 2000) -> TraceWriter:
    w = TraceWriter(directory, HEADER, max_rows=500, max_seconds=3600)
    for i in range(n):
        # request ids no encoding shrinks (hex of a hash): 20,000 of them fill the full-disk
        # test's 64 KiB tmpfs whatever the writer's encodings (a repeated letter did not,
        # once growing integers were delta-packed)
        req = hashlib.sha256(str(i).encode()).hexdigest()
        w.append("step", 1, _step_row(w, i, req=req))
    w.close()
    # every row was accepted by the hot path: what is dropped was dropped by the disk
    assert w.stats.rejected_calls == 0
    assert w.stats.errors >= 1 and w.stats.rows_written + w.stats.dropped_rows == n
    return w


def test_read_only_directory_warns_once_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = tmp_path / "ro"
    if _mount_tmpfs(mnt, "size=1m,ro"):
        target = mnt / "trace"
    else:  # no mount permission here: /sys is a read-only file system in containers
        target = Path("/sys/keytrace-test-trace")
    try:
        with caplog.at_level("WARNING", logger="keytrace"):
            w = _write_some(target)
        assert w.stats.dropped_rows == 2000 and w.stats.rows_written == 0
        assert len([r for r in caplog.records if "cannot write trace" in r.getMessage()]) == 1
    finally:
        _umount(mnt)


def test_full_disk_warns_once_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    mnt = tmp_path / "full"
    mounted = _mount_tmpfs(mnt, "size=64k")
    if not mounted:  # fall back to a file object that raises ENOSPC on write
        import errno

        real_fdopen = os.fdopen

        class Full:
            def __init__(self, fd: int, mode: str) -> None:
                self.f = real_fdopen(fd, mode)

            def write(self, data: bytes) -> int:
                raise OSError(errno.ENOSPC, "No space left on device")

            def __getattr__(self, n: str) -> object:
                return getattr(self.f, n)

            def __enter__(self) -> Full:
                return self

            def __exit__(self, *a: object) -> None:
                self.f.close()

        monkeypatch.setattr("keytrace.format.writer.os.fdopen", lambda fd, mode: Full(fd, mode))
    try:
        with caplog.at_level("WARNING", logger="keytrace"):
            w = _write_some(mnt / "trace", n=20000)
        assert w.stats.dropped_rows > 0
        assert w.stats.rows_written + w.stats.dropped_rows == 20000
        assert len([r for r in caplog.records if "cannot write trace" in r.getMessage()]) == 1
        # no temporary file is left behind by a failed part
        assert not list((mnt / "trace").rglob("*.tmp"))
        if w.stats.rows_written:
            assert open_trace(str(mnt / "trace")).rows("step") == w.stats.rows_written
    finally:
        if mounted:
            _umount(mnt)


def test_call_columns_cover_schema() -> None:
    # the hot path supplies exactly these; derived and per-row columns are added at flush
    common = ("seq", "ts_ns", "instance", "instance_id", "engine_id", "dp_rank", "pid", "step")
    lookup = call_columns("lookup")
    assert lookup[:11] == (*common, "episode", "scan", "req_id")
    derived = {"term_chunk", "last_hit_chunk", "head_chunks", "tail_chunks"}
    derived |= {"min_chunk", "max_chunk", "tail_min_chunk", "tail_max_chunk"}
    assert derived.isdisjoint(lookup)  # derived at flush
    assert set(lookup) | derived == set(SCHEMAS["lookup"].names)
    assert call_columns("store") == (*common, "event", "req_id", "job_id")


def test_tiny_geometry_header_is_valid() -> None:
    from keytrace.analysis.geometry import synthetic_header

    h = synthetic_header(TINY)
    assert h["lookup_order"] == [0, 1, 2] and h["alignment_tokens"] == 16


def test_bad_append_is_a_recorder_bug_not_a_disk_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = TraceWriter(tmp_path / "t", HEADER)
    with caplog.at_level("WARNING", logger="keytrace"):
        w.append("step", 1, (1, 2, 3))  # wrong arity: refused, counted, never raised
        w.append("step", 1, _step_row(w, 0))
        w.close()
    assert (w.stats.rejected_calls, w.stats.dropped_rows, w.stats.rows_written) == (1, 1, 1)
    assert [r.getMessage() for r in caplog.records if "recorder bug" in r.getMessage()]
    assert not [r for r in caplog.records if "cannot write trace" in r.getMessage()]
