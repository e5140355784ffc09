"""Reintroduce known historical store-side bugs into vLLM 0.33.0, to see how keytrace reports them.

Each injection replaces ``OffloadingConnectorScheduler._reachable_store_block_mask``, the
one place 0.33.0 decides which sliding-window chunks the store path keeps. The lookup side
is never touched, so an injected run shows exactly the store/lookup disagreement the
historical bug caused.

- ``pre48911``: the store rule vLLM PR #48911 replaced: keep sliding-window chunk ``c`` iff
  ``c % (A / tpc) >= A / tpc - W`` (A = alignment tokens, tpc = the group's tokens per
  chunk, W = its window in chunks): no EAGLE ``+1``, every segment treated as full.
- ``no_eagle_plus1``: 0.33.0's own rule with the EAGLE flag dropped on the store side only.

Switch in-process with ``with injected("pre48911"): ...`` or, in any process that builds a
harness or loads keytrace's vLLM plugin, with ``KEYTRACE_INJECT=pre48911``. This is a
testing tool: never set it on a server you care about.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("keytrace")

ENV_INJECT = "KEYTRACE_INJECT"
INJECTIONS: dict[str, str] = {
    "pre48911": "store keeps c % (A/tpc) >= A/tpc - W (the rule PR #48911 replaced)",
    "no_eagle_plus1": "store-side reachability computed as if no group were EAGLE/MTP",
}

_ACTIVE: list[tuple[Any, Any]] = []


def _pre48911(orig: Callable[..., Any]) -> Callable[..., Any]:
    def mask(
        self: Any,
        group_config: Any,
        start_chunk_idx: int,
        end_chunk_idx: int,
        final_segment_end_chunk_idx: int | None,
        reachable_boundaries: tuple[int, ...],
    ) -> list[bool] | None:
        window = group_config.sliding_window_size_in_chunks
        alignment = self.config.alignment_tokens
        tpc = group_config.tokens_per_chunk
        if window is None or group_config.requires_cow_source:
            return orig(
                self,
                group_config,
                start_chunk_idx,
                end_chunk_idx,
                final_segment_end_chunk_idx,
                reachable_boundaries,
            )
        if alignment is None or alignment % tpc:
            return None  # dense: every chunk kept, as the old code did without alignment
        per_segment = alignment // tpc
        bpc = self.config.blocks_per_chunk
        out: list[bool] = []
        for c in range(start_chunk_idx, end_chunk_idx):
            keep = c % per_segment >= per_segment - window
            out.extend([keep] * bpc)
        return out

    return mask


def _no_eagle_plus1(orig: Callable[..., Any]) -> Callable[..., Any]:
    def mask(self: Any, group_config: Any, *a: Any, **k: Any) -> list[bool] | None:
        if getattr(group_config, "is_eagle_group", False):
            group_config = group_config._replace(is_eagle_group=False)
        return orig(self, group_config, *a, **k)

    return mask


_FACTORIES = {"pre48911": _pre48911, "no_eagle_plus1": _no_eagle_plus1}


def _target() -> Any:
    from keytrace.vllm.compat import load_targets

    cls, _base, problems = load_targets()
    if problems or not hasattr(cls, "_reachable_store_block_mask"):
        raise RuntimeError(
            "cannot inject: this vLLM lacks OffloadingConnectorScheduler._reachable_store_block_mask"
        )
    return cls


def apply(name: str) -> None:
    """Install injection ``name`` for the rest of the process (idempotent per name)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown injection {name!r}; known: {', '.join(INJECTIONS)}")
    if any(n == name for n, _ in _ACTIVE):
        return
    if _ACTIVE:
        raise RuntimeError(f"injection {_ACTIVE[0][0]!r} already active; one at a time")
    cls = _target()
    original = cls.__dict__["_reachable_store_block_mask"]
    cls._reachable_store_block_mask = _FACTORIES[name](original)
    _ACTIVE.append((name, original))
    log.warning(
        "keytrace: injected historical bug %r into vLLM's store path (%s)", name, INJECTIONS[name]
    )


def remove() -> None:
    """Undo the active injection, if any."""
    while _ACTIVE:
        _name, original = _ACTIVE.pop()
        _target()._reachable_store_block_mask = original


def active() -> str | None:
    return _ACTIVE[0][0] if _ACTIVE else None


@contextlib.contextmanager
def injected(name: str | None) -> Iterator[None]:
    """Apply ``name`` inside the block (no-op for None)."""
    if not name:
        yield
        return
    apply(name)
    try:
        yield
    finally:
        remove()


def apply_from_env() -> str | None:
    """Apply ``KEYTRACE_INJECT`` if set; returns the name applied."""
    name = os.environ.get(ENV_INJECT)
    if name:
        apply(name)
    return name or None
