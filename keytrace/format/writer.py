"""Crash-safe, never-raising Parquet part writer.

Why closed parts and not one long-lived ``ParquetWriter``: a Parquet file is unreadable
without its footer, so a SIGKILLed writer loses *every* row, not just the tail (the
footer holds the schema and every row group's offsets; pyarrow reads nothing without it).
Instead each flush writes one complete file under a temporary
name (``.NAME.tmp``), closes it and ``os.replace``-s it into place, which is atomic on
POSIX. A kill therefore loses at most the rows buffered since the last closed part.

Why it never raises: it runs inside vLLM's scheduler. A full disk or a read-only
directory must not take serving down, so every failure is caught, counted (``dropped_rows``)
and logged once; the caller goes on.

Threading: the hot path only appends to in-memory column lists under a short lock. A
daemon thread turns buffers into Arrow tables and writes parts when a row bound or a time
bound is reached. ``close()`` (also run at exit and on SIGTERM) flushes what is left.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import random
import signal
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc  # here, not at the first flush: its import costs ~35 ms
import pyarrow.parquet as pq

from keytrace._version import __version__
from keytrace.format.remote import (
    Uploader,
    finish_uploads,
    is_remote,
    parse_bytes,
    shown,
    stop_all,
    uploader_for,
)
from keytrace.format.schema import FLUSH_ORDER, SCHEMAS, flush_manifest, part_metadata

log = logging.getLogger("keytrace")

DEFAULT_MAX_ROWS = 262_144
DEFAULT_MAX_SECONDS = 10.0
DEFAULT_IDLE_SECONDS = 1.0
DEFAULT_MAX_BYTES = 4 << 30
"""Bytes of closed parts one process writes at most (``KEYTRACE_MAX_BYTES``): a busy
server left recording stops at 4 GiB instead of filling its disk."""
CLOSE_JOIN_SECONDS = 5.0
"""How long closing waits for the writer's thread to finish a flush in progress (it then
flushes the rest itself): bounded, so an exit is never held by a slow disk for long."""
MARKER_RESERVE = 256 << 10
"""Kept below the cap for the one empty part that says the trace was capped."""


class DiskBudget:
    """The bytes every writer of this process may still write (`DEFAULT_MAX_BYTES`).

    Policy: stop and count. A part that would take the process past the cap is not kept;
    the writer then writes one empty *cap marker* part (its manifest says ``capped``, with
    the last sequence number on disk), and from then on counts the rows and parts it does
    not write (`WriterStats`, the ``keytrace_rows_dropped`` metrics). The trace on disk is
    then a complete prefix, and the reader says it was capped (`keytrace diff` gives no
    verdict on it without ``--allow-incomplete``). Stopping keeps what a later diff of the
    start of the problem needs; dropping the oldest parts would leave the history every
    later lookup is judged against torn."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int, *, reserve: bool = False) -> bool:
        """Book ``n`` bytes; False (nothing booked) when they do not fit. Only the cap
        marker may use `MARKER_RESERVE`."""
        limit = self.max_bytes if reserve else self.max_bytes - MARKER_RESERVE
        with self._lock:
            if self.used + n > limit:
                return False
            self.used += n
            return True


_BUDGET: DiskBudget | None = None


def process_budget() -> DiskBudget:
    """This process's budget, from ``KEYTRACE_MAX_BYTES`` (bytes; ``4G``, ``512M`` too)."""
    global _BUDGET
    if _BUDGET is None:
        _BUDGET = DiskBudget(parse_bytes(os.environ.get("KEYTRACE_MAX_BYTES"), DEFAULT_MAX_BYTES))
    return _BUDGET


"""Buffered rows are written once nothing was appended for this long. vLLM's default
shutdown (``shutdown_timeout=0``) SIGKILLs the engine-core process right after SIGTERM, so
no handler can flush there: what a quiet server recorded must already be on disk."""
_INSTANCE_COUNTER = itertools.count()


class _SpoolFull(Exception):
    """A part the object-store spool had no room for (`keytrace.format.remote`)."""


@dataclass
class WriterStats:
    """Counters a caller (and tests) can read at any time."""

    rows_written: int = 0
    parts_written: int = 0
    bytes_written: int = 0
    dropped_rows: int = 0
    dropped_parts: int = 0
    """Parts not written: refused at the disk cap, or after it (`DiskBudget`)."""
    capped: bool = False
    errors: int = 0
    rejected_calls: int = 0  # appends refused for bad input (a recorder bug, not the disk)


def _extent(buf: _Buffer) -> tuple[int, int, int]:
    """(rows, first seq, last seq) of a buffer (every call's first value is its seq)."""
    seqs = [call[0] for call in buf.calls]
    return buf.rows, min(seqs), max(seqs)


class _Buffer:
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


# Which columns of each kind are per-row ("key") rather than per-call; everything else is
# per-call. Derived columns (group_id, chunk_idx) are computed at flush from key/end_token.
_KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "store": ("key", "end_token"),
    "load": ("key", "end_token"),
    "tier": ("key", "end_token"),
    "lookup": (),
    "step": (),
}
_DERIVED: dict[str, tuple[str, ...]] = {
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


def call_columns(kind: str) -> tuple[str, ...]:
    """Per-call columns the caller must supply for ``kind`` (schema order)."""
    skip = set(_KEY_COLUMNS[kind]) | set(_DERIVED[kind])
    return tuple(n for n in SCHEMAS[kind].names if n not in skip)


class _Identity:
    """Who writes: the header, host, pid, instance name and random id, engine and rank,
    chunk sizes, and the counters (shared by `TraceWriter` and `NullWriter`)."""

    def __init__(
        self,
        header: Mapping[str, Any],
        engine_id: str | None,
        dp_rank: int | None,
        tokens_per_chunk: Mapping[int, int] | None,
    ) -> None:
        self.header = dict(header)
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.instance = f"{self.host}-{self.pid}-{next(_INSTANCE_COUNTER)}"
        self.instance_id = random.getrandbits(63)
        self.engine_id = engine_id
        self.dp_rank = dp_rank
        self.tokens_per_chunk = dict(tokens_per_chunk or {})
        self.stats = WriterStats()


class TraceWriter(_Identity):
    """Buffers rows of every kind for one recorder instance and writes closed parts.

    Layout: ``DIR/kind=<kind>/<instance>-<part:06d>.parquet`` (hive-style, so DuckDB, pyarrow
    datasets and Spark read a trace directory as is). ``DIR`` is created 0700, parts 0600.

    ``tokens_per_chunk`` maps group id -> tokens per chunk; it lets the flush derive
    ``chunk_idx = end_token // tpc - 1`` for chunk-aligned keys (null for partial keys).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        header: Mapping[str, Any],
        *,
        engine_id: str | None = None,
        dp_rank: int | None = None,
        tokens_per_chunk: Mapping[int, int] | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
        background: bool = True,
        budget: DiskBudget | None = None,
    ) -> None:
        self.destination = os.fspath(directory)
        """Where the trace goes: ``directory`` as given (a local folder or a URI)."""
        self.uploader: Uploader | None = None
        """For a URI (`keytrace.format.remote`): parts are closed in its local spool, then
        uploaded whole."""
        spool_error: Exception | None = None
        if is_remote(self.destination):
            try:
                self.uploader = uploader_for(self.destination)
                directory = self.uploader.spool
            except Exception as exc:  # a spool this user may not use: record nothing
                spool_error = exc
        self.directory = os.fspath(directory)
        self.budget = budget if budget is not None else process_budget()
        self._last_seq_on_disk: int | None = None
        super().__init__(header, engine_id, dp_rank, tokens_per_chunk)
        self.max_rows = max(1, int(max_rows))
        self.max_seconds = float(max_seconds)
        self.idle_seconds = float(idle_seconds)
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._bufs = {k: self._new_buffer(k) for k in SCHEMAS}
        self._arity = {k: len(call_columns(k)) for k in SCHEMAS}
        self._part_no = itertools.count()
        self._flush_gen = itertools.count(1)  # under _io_lock: generations in write order
        self._last_flush = time.monotonic()
        self._closed = False
        self._flush_now = False
        self._warned = False
        self._warned_reject = False
        self._usable = spool_error is None and self._prepare_directory()
        if spool_error is not None:
            self._fail(spool_error, 0)
        self._source = {
            "instance": self.instance,
            "instance_id": self.instance_id,
            "host": self.host,
            "pid": self.pid,
            "engine_id": engine_id,
            "dp_rank": dp_rank,
            "started_ns": time.time_ns(),
        }
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name=f"keytrace-writer-{self.instance}", daemon=True
            )
            self._thread.start()
        _register_for_shutdown(self)

    # ----------------------------------------------------------------- hot path
    def append(self, kind: str, n_rows: int, call: tuple[Any, ...], **key_cols: list[Any]) -> None:
        """Append one call producing ``n_rows`` rows. Never raises.

        ``call`` holds the values of ``call_columns(kind)`` in order; ``key_cols`` the per-row
        lists of ``_KEY_COLUMNS[kind]`` (each of length ``n_rows``).
        """
        try:
            if len(call) != self._arity[kind]:
                raise ValueError(
                    f"{kind} call has {len(call)} values, expected {self._arity[kind]}"
                )
            with self._lock:
                buf = self._bufs[kind]
                buf.calls.append(call)
                for name, values in key_cols.items():
                    buf.key_cols[name].extend(values)
                buf.counts.append(n_rows)
                buf.rows += n_rows
                full = buf.rows >= self.max_rows
            if full:
                self._wake.set()
        except Exception as exc:  # defensive: a caller bug, never a disk problem
            self._fail(exc, n_rows, what="rejected a row (recorder bug)")

    def common(self, seq: int, ts_ns: int, step: int) -> tuple[Any, ...]:
        """The common per-call column values, in schema order."""
        return (
            seq,
            ts_ns,
            self.instance,
            self.instance_id,
            self.engine_id,
            self.dp_rank,
            self.pid,
            step,
        )

    # ---------------------------------------------------------------- flushing
    def flush(self) -> None:
        """Write every non-empty buffer as a closed part now, in `FLUSH_ORDER`, each part
        with the flush's manifest (`flush_manifest`). Never raises."""
        with self._lock:
            taken = {k: b for k, b in self._bufs.items() if b.rows}
            for k in taken:
                self._bufs[k] = self._new_buffer(k)
            self._last_flush = time.monotonic()
        if not taken:
            return
        with self._io_lock:
            manifest = flush_manifest(
                next(self._flush_gen), {k: _extent(b) for k, b in taken.items()}
            )
            for kind in sorted(taken, key=FLUSH_ORDER.index):
                self._write_part(kind, taken[kind], manifest)

    def request_flush(self) -> None:
        """Have the background thread flush at once (safe in a signal handler: it only
        sets two flags). Without a background thread, nothing: ``close`` flushes."""
        self._flush_now = True
        self._wake.set()

    def close(self) -> None:
        """Flush and stop the background thread. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_JOIN_SECONDS)
        self.flush()
        if self.uploader is not None:
            finish_uploads(self.uploader)

    def _run(self) -> None:
        # Due: a buffer is full, the oldest buffered row waited max_seconds, or rows are
        # buffered and none came for idle_seconds (the row count did not move; comparing
        # counts keeps the hot path free of clock reads).
        tick = max(0.05, min(1.0, self.max_seconds / 4, self.idle_seconds / 2))
        seen_rows, seen_at = 0, time.monotonic()
        while True:
            self._wake.wait(tick)
            self._wake.clear()
            if self._closed:  # set by close() from another thread
                return
            if self._flush_now:  # SIGTERM: flush what is buffered now, beside vLLM's teardown
                self._flush_now = False
                self.flush()
                seen_rows, seen_at = 0, time.monotonic()
                continue
            now = time.monotonic()
            with self._lock:
                rows = sum(b.rows for b in self._bufs.values())
                full = any(b.rows >= self.max_rows for b in self._bufs.values())
            if rows != seen_rows:
                seen_rows, seen_at = rows, now
            idle = now - seen_at >= self.idle_seconds
            if rows and (full or idle or now - self._last_flush >= self.max_seconds):
                self.flush()
                seen_rows, seen_at = 0, now

    def _new_buffer(self, kind: str) -> _Buffer:
        return _Buffer(_KEY_COLUMNS[kind])

    def _prepare_directory(self) -> bool:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            for kind in SCHEMAS:
                os.makedirs(os.path.join(self.directory, f"kind={kind}"), mode=0o700, exist_ok=True)
            return True
        except OSError as exc:
            self._fail(exc, 0)
            return False

    def _write_part(self, kind: str, buf: _Buffer, manifest: Mapping[str, Any]) -> None:
        if not self._usable or self.stats.capped:
            self.stats.dropped_rows += buf.rows
            if self.stats.capped:
                self.stats.dropped_parts += 1
            return
        try:
            table = self._to_table(kind, buf)
            meta = part_metadata(kind, self.header, self._source, __version__, flush=manifest)
            if not self._put(kind, table.replace_schema_metadata(meta)):
                self.stats.dropped_rows += buf.rows
                self.stats.dropped_parts += 1
                self._cap(manifest)
                return
        except _SpoolFull:  # the uploader counted it and warned; the reader names the gap
            self.stats.dropped_rows += buf.rows
            self.stats.dropped_parts += 1
            return
        except Exception as exc:
            self._fail(exc, buf.rows)
            return
        self.stats.rows_written += buf.rows
        self.stats.parts_written += 1
        seq = manifest.get("kinds", {}).get(kind, {}).get("seq") or (0, 0)
        self._last_seq_on_disk = max(seq[1], self._last_seq_on_disk or 0)

    def _put(self, kind: str, table: pa.Table, *, reserve: bool = False) -> bool:
        """Write one closed part (temporary name, then rename) if the disk budget has room
        for it; False: it had none, and nothing is left on disk."""
        folder = os.path.join(self.directory, f"kind={kind}")
        name = f"{self.instance}-{next(self._part_no):06d}.parquet"
        final = os.path.join(folder, name)
        tmp = os.path.join(folder, f".{name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                write_parquet(table, fh)
            size = os.path.getsize(tmp)
            if self.uploader is not None and not self.uploader.admit(size):
                raise _SpoolFull
            if not self.budget.take(size, reserve=reserve):
                os.unlink(tmp)
                return False
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.stats.bytes_written += size
        if self.uploader is not None:
            self.uploader.submit(final)
        return True

    def _cap(self, manifest: Mapping[str, Any]) -> None:
        """Stop at the disk cap: one empty part whose manifest says so, one warning."""
        self.stats.capped = True
        marker = {
            "gen": next(self._flush_gen),  # a flush of its own: no part of it is missing
            "kinds": {},
            "capped": {"max_bytes": self.budget.max_bytes, "last_seq": self._last_seq_on_disk},
        }
        schema = SCHEMAS["step"]
        empty = schema.empty_table().replace_schema_metadata(
            part_metadata("step", self.header, self._source, __version__, flush=marker)
        )
        self._put("step", empty, reserve=True)
        log.warning(
            "keytrace: the trace under %s reached KEYTRACE_MAX_BYTES (%.1f GiB for this "
            "process); recording stops here and what is not written is counted "
            "(keytrace_rows_dropped). vLLM is not affected.",
            shown(self.destination),
            self.budget.max_bytes / (1 << 30),
        )

    def _to_table(self, kind: str, buf: _Buffer) -> pa.Table:
        schema = SCHEMAS[kind]
        counts = np.asarray(buf.counts, dtype=np.int64)
        expand = bool(len(counts)) and bool((counts != 1).any())
        arrays: dict[str, pa.Array[Any]] = {}
        names = call_columns(kind)
        transposed: list[tuple[Any, ...]] = (
            list(zip(*buf.calls, strict=True)) if buf.calls else [() for _ in names]
        )
        for name, values in zip(names, transposed, strict=True):
            typ = schema.field(name).type
            arr = pa.array(values, type=typ.value_type if pa.types.is_dictionary(typ) else typ)
            if expand:
                arr = arr.take(pa.array(np.repeat(np.arange(len(counts)), counts)))
            arrays[name] = arr.dictionary_encode() if pa.types.is_dictionary(typ) else arr
        for name, per_row in buf.key_cols.items():
            arrays[name] = pa.array(per_row, type=schema.field(name).type)
        if "group_id" in _DERIVED[kind]:
            arrays["group_id"] = _group_ids(arrays["key"])
        if "chunk_idx" in _DERIVED[kind]:
            arrays["chunk_idx"] = self._chunk_idx(arrays["group_id"], arrays["end_token"])
        if "term_chunk" in _DERIVED[kind]:
            gid = arrays["group_id"]
            arrays["term_chunk"] = self._chunk_idx(gid, arrays["term_end_token"])
            arrays["last_hit_chunk"] = self._chunk_idx(gid, arrays["last_hit_end_token"])
            for prefix in ("head", "tail"):
                ends = arrays[f"{prefix}_end_tokens"]
                per_row = pa.array(np.repeat(gid.to_numpy(zero_copy_only=False), _lengths(ends)))
                flat = self._chunk_idx(per_row, pc.list_flatten(ends))
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

    def _chunk_idx(self, group_ids: pa.Array[Any], end_tokens: pa.Array[Any]) -> pa.Array[Any]:
        gid = group_ids.to_numpy(zero_copy_only=False)
        end = end_tokens.to_numpy(zero_copy_only=False)
        tpc = np.zeros(len(gid), dtype=np.float64)
        for g, t in self.tokens_per_chunk.items():
            tpc[gid == g] = t
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = (tpc > 0) & ~np.isnan(end.astype(np.float64))
            endf = np.where(ok, end.astype(np.float64), 0)
            tpcs = np.where(ok, tpc, 1)
            aligned = ok & (np.mod(endf, tpcs) == 0)
            chunk = np.where(aligned, endf // tpcs - 1, 0).astype(np.int64)
        return pa.array(chunk, mask=~aligned, type=pa.int64())

    def _fail(self, exc: BaseException, rows: int, *, what: str = "") -> None:
        self.stats.errors += 1
        self.stats.dropped_rows += rows
        if what:
            self.stats.rejected_calls += 1
            if not self._warned_reject:
                self._warned_reject = True
                log.warning(
                    "keytrace: writer %s: %s: %s; vLLM is not affected",
                    what,
                    type(exc).__name__,
                    exc,
                )
            return
        if not self._warned:
            self._warned = True
            log.warning(
                "keytrace: cannot write trace under %s (%s: %s); recording continues in "
                "memory only and rows are dropped. vLLM is not affected.",
                shown(self.destination)
                + ("" if self.uploader is None else f" (spool {self.directory})"),
                type(exc).__name__,
                exc,
            )


def _group_ids(keys: pa.Array[Any]) -> pa.Array[Any]:
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


# ------------------------------------------------------------ shutdown handling
_LIVE: weakref.WeakSet[TraceWriter] = weakref.WeakSet()
_HOOKS_INSTALLED = False
_PREV_SIGTERM: Any = None


def close_all() -> None:
    """Flush and close every live writer of this process (used at exit and on SIGTERM)."""
    for w in list(_LIVE):
        with contextlib.suppress(Exception):
            w.close()
    with contextlib.suppress(Exception):
        stop_all()  # before pyarrow finalises its S3 layer (its atexit hook ran earlier)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Ask every writer's own thread to flush now, then hand the signal to whoever handled
    it before (vLLM), at once. No I/O, no lock and no join happens here: vLLM's teardown
    runs as it would without keytrace, and the flush runs beside it on the writers' threads
    (a kill during it leaves a torn flush, which the reader names). What is still buffered
    at a calm exit is flushed by the ``atexit`` hook."""
    for w in list(_LIVE):
        with contextlib.suppress(Exception):
            w.request_flush()
    prev = _PREV_SIGTERM
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or unknown): die the way the default handler would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class NullWriter(_Identity):
    """A `TraceWriter` that keeps nothing: the recorder without a trace, for the live alarm
    alone (``KEYTRACE_ALARM=1`` without ``KEYTRACE_DIR``). Same identity attributes."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        header: Mapping[str, Any],
        *,
        engine_id: str | None = None,
        dp_rank: int | None = None,
        tokens_per_chunk: Mapping[int, int] | None = None,
        **_ignored: Any,
    ) -> None:
        self.directory = None
        super().__init__(header, engine_id, dp_rank, tokens_per_chunk)

    def append(self, kind: str, n_rows: int, call: tuple[Any, ...], **key_cols: list[Any]) -> None:
        """Nothing to keep."""

    def flush(self) -> None:
        """Nothing to write."""

    def close(self) -> None:
        """Nothing to close."""


def _import_now() -> None:
    """Make pyarrow import now what it imports on its first conversion. ``pa.array`` asks
    whether its input is a pandas object, importing pandas the first time when it is
    installed; pandas imports ``concurrent.futures.thread``, which registers an atexit hook,
    and during interpreter shutdown that raises "can't register atexit after shutdown". A
    writer whose first flush is the one at exit (vLLM's SIGTERM, a short run) then lost
    every row. Once per process, when the first writer starts."""
    with contextlib.suppress(Exception):
        pa.array([0], type=pa.int64())


def _register_for_shutdown(writer: TraceWriter) -> None:
    global _HOOKS_INSTALLED, _PREV_SIGTERM
    _LIVE.add(writer)
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    _import_now()
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        # Chain, never replace: whoever installed a handler before us still runs after
        # our flush. A handler installed *after* us replaces ours; atexit still flushes
        # on the normal SystemExit path vLLM uses.
        with contextlib.suppress(ValueError, OSError):
            _PREV_SIGTERM = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)


_PLAIN = {"key", "term_key", "head_keys", "tail_keys", "head_seqs", "tail_seqs"}
"""Columns never dictionary-encoded: hashes and sequence numbers do not repeat."""


def write_parquet(table: pa.Table, fh: Any) -> None:
    """One closed Parquet file. Lookup parts (v2) get one row group per group id, sorted, so
    a reader asking for one group (the differ's full-attention keys) skips the others by
    their statistics."""
    with parquet_writer(fh, table.schema) as w:
        write_row_groups(w, table)


def parquet_writer(fh: Any, schema: pa.Schema) -> pq.ParquetWriter:
    """A Parquet writer with the trace's encoding: zstd, dictionaries except for hashes."""
    # a list of columns is what pyarrow accepts; its stubs only know the bool form
    opts: dict[str, Any] = {"use_dictionary": [c for c in schema.names if c not in _PLAIN]}
    return pq.ParquetWriter(fh, schema, compression="zstd", **opts)


def write_row_groups(w: pq.ParquetWriter, table: pa.Table) -> None:
    """``table`` as one row group, or for lookup rows (v2) one per group id."""
    if "scan" not in table.column_names or len(table) == 0:
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
