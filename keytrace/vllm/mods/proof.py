"""The proof keys of the candidate fix ``eagle_proof_key`` (`keytrace.vllm.mods.fixes`):
one definition that the fix looks up and stores with, and that the recorder lists for the
differ and the live alarm (`keytrace.vllm.hook.hooks.record_proofs`).

A boundary's EAGLE peek exists to prove that the stored draft KV of the boundary's last
position was computed with this request's next token; the proof key proves exactly that
(the chain hash at the boundary and that token, under the group's id).
"""

from __future__ import annotations

import hashlib
from typing import Any

PROOF_TAG = b"keytrace-eagle-proof\0"
"""Domain separation: a proof key can never equal a block hash of the same chain."""


def proof_key(req: Any, group_config: Any, chunk_idx: int, tokens_per_hash: int) -> Any:
    """The proof key for the EAGLE peek of the boundary ``b = chunk_idx * tpc``, or None when
    the request cannot prove it (no token ``b``, or no hash for the chain up to ``b``).

    A boundary's EAGLE peek exists to prove that the stored draft KV of position ``b - 1``
    was computed with this request's token ``b`` (the draft model's input there). The chain
    hash at ``b`` covers every earlier token; token ``b`` is the rest of the proof. Both
    sides compute it from the request alone, so store and lookup agree by construction.
    Multimodal and LoRA extra keys are in the chain hash up to ``b`` but not in the proof's
    last token: a sketch for review, not a drop-in for every feature."""
    from vllm.v1.kv_offload.base import make_offload_key

    b = chunk_idx * group_config.tokens_per_chunk
    hash_idx = b // tokens_per_hash - 1
    if b <= 0 or b >= req.num_tokens or hash_idx >= len(req.block_hashes):
        return None
    parent = bytes(req.block_hashes[hash_idx])
    token = int(req.all_token_ids[b]).to_bytes(8, "little", signed=True)
    digest = hashlib.sha256(PROOF_TAG + parent + token).digest()[: len(parent)]
    return make_offload_key(digest, group_config.group_idx)


def proof_groups(sched: Any) -> dict[int, Any]:
    """Group id -> config of the EAGLE/MTP sliding-window groups a proof applies to; none
    for a scheduler built without a config (vLLM's own unit tests call the scan helpers on
    bare instances: the fix then leaves every call to vLLM)."""
    configs = getattr(getattr(sched, "config", None), "kv_group_configs", None) or ()
    return {
        g.group_idx: g
        for g in configs
        if getattr(g, "is_eagle_group", False)
        and g.sliding_window_size_in_chunks is not None
        and not g.requires_cow_source
    }


def aligned(sched: Any, tokens: int) -> bool:
    align = sched.config.alignment_tokens
    return not align or tokens % align == 0


def peek_proof_key(sched: Any, req: Any, group: Any, chunk_idx: int) -> Any:
    """The proof key of the peek at chunk ``chunk_idx``, or None unless its left edge is an
    aligned boundary the request can prove: what the fix looks up and stores, and what the
    recorder lists for the differ (`keytrace.vllm.hook.hooks.record_proofs`)."""
    if not aligned(sched, chunk_idx * group.tokens_per_chunk):
        return None
    return proof_key(req, group, chunk_idx, sched.config.tokens_per_hash)


def registered_peek_proof(sched: Any, req: Any, group: Any, chunk_idx: int, ctx: Any) -> Any:
    """`peek_proof_key`, registered at the chunk's end token as vLLM registers every key it
    looks up or stores (the recorder reads positions from there)."""
    key = peek_proof_key(sched, req, group, chunk_idx)
    if key is not None:
        ctx.set_offload_key_position(key, (chunk_idx + 1) * group.tokens_per_chunk)
    return key
