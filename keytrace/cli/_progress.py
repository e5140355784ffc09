"""A one-line progress display on stderr (only used when asked or on a terminal)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def progress_printer() -> Callable[[str, int, int], None]:
    start = time.monotonic()
    last = [0.0]

    def show(stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < 0.2 and done < total:
            return
        last[0] = now
        sys.stderr.write(f"\r\x1b[Kkeytrace: {stage} {done:,}/{total:,} ({now - start:.1f}s)")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show
