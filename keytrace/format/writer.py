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
daemon thread turns buffers into Arrow tables (`keytrace.format.encode`) and writes parts
when a row bound or a time bound is reached, within the process's disk budget
(`keytrace.format.budget`). ``close()`` (also run at exit and on SIGTERM,
`keytrace.format.shutdown`) flushes what is left.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keytrace._version import __version__
from keytrace.format import shutdown
from keytrace.format.budget import DiskBudget, process_budget
from keytrace.format.encode import (
    KEY_COLUMNS,
    Buffer,
    call_columns,
    extent,
    to_table,
    write_parquet,
)
from keytrace.format.remote import (
    Uploader,
    finish_uploads,
    is_remote,
    shown,
    uploader_for,
)
from keytrace.format.schema import FLUSH_ORDER, SCHEMAS, flush_manifest, part_metadata

__all__ = [
    "DEFAULT_IDLE_SECONDS",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_MAX_SECONDS",
    "DiskBudget",
    "NullWriter",
    "TraceWriter",
    "WriterStats",
    "call_columns",
    "process_budget",
]

log = logging.getLogger("keytrace")

DEFAULT_MAX_ROWS = 262_144
"""Rows of one kind after which the buffer is written as a part."""
DEFAULT_MAX_SECONDS = 10.0
"""Age of the oldest buffered row after which the buffers are written."""
DEFAULT_IDLE_SECONDS = 1.0
"""Buffered rows are written once nothing was appended for this long. vLLM's default
shutdown (``shutdown_timeout=0``) SIGKILLs the engine-core process right after SIGTERM, so
no handler can flush there: what a quiet server recorded must already be on disk."""
CLOSE_JOIN_SECONDS = 5.0
"""How long closing waits for the writer's thread to finish a flush in progress (it then
flushes the rest itself): bounded, so an exit is never held by a slow disk for long."""
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
        shutdown.register(self)

    # ----------------------------------------------------------------- hot path
    def append(self, kind: str, n_rows: int, call: tuple[Any, ...], **key_cols: list[Any]) -> None:
        """Append one call producing ``n_rows`` rows. Never raises.

        ``call`` holds the values of ``call_columns(kind)`` in order; ``key_cols`` the per-row
        lists of ``KEY_COLUMNS[kind]`` (each of length ``n_rows``).
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

    def extend(self, kind: str, calls: list[tuple[Any, ...]]) -> None:
        """Append several calls of one row each (a kind without per-row columns: a step's
        per-request rows), under one lock. Never raises."""
        if not calls:
            return
        try:
            arity = self._arity[kind]
            if any(len(call) != arity for call in calls):
                raise ValueError(f"{kind} calls must have {arity} values each")
            with self._lock:
                buf = self._bufs[kind]
                buf.calls.extend(calls)
                buf.counts.extend([1] * len(calls))
                buf.rows += len(calls)
                full = buf.rows >= self.max_rows
            if full:
                self._wake.set()
        except Exception as exc:  # defensive: a caller bug, never a disk problem
            self._fail(exc, len(calls), what="rejected a row (recorder bug)")

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
                next(self._flush_gen), {k: extent(b) for k, b in taken.items()}
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

    def _new_buffer(self, kind: str) -> Buffer:
        return Buffer(KEY_COLUMNS[kind])

    def _prepare_directory(self) -> bool:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            for kind in SCHEMAS:
                os.makedirs(os.path.join(self.directory, f"kind={kind}"), mode=0o700, exist_ok=True)
            return True
        except OSError as exc:
            self._fail(exc, 0)
            return False

    def _write_part(self, kind: str, buf: Buffer, manifest: Mapping[str, Any]) -> None:
        if not self._usable or self.stats.capped:
            self.stats.dropped_rows += buf.rows
            if self.stats.capped:
                self.stats.dropped_parts += 1
            return
        try:
            table = to_table(kind, buf, self.tokens_per_chunk)
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

    def extend(self, kind: str, calls: list[tuple[Any, ...]]) -> None:
        """Nothing to keep."""

    def flush(self) -> None:
        """Nothing to write."""

    def close(self) -> None:
        """Nothing to close."""
