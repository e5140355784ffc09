"""Candidate fixes for store/lookup disagreements keytrace found, applied to vLLM in-process.

A fix is a row of the same patch table as the injections (`keytrace.vllm.patches`), so a
sweep, a workload or a generated regression can run with it and show "with this fix: N of N
failing lengths hit, no new mismatch" on the real scheduler, before anyone patches vLLM.

Both target the stock 0.33.0 MTP peek miss (docs/findings.md): vLLM's EAGLE/MTP store tail
for a boundary ``b`` is the window shifted one chunk right, ``[b/tpc + 1 - need, b/tpc +
1)``, because a lookup at ``b`` queries the *peek* chunk ``[b, b + tpc)`` and pops it. When
the prompt ends before ``b + tpc`` the peek chunk is never keyed, so never stored.

- ``mtp_left_chunk`` keeps the chunk left of such a tail, which the MTP group's scan needs
  without a peek. Measured: the MTP group then hits, pops its last chunk, and the lookup's
  boundary becomes ``b - tpc(MTP)``, where no other group kept a tail: still 0 external
  tokens, now bound by the next sliding-window group. It shows that storing more MTP
  chunks alone cannot reach ``b``.
- ``unkeyable_peek_fallback`` makes the boundary before, ``b - A``, reachable too (every
  group keeps its tail there, the MTP group with its peek chunk, which the prompt keys), so
  the lookup's pop settles there: ``b - A`` external tokens instead of 0.

Reaching ``b`` itself needs the peek's proof without a full peek chunk (the draft KV of a
boundary's last position depends on the next token, which a full-chunk key cannot cover),
i.e. partial-tail keys on both sides; that is vLLM's to design.

Testing tool: a fix is written into every trace header, and logs a WARNING naming itself.
"""

from __future__ import annotations

from typing import Any

from keytrace.vllm.inject import _mask_args

FIXES: dict[str, str] = {
    "mtp_left_chunk": (
        "store side, EAGLE/MTP groups only: also keep the chunk left of a tail whose peek "
        "chunk the prompt cannot key"
    ),
    "unkeyable_peek_fallback": (
        "store side, every group: when the prompt cannot key the EAGLE/MTP peek chunk of its "
        "final boundary E, also keep every group's tail for the boundary before it (E - A)"
    ),
}
"""Fix name -> what it changes in vLLM's store path (shown in warnings and ``--help``)."""


def mtp_left_chunk(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    a = _mask_args(args, kwargs)
    group_config = a["group_config"]
    mask = wrapped(**a)
    if (
        mask is None
        or not getattr(group_config, "is_eagle_group", False)
        or group_config.sliding_window_size_in_chunks is None
        or group_config.requires_cow_source
    ):
        return mask
    bpc = instance.config.blocks_per_chunk
    start, end = a["start_chunk_idx"], a["end_chunk_idx"]
    # one chunk further right: is the chunk at ``end`` (which this job cannot key) a peek?
    wider = wrapped(**{**a, "end_chunk_idx": end + 1})
    if wider is None or not any(wider[(end - start) * bpc :]):
        return mask
    kept = [any(wider[i * bpc : (i + 1) * bpc]) for i in range(end + 1 - start)]
    first = end - start  # leftmost chunk of the kept run that ends at the peek
    while first > 0 and kept[first - 1]:
        first -= 1
    if first == 0:
        return mask  # the run starts before this job: its left neighbour is not ours
    out = list(mask)
    out[(first - 1) * bpc : first * bpc] = [True] * bpc
    return out


def unkeyable_peek_fallback(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """vLLM passes the prompt's last position ``P - 1`` as its reachable boundary; the mask
    rounds it down to ``E``. ``E - 1`` rounds down to ``E - A``: adding it keeps the tails of
    that boundary too, in every group, only for prompts where ``P - E < tpc(EAGLE)``."""
    a = _mask_args(args, kwargs)
    boundaries = tuple(a["reachable_boundaries"] or ())
    align = instance.config.alignment_tokens
    eagle = [
        g.tokens_per_chunk
        for g in instance.config.kv_group_configs
        if getattr(g, "is_eagle_group", False)
    ]
    if boundaries and align and eagle:
        last = boundaries[0]  # num_prompt_tokens - 1
        E = last // align * align
        if align <= E and last + 1 - E < max(eagle):
            a["reachable_boundaries"] = (*boundaries, E - 1)
    return wrapped(**a)
