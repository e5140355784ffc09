"""Historical store-side bugs, reintroduced into vLLM 0.33.0 to see how keytrace reports them.

Each injection replaces ``OffloadingConnectorScheduler._reachable_store_block_mask``, the one
place 0.33.0 decides which sliding-window chunks the store path keeps. The lookup side is
never touched, so an injected run shows exactly the store/lookup disagreement the historical
bug caused. The functions here are wrapt-style wrappers; `keytrace.vllm.hook.patches` lists them
as rows of its one patch table and applies and undoes them.

- ``pre48911``: the store rule vLLM PR #48911 replaced: keep sliding-window chunk ``c`` iff
  ``c % (A / tpc) >= A / tpc - W`` (A = alignment tokens, tpc = the group's tokens per
  chunk, W = its window in chunks): no EAGLE ``+1``, every segment treated as full.
- ``no_eagle_plus1``: 0.33.0's own rule with the EAGLE flag dropped on the store side only.
- ``short_window_tail``: 0.33.0's rule, then one chunk fewer of every sliding-window tail
  kept: bites every geometry, including equal block sizes, where an alignment segment is a
  single chunk and the pre-#48911 rule keeps everything.

This is a testing tool: never set ``KEYTRACE_INJECT`` on a server you care about. An active
injection logs a WARNING naming itself and is written into every trace header.
"""

from __future__ import annotations

from typing import Any

from keytrace.vllm.mods.catalog import INJECTIONS

__all__ = ["INJECTIONS", "no_eagle_plus1", "pre48911", "short_window_tail"]

MASK_ARGS = (
    "group_config",
    "start_chunk_idx",
    "end_chunk_idx",
    "final_segment_end_chunk_idx",
    "reachable_boundaries",
)


def _mask_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(MASK_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


def pre48911(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = _mask_args(args, kwargs)
    group_config = a["group_config"]
    window = group_config.sliding_window_size_in_chunks
    alignment = instance.config.alignment_tokens
    tpc = group_config.tokens_per_chunk
    if window is None or group_config.requires_cow_source:
        return wrapped(*args, **kwargs)
    if alignment is None or alignment % tpc:
        return None  # dense: every chunk kept, as the old code did without alignment
    per_segment = alignment // tpc
    bpc = instance.config.blocks_per_chunk
    out: list[bool] = []
    for c in range(a["start_chunk_idx"], a["end_chunk_idx"]):
        out.extend([c % per_segment >= per_segment - window] * bpc)
    return out


def no_eagle_plus1(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    a = _mask_args(args, kwargs)
    group_config = a["group_config"]
    if getattr(group_config, "is_eagle_group", False):
        a["group_config"] = group_config._replace(is_eagle_group=False)
    return wrapped(**a)


def short_window_tail(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Drop the leftmost kept chunk of every run of kept sliding-window chunks.

    vLLM asks for the mask of ``[start, end)`` one store job at a time, so a run may begin
    before ``start``: the stock mask is taken from one chunk further left to know.
    """
    a = _mask_args(args, kwargs)
    group_config = a["group_config"]
    if group_config.sliding_window_size_in_chunks is None or group_config.requires_cow_source:
        return wrapped(**a)
    bpc = instance.config.blocks_per_chunk
    start, end = a["start_chunk_idx"], a["end_chunk_idx"]
    lo = max(start - 1, 0)
    mask = wrapped(**{**a, "start_chunk_idx": lo})
    if mask is None:
        mask = [True] * ((end - lo) * bpc)
    keep = [any(mask[i * bpc : (i + 1) * bpc]) for i in range(end - lo)]
    out = list(mask)
    for i, k in enumerate(keep):
        if k and (lo + i == 0 or (i > 0 and not keep[i - 1])):
            out[i * bpc : (i + 1) * bpc] = [False] * bpc
    return out[(start - lo) * bpc :]
