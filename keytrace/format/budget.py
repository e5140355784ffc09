"""The bytes of closed parts one process may write (``KEYTRACE_MAX_BYTES``): a busy server
left recording stops at its cap instead of filling its disk."""

from __future__ import annotations

import os
import threading

from keytrace.format.remote import parse_bytes

DEFAULT_MAX_BYTES = 4 << 30
"""Bytes of closed parts one process writes at most (``KEYTRACE_MAX_BYTES``): a busy
server left recording stops at 4 GiB instead of filling its disk."""
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
