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
and the reader reports the gap once a later part arrives (its flush number skips; drops at
the very end of a trace leave no sign but the metric). At exit the uploader gets `CLOSE_UPLOAD_SECONDS` to
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
import stat
import tempfile
import threading
import time
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


def shown(path: str | os.PathLike[str]) -> str:
    """A trace location as logs and messages may show it: a URI without credentials or
    query (`public`), a local path as it is."""
    text = os.fspath(path)
    return public(text) if is_remote(text) else text


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, root path inside it) of ``uri``."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(uri)
    return fs, root.rstrip("/")


def spool_root(uri: str) -> Path:
    """Where parts for ``uri`` wait on this host: ``KEYTRACE_SPOOL_DIR`` or the temp dir's
    ``keytrace-spool-<uid>``, one folder per URI. The folders are made 0700 and must be
    this user's (`_private`): what waits there is uploaded with this user's credentials."""
    base = os.environ.get("KEYTRACE_SPOOL_DIR") or os.path.join(
        tempfile.gettempdir(), f"keytrace-spool-{os.getuid()}"
    )
    return Path(base) / hashlib.sha256(public(uri).encode()).hexdigest()[:16]


def _private(folder: Path) -> None:
    """Make ``folder`` (and its parent) 0700 and refuse one that is another user's or a
    symbolic link: nobody else may plant parts that this process would upload."""
    for d in (folder.parent, folder):
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{d} is not a folder of this user's; not spooling there")
        if st.st_mode & 0o077:
            os.chmod(d, 0o700)


def parse_bytes(text: str | None, default: int, name: str = "KEYTRACE_MAX_BYTES") -> int:
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
        self.root.parent.parent.mkdir(parents=True, exist_ok=True)
        _private(self.root)
        _private(self.spool)
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
        self._retry_at = 0.0
        """While the store is away: when the next attempt may start (backoff; neither a
        new part nor a drain brings it forward, only `stop`'s last try does)."""
        self._stopping = False
        self._deadline: float | None = None
        """Set by the first closing writer (`finish_uploads`): every later one waits only
        until then, so an exit with many writers waits `CLOSE_UPLOAD_SECONDS` once."""
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
        """Wait up to ``timeout`` s for the spool to empty (one attempt now, backoff or
        not: a closing writer's last chance); True if it did."""
        self._retry_at = 0.0
        self._wake.set()
        return self._idle.wait(timeout)

    def stop(self) -> None:
        """No new attempt after the one in flight (process exit: pyarrow's S3 layer is
        finalised after this); waits for that one up to the closing deadline."""
        self._stopping = True
        self._wake.set()
        left = 0.0 if self._deadline is None else self._deadline - time.monotonic()
        self._thread.join(timeout=max(0.0, left))

    # ------------------------------------------------------------ upload side
    def _run(self) -> None:
        wait = RETRY_SECONDS[0]
        while not self._stopping:
            delay = max(0.0, self._retry_at - time.monotonic())
            self._wake.wait(delay if delay > 0 or self._queue else None)
            self._wake.clear()
            if self._stopping or time.monotonic() < self._retry_at:
                continue  # woken by a new part or a drain while backing off
            while not self._stopping:
                with self._lock:
                    head = self._queue[0] if self._queue else None
                    if head is None:
                        self._idle.set()
                        break
                if not self._upload(head):
                    self._retry_at = time.monotonic() + wait
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
        """Queue the closed parts of spools whose process is gone (same host), and those in
        this process's own folder (a restarted container often has the same host name and
        pid as the one that died): what an earlier process could not upload before it
        exited. Only this user's folders, never through a symbolic link."""
        host, me = socket.gethostname(), os.getuid()
        try:
            spools = sorted(self.root.iterdir())
        except OSError:
            return
        for d in spools:
            name_host, _, pid = d.name.rpartition("-")
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or name_host != host:
                continue
            if d != self.spool and (not pid.isdigit() or _alive(int(pid))):
                continue
            # in write order (a writer numbers its parts across kinds): a reader meanwhile
            # sees a prefix of each flush, never lookups without their stores
            for part in sorted(d.glob("kind=*/*.parquet"), key=lambda q: (q.name, q.parent.name)):
                if not part.is_symlink() and os.lstat(part).st_uid == me:
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


def _forget_in_child() -> None:
    """A forked child has no uploader threads: it makes its own on first use."""
    _UPLOADERS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def stop_all() -> None:
    """Stop every uploader (at exit, after the writers closed: `finish_uploads` ran)."""
    for up in uploaders():
        up.stop()


def uploaders() -> list[Uploader]:
    """Every uploader of this process (the metrics read their counters)."""
    with _UPLOADERS_LOCK:
        return list(_UPLOADERS.values())


# ------------------------------------------------------------------ reading
def keytrace_cache() -> Path:
    """keytrace's own cache folder on this machine (``KEYTRACE_CACHE_DIR``, else
    ~/.cache/keytrace): remote traces' mirrors, the oracle's verifications."""
    base = os.environ.get("KEYTRACE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "keytrace"
    )
    return Path(base)


def cache_root() -> Path:
    """Where remote traces are mirrored (`keytrace_cache`/remote)."""
    return keytrace_cache() / "remote"


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
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{threading.get_ident()}.tmp")
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
    """Give ``up`` until ``timeout`` s after the first closing writer to empty its spool;
    if it cannot, say once where what is left waits. True: everything is on the store."""
    if up._deadline is None:
        up._deadline = time.monotonic() + timeout
    if up.drain(max(0.0, up._deadline - time.monotonic())):
        return True
    parts, size = up.pending()
    if not up.warned_left:
        up.warned_left = True
        log.warning(
            "keytrace: %d trace part(s) (%d bytes) not uploaded to %s yet; they stay under "
            "%s and the next keytrace process writing there from this host uploads them",
            parts,
            size,
            up.shown,
            up.root,
        )
    return False
