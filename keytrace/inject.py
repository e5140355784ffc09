"""Placeholder replaced below (historical-bug injector)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def injected(name: str | None) -> Iterator[None]:
    if name:
        raise ValueError(f"unknown injection {name!r}")
    yield
