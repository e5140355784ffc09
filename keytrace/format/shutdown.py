"""What happens to buffered rows when the process stops: every live writer flushes at exit
(``atexit``) and on SIGTERM (without I/O in the handler: the writers' own threads flush,
vLLM's handler runs at once)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Protocol

import pyarrow as pa

from keytrace.format.remote import stop_all


class Flushing(Protocol):
    """A writer the shutdown path can flush (`keytrace.format.writer.TraceWriter`)."""

    def request_flush(self) -> None: ...
    def close(self) -> None: ...


_LIVE: weakref.WeakSet[Flushing] = weakref.WeakSet()
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
    (a kill during it cuts that last flush short: the reader sets it aside and says so). What is still buffered
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


def _import_now() -> None:
    """Make pyarrow import now what it imports on its first conversion. ``pa.array`` asks
    whether its input is a pandas object, importing pandas the first time when it is
    installed; pandas imports ``concurrent.futures.thread``, which registers an atexit hook,
    and during interpreter shutdown that raises "can't register atexit after shutdown". A
    writer whose first flush is the one at exit (vLLM's SIGTERM, a short run) then lost
    every row. Once per process, when the first writer starts."""
    with contextlib.suppress(Exception):
        pa.array([0], type=pa.int64())


def register(writer: Flushing) -> None:
    """Flush ``writer`` at exit and on SIGTERM (the hooks installed once per process)."""
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
