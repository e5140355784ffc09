"""Traces on object storage: ``KEYTRACE_DIR=s3://bucket/prefix`` (or any URI pyarrow
resolves to a filesystem: ``gs://``, ``hdfs://``, ``abfs://``...). Imports no polars.

Writing. A part is still written closed, under a temporary name and renamed, but into a
local **spool** folder; an uploader thread then sends each closed part as one whole object
and deletes it locally once the store has it. An object PUT is atomic (readers see the
whole object or none), so the crash-safety rule holds end to end: a part is on the store
complete, or in the spool complete, or nowhere and named missing by its flush's manifest.
The uploader never blocks vLLM: the writer hands it a path and goes on. When the store is
unreachable parts wait in the spool (retried with backoff, failures counted in the
metrics); past ``KEYTRACE_SPOOL_BYTES`` (default 1 GiB) new parts are dropped and counted,
and the reader reports the gap. At exit the uploader gets `CLOSE_UPLOAD_SECONDS` to
finish; what is left stays in the spool and the next keytrace process writing to the same
URI on that host uploads it (a spool of a process that is no longer alive is adopted).

Credentials, region and endpoint come from the environment as for any AWS client
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``) or from the URI's query (``?endpoint_override=host:port&scheme=http``).

Reading. `mirror` copies a remote trace's parts into a local cache once (a part already
there with the same size is not fetched again) and the reader opens that folder: every
reader command takes ``s3://...`` as it takes a folder.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("keytrace")

LOCAL_SCHEMES = ("", "file")
DEFAULT_SPOOL_BYTES = 1 << 30
CLOSE_UPLOAD_SECONDS = 5.0
"""How long a closing writer lets the uploader finish (bounded: never holds an exit long)."""
RETRY_SECONDS = (0.5, 30.0)
"""First and longest wait between attempts while the store is unreachable."""


def is_remote(path: str | os.PathLike[str]) -> bool:
    """A URI of a filesystem other than the local one (``s3://``, ``gs://``, ...)."""
    text = os.fspath(path)
    if "://" not in text:
        return False
    return urlsplit(text).scheme.lower() not in LOCAL_SCHEMES


def public(uri: str) -> str:
    """The URI without its query and user info (what logs and metrics may show)."""
    p = urlsplit(uri)
    return urlunsplit((p.scheme, p.hostname or "", p.path, "", ""))


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, root path inside it) of ``uri``."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(uri)
    return fs, root.rstrip("/")


def spool_root(uri: str) -> Path:
    """Where parts for ``uri`` wait on this host (``KEYTRACE_SPOOL_DIR`` or the temp dir),
    one folder per URI."""
    base = os.environ.get("KEYTRACE_SPOOL_DIR") or os.path.join(
        tempfile.gettempdir(), "keytrace-spool"
    )
    return Path(base) / hashlib.sha256(public(uri).encode()).hexdigest()[:16]


def parse_bytes(text: str | None, default: int = 4 << 30, name: str = "KEYTRACE_MAX_BYTES") -> int:
    """``4294967296``, ``4G``, ``512M``, ``64K`` (binary units); unset or unreadable: the
    default (a cap must never be lifted by a typo). ``name``: the variable, for the warning."""
    if not text:
        return default
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        log.warning("keytrace: %s=%r is not a size; using %d", name, text, default)
        return default
    return int(value)


def parse_spool_bytes(raw: str | None) -> int:
    return parse_bytes(raw, DEFAULT_SPOOL_BYTES, "KEYTRACE_SPOOL_BYTES")


@dataclass
class UploadStats:
    uploaded_parts: int = 0
    uploaded_bytes: int = 0
    failures: int = 0
    """Attempts that failed (the store unreachable, refused, timed out)."""
    dropped_parts: int = 0
    """Parts not kept because the spool was full."""
    adopted_parts: int = 0
    """Parts found in the spool of an earlier process and uploaded by this one."""


class Uploader:
    """Uploads closed parts from one process's spool folder to ``uri`` (module docstring).

    One per URI and process (`uploader_for`), shared by its writers. ``submit`` is all the
    writer's thread does; the upload runs on this object's own daemon thread.
    """

    def __init__(self, uri: str, *, spool_bytes: int | None = None) -> None:
        self.uri = uri
        self.shown = public(uri)
        self.root = spool_root(uri)
        self.spool = self.root / f"{socket.gethostname()}-{os.getpid()}"
        self.spool.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = (
            parse_spool_bytes(os.environ.get("KEYTRACE_SPOOL_BYTES"))
            if spool_bytes is None
            else spool_bytes
        )
        self.stats = UploadStats()
        self._queue: collections.deque[Path] = collections.deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._fs: tuple[Any, str] | None = None
        self._warned_unreachable = False
        self._warned_full = False
        self.warned_left = False
        self._adopt_orphans()
        self._thread = threading.Thread(
            target=self._run, name=f"keytrace-upload-{self.spool.name}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ writer side
    def admit(self, size: int) -> bool:
        """Whether a new part of ``size`` bytes may wait in the spool; False counts it
        dropped (and warns once)."""
        with self._lock:
            if self._pending_bytes + size <= self.max_bytes:
                return True
            self.stats.dropped_parts += 1
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "keytrace: %s unreachable and the local spool %s is full "
                "(KEYTRACE_SPOOL_BYTES %d); new parts are dropped and counted, the reader "
                "names the gap. vLLM is not affected.",
                self.shown,
                self.spool,
                self.max_bytes,
            )
        return False

    def submit(self, path: str | os.PathLike[str]) -> None:
        """A closed part in the spool, ready to go up (never blocks, never raises)."""
        p = Path(path)
        try:
            size = p.stat().st_size
        except OSError:
            return
        with self._lock:
            self._queue.append(p)
            self._pending_bytes += size
            self._idle.clear()
        self._wake.set()

    def pending(self) -> tuple[int, int]:
        """(parts, bytes) waiting in the spool."""
        with self._lock:
            return len(self._queue), self._pending_bytes

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the spool to empty; True if it did."""
        self._wake.set()
        return self._idle.wait(timeout)

    # ------------------------------------------------------------ upload side
    def _run(self) -> None:
        wait = RETRY_SECONDS[0]
        while True:
            self._wake.wait(wait if self._queue else None)
            self._wake.clear()
            while True:
                with self._lock:
                    head = self._queue[0] if self._queue else None
                    if head is None:
                        self._idle.set()
                        break
                if not self._upload(head):
                    wait = min(wait * 2, RETRY_SECONDS[1])
                    break
                wait = RETRY_SECONDS[0]

    def _upload(self, path: Path) -> bool:
        """Send one part; on success drop it from the queue and the spool."""
        try:
            rel = path.relative_to(path.parents[1])  # kind=<kind>/<name>.parquet
            data = path.read_bytes()
        except (OSError, ValueError):
            self._forget(path, 0)  # gone (another process adopted it) or not a part
            return True
        try:
            fs, root = self._filesystem()
            with fs.open_output_stream(f"{root}/{rel.as_posix()}") as out:
                out.write(data)
        except Exception as exc:
            self.stats.failures += 1
            self._fs = None  # resolve again: an endpoint may come back elsewhere
            if not self._warned_unreachable:
                self._warned_unreachable = True
                log.warning(
                    "keytrace: cannot upload trace parts to %s (%s: %s); they wait in %s "
                    "and are retried. vLLM is not affected.",
                    self.shown,
                    type(exc).__name__,
                    exc,
                    self.spool,
                )
            return False
        self.stats.uploaded_parts += 1
        self.stats.uploaded_bytes += len(data)
        self._forget(path, len(data))
        with contextlib.suppress(OSError):
            path.unlink()
        return True

    def _forget(self, path: Path, size: int) -> None:
        with self._lock:
            if self._queue and self._queue[0] == path:
                self._queue.popleft()
                self._pending_bytes = max(0, self._pending_bytes - size)

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None:
            self._fs = filesystem(self.uri)
        return self._fs

    def _adopt_orphans(self) -> None:
        """Queue the closed parts of spools whose process is gone (same host): what an
        earlier process could not upload before it exited."""
        host = socket.gethostname()
        try:
            spools = [d for d in self.root.iterdir() if d.is_dir() and d != self.spool]
        except OSError:
            return
        for d in spools:
            name_host, _, pid = d.name.rpartition("-")
            if name_host != host or not pid.isdigit() or _alive(int(pid)):
                continue
            for part in sorted(d.glob("kind=*/*.parquet")):
                self.stats.adopted_parts += 1
                self.submit(part)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_UPLOADERS: dict[str, Uploader] = {}
_UPLOADERS_LOCK = threading.Lock()


def uploader_for(uri: str) -> Uploader:
    """This process's uploader to ``uri`` (made on first use)."""
    with _UPLOADERS_LOCK:
        up = _UPLOADERS.get(uri)
        if up is None:
            up = _UPLOADERS[uri] = Uploader(uri)
        return up


def uploaders() -> list[Uploader]:
    """Every uploader of this process (the metrics read their counters)."""
    with _UPLOADERS_LOCK:
        return list(_UPLOADERS.values())


# ------------------------------------------------------------------ reading
def cache_root() -> Path:
    """Where remote traces are mirrored (``KEYTRACE_CACHE_DIR``, else ~/.cache/keytrace)."""
    base = os.environ.get("KEYTRACE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "keytrace"
    )
    return Path(base) / "remote"


def mirror(uri: str, progress: Callable[[int, int], None] | None = None) -> str:
    """A local folder holding every part under ``uri`` (downloaded once: a part already in
    the cache with the object's size is kept; one no longer on the store is removed).
    Raises OSError when the store cannot be listed."""
    fs, root = filesystem(uri)
    import pyarrow.fs as pafs

    infos = [
        i
        for i in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        if i.type == pafs.FileType.File and i.path.endswith(".parquet")
    ]
    local = cache_root() / hashlib.sha256(public(uri).encode()).hexdigest()[:16]
    wanted: set[Path] = set()
    for n, info in enumerate(infos):
        rel = info.path[len(root) :].lstrip("/")
        dest = local / rel
        wanted.add(dest)
        if not (dest.exists() and dest.stat().st_size == info.size):
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            with fs.open_input_stream(info.path) as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.replace(tmp, dest)
        if progress is not None:
            progress(n + 1, len(infos))
    if local.exists():
        for stale in local.rglob("*.parquet"):
            if stale not in wanted:
                stale.unlink()
    local.mkdir(parents=True, exist_ok=True)
    return str(local)


def finish_uploads(up: Uploader, timeout: float = CLOSE_UPLOAD_SECONDS) -> bool:
    """Give ``up`` up to ``timeout`` s to empty its spool (a closing writer); if it cannot,
    say once where what is left waits. True: everything is on the store."""
    if up.drain(timeout):
        return True
    parts, size = up.pending()
    if not up.warned_left:
        up.warned_left = True
        log.warning(
            "keytrace: %d trace part(s) (%d bytes) not uploaded to %s yet; they stay in %s "
            "and the next keytrace process writing there uploads them",
            parts,
            size,
            up.shown,
            up.spool,
        )
    return False
