"""Candidate fixes for store/lookup disagreements keytrace found, applied to vLLM in-process.

A fix is a row of the same patch table as the injections (`keytrace.vllm.hook.patches`), so a
sweep, a workload or a generated regression can run with it and show "with this fix: N of N
failing lengths hit, no new mismatch" on the real scheduler, before anyone patches vLLM.

The first three target the stock 0.33.0 MTP peek miss (docs/findings.md): vLLM's EAGLE/MTP
store tail for a boundary ``b`` is the window shifted one chunk right, ``[b/tpc + 1 - need,
b/tpc + 1)``, because a lookup at ``b`` queries the *peek* chunk ``[b, b + tpc)`` and pops it. When
the prompt ends before ``b + tpc`` the peek chunk is never keyed, so never stored.

- ``mtp_left_chunk`` keeps the chunk left of such a tail, which the MTP group's scan needs
  without a peek. Measured: the MTP group then hits, pops its last chunk, and the lookup's
  boundary becomes ``b - tpc(MTP)``, where no other group kept a tail: still 0 external
  tokens, now bound by the next sliding-window group. It shows that storing more MTP
  chunks alone cannot reach ``b``.
- ``unkeyable_peek_fallback`` makes the boundary before, ``b - A``, reachable too (every
  group keeps its tail there, the MTP group with its peek chunk, which the prompt keys), so
  the lookup's pop settles there: ``b - A`` external tokens instead of 0.
- ``eagle_proof_key`` reaches ``b`` itself, on both sides. What the peek proves is that the
  draft KV of the boundary's last position was computed with the same *next token*: that
  position's draft input is token ``b``. A full peek chunk proves it with ``tpc - 1``
  tokens too many; the fix adds a *proof key* that proves exactly that: the chain hash at
  ``b`` and token ``b``, under the group's id. Store writes it for every peek vLLM's own
  mask keeps (from the peek's GPU block, never loaded: lookup pops a peek), including the
  one the prompt cannot key; lookup accepts it where the full peek misses. That also
  closes junction misses: a shared prefix's peek is otherwise keyed by one conversation's
  continuation. Measured: every failing length reaches ``b``, no new mismatch, and none on
  realistic traffic (docs/findings.md).

``window_minus_one`` targets the second disagreement `keytrace fuzz` found, windows of
``k * tpc + 1`` tokens: the lookup asks for ``cdiv(w, tpc)`` chunks where the store keeps the
``w - 1`` tokens of context a query attends to; with it the lookup asks for those.

``promotion_pins_prefix`` targets the tiered livelock (docs/findings.md): vLLM 0.33.0's
``TieringOffloadingManager`` promotes each on-disk key a lookup finds into a CPU-tier slot
(``prepare_write``), which evicts the least recently used idle keys, and those can be keys
the same lookup found a moment before (``prepare_store`` protects only the key it
stores; lookups pin nothing). A request whose needed chunks barely fit, or do not fit, the
CPU tier then promotes its own prefix out, is deferred, looks up again, and never runs. The
fix pins, around each promotion, the keys the same request found ready in the CPU tier in
this scheduler step (vLLM's own ``prepare_read``/``complete_read`` reference counts), so
the promotion takes other room or fails: vLLM then answers MISS, its designed answer when
the CPU tier is full, and the request runs with what it has.

``lookahead_replay_boundary`` targets vLLM 0.34.0's resend hole under lookahead hashes (L >=
2): a resend keys ``(P - L) // tph`` blocks, so its lookup reaches ``(P - L) // A * A``,
below the replay boundary where the windows' tails are kept when ``P mod A`` is in ``[1, L -
1]``; the store also keeps them at ``P - L``.

Fixes combine (``--fix eagle_proof_key,window_minus_one``). Testing tool: a fix is written
into every trace header, and logs a WARNING naming itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from keytrace.format.keys import key_gid
from keytrace.vllm.mods.inject import _mask_args
from keytrace.vllm.mods.proof import aligned, proof_groups, registered_peek_proof


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


def lookahead_replay_boundary(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Under lookahead hashes (vLLM 0.34.0, ``num_hash_lookahead_tokens`` = L) each block
    hash covers the next L tokens, so a resend of a P-token prompt keys ``(P - L) // tph``
    blocks and its lookup reaches ``(P - L) // A * A`` at most. vLLM keeps the windows'
    tails at its replay boundary ``P - 1`` only, which rounds down one chunk higher exactly
    when ``P mod A`` is in ``[1, L - 1]`` (docs/findings.md): the resend then finds no
    window and gets 0. This adds ``P - L`` as a reachable boundary of every sliding-window
    group, so the tail the resend can reach is kept too (the replay boundary stays: a longer
    prompt extending this one keys it). Full-attention groups keep every chunk anyway;
    recurrent groups are left alone (their state exists only where a request computed one)."""
    a = _mask_args(args, kwargs)
    boundaries = tuple(a["reachable_boundaries"] or ())
    group = a["group_config"]
    lookahead = _lookahead_tokens(instance)
    if (
        boundaries
        and lookahead > 1
        and group.sliding_window_size_in_chunks is not None
        and not group.requires_cow_source
    ):
        last = boundaries[0]  # vLLM's replay boundary, num_prompt_tokens - 1
        a["reachable_boundaries"] = (*boundaries, last + 1 - lookahead)
    return wrapped(**a)


def _lookahead_tokens(sched: Any) -> int:
    """L of this connector: the scheduler keeps only the switch (``use_lookahead_block_hashes``);
    the count rides on its events tracker, the one place vLLM 0.34.0 hands it in."""
    if not getattr(sched, "use_lookahead_block_hashes", False):
        return 0
    tracker = getattr(sched, "_events_tracker", None)
    return int(getattr(tracker, "num_hash_lookahead_tokens", 0) or 0)


# ------------------------------------------------------------------ eagle_proof_key
def lookup_with_unkeyable_peek(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``_lookup_complete_chunks``: while it runs, an EAGLE group whose keyed chunks end
    inside the prompt gets the proof key of its first unkeyed chunk as its last key, so
    vLLM's own arithmetic queries it as the peek of the boundary at its left edge (and
    caps that boundary by every other group's, as for any peek)."""
    req_status = args[0] if args else kwargs["req_status"]
    req = req_status.req
    added: list[list[Any]] = []
    for gid, g in proof_groups(instance).items():
        keys = req_status.group_states[gid].offload_keys
        key = registered_peek_proof(instance, req, g, len(keys), req_status.req_context)
        if key is not None:  # None too when the prompt ends at the keyed chunks
            keys.append(key)
            added.append(keys)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for keys in added:
            keys.pop()  # the proof is never a loadable chunk: gone before allocation


_SCAN_ARGS = ("keys", "sliding_window_size", "req_context", "initial_window_size")


def scan_with_proof(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``_sliding_window_lookup`` for an unverified EAGLE group (window + 1 chunks): vLLM's
    right-to-left scan, except that a run of ``window`` hits whose peek chunk missed is
    completed by the peek's proof key. Every other call is vLLM's, untouched."""
    a = dict(zip(_SCAN_ARGS, args, strict=False))
    a.update(kwargs)
    keys: Sequence[Any] = a["keys"]
    keyed = bool(keys) and isinstance(keys[0], bytes)
    group = proof_groups(instance).get(key_gid(keys[0])) if keyed else None
    if group is None or a["sliding_window_size"] != group.sliding_window_size_in_chunks + 1:
        return wrapped(*args, **kwargs)
    ctx = a["req_context"]
    pos = ctx.get_offload_key_position(keys[0])
    status = instance._req_status.get(ctx.req_id)
    if pos is None or status is None:
        return wrapped(*args, **kwargs)
    first_chunk = pos // group.tokens_per_chunk - 1
    return _scan(
        instance,
        keys,
        a["sliding_window_size"],
        ctx,
        a.get("initial_window_size"),
        lambda idx: registered_peek_proof(instance, status.req, group, first_chunk + idx, ctx),
    )


def _scan(
    sched: Any,
    keys: Sequence[Any],
    sliding_window_size: int,
    req_context: Any,
    initial_window_size: int | None,
    proof_for: Any,
) -> int | None:
    """vLLM 0.33.0's ``_sliding_window_lookup``, line for line, plus the proof branch."""
    from vllm.v1.kv_offload.base import LookupResult

    defer_lookup = False
    pending_in_window = False
    consecutive_hits = 0
    required_window = initial_window_size or sliding_window_size
    for idx in range(len(keys) - 1, -1, -1):
        match sched.manager.lookup(keys[idx], req_context):
            case LookupResult.HIT:
                consecutive_hits += 1
            case LookupResult.HIT_PENDING:
                pending_in_window = True
                consecutive_hits += 1
            case LookupResult.RETRY:
                defer_lookup = True
                consecutive_hits = 0
                pending_in_window = False
                required_window = sliding_window_size
            case LookupResult.MISS:
                consecutive_hits = 0
                pending_in_window = False
                required_window = sliding_window_size
        if consecutive_hits == required_window:
            return None if defer_lookup or pending_in_window else idx + required_window
        if consecutive_hits == required_window - 1:
            # the chunk right of this run did not hit: is it proven instead?
            match _proven(sched, keys, idx + consecutive_hits, req_context, proof_for):
                case LookupResult.HIT:
                    return None if defer_lookup or pending_in_window else idx + required_window
                case LookupResult.HIT_PENDING:
                    return None
                case LookupResult.RETRY:
                    defer_lookup = True
    # vLLM accepts a run that reaches the first queried chunk whole (what lies before it is
    # computed or the prompt's start): its peek may be proven too
    if not (defer_lookup or pending_in_window) and consecutive_hits > 0:
        match _proven(sched, keys, consecutive_hits, req_context, proof_for):
            case LookupResult.HIT:
                return consecutive_hits + 1
            case LookupResult.HIT_PENDING | LookupResult.RETRY:
                return None
    return None if defer_lookup or pending_in_window else consecutive_hits


def _proven(sched: Any, keys: Sequence[Any], peek: int, req_context: Any, proof_for: Any) -> Any:
    """The lookup result of the proof of ``keys[peek]`` (a queried chunk that did not
    hit), or None when there is none to look up."""
    if peek >= len(keys):
        return None
    key = proof_for(peek)
    if key is None or key == keys[peek]:
        return None
    return sched.manager.lookup(key, req_context)


def store_peek_proofs(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``_build_store_jobs``: vLLM's jobs, plus one job per request with the proof key of
    every EAGLE peek chunk vLLM's store mask keeps: the peeks this step's store pass covered
    (a junction's peek is keyed by *this* request's continuation, which another request
    sharing the prefix does not have) and, in the step the prompt completes, the peek the
    prompt cannot key. Each proof is written from its chunk's GPU block (never loaded)."""
    out = args[0] if args else kwargs["scheduler_output"]
    groups = proof_groups(instance)
    before: dict[str, dict[int, int]] = {}
    for req_id in out.num_scheduled_tokens if groups else ():
        status = instance._req_status.get(req_id)
        if status is not None:
            before[req_id] = {gid: status.group_states[gid].next_stored_chunk_idx for gid in groups}
    store_jobs = wrapped(*args, **kwargs)
    for req_id, starts in before.items():
        status = instance._req_status.get(req_id)
        if status is None:
            continue
        req = status.req
        P = req.num_prompt_tokens
        done = (
            req.num_computed_tokens
            < P
            <= req.num_computed_tokens + out.num_scheduled_tokens[req_id]
        )
        proofs: list[tuple[Any, int, Any, list[int]]] = []
        for gid, g in groups.items():
            covered = range(starts[gid], status.group_states[gid].next_stored_chunk_idx)
            unkeyable = [P // g.tokens_per_chunk] if done and P % g.tokens_per_chunk else []
            for j in (*covered, *unkeyable):
                proof = _kept_peek_proof(instance, status, g, j)
                if proof is not None:
                    proofs.append((g, j, *proof))
        if proofs:
            _store_proofs(instance, store_jobs, status, proofs)
    return store_jobs


def _kept_peek_proof(sched: Any, status: Any, g: Any, j: int) -> tuple[Any, list[int]] | None:
    """(proof key, GPU blocks) if chunk ``j`` is a peek vLLM's store mask keeps, else None."""
    req = status.req
    b = j * g.tokens_per_chunk
    if (
        b <= 0
        or not aligned(sched, b)
        or sched._calc_num_offloadable_tokens(status, req.num_prompt_tokens) <= b
    ):
        return None
    reachable: tuple[int, ...] = ()
    if sched.config.retention_interval is not None:
        reachable = (req.num_prompt_tokens - 1,)
        if req.shared_prefix_boundary:
            reachable += (req.shared_prefix_boundary,)
    mask = sched._reachable_store_block_mask(g, j, j + 1, None, reachable)
    if mask is not None and not any(mask):
        return None  # vLLM's store keeps no peek here: nothing to prove
    bpc = sched.config.blocks_per_chunk
    gpu = status.group_states[g.group_idx].block_ids[j * bpc : (j + 1) * bpc]
    if not gpu or gpu[0] == 0:
        return None  # the block holding token b is gone (or was never there)
    key = registered_peek_proof(sched, req, g, j, status.req_context)
    return None if key is None else (key, [bid for bid in gpu if bid != 0])


def _store_proofs(
    sched: Any,
    store_jobs: dict[int, Any],
    status: Any,
    proofs: list[tuple[Any, int, Any, list[int]]],
) -> None:
    """One store job for ``proofs`` ((group, chunk, key, GPU blocks)), registered exactly as
    vLLM's store path registers its own (0.33.0's ``_build_store_jobs``, its tail)."""
    import sys

    if any(
        not (sched._jobs[j].is_store or sched._jobs[j].is_sync_load) for j in status.transfer_jobs
    ):
        return  # vLLM issues no store while a load is pending
    req = status.req
    stored = sched.manager.prepare_store([key for _, _, key, _ in proofs], status.req_context)
    if stored is None or not stored.keys_to_store:
        return
    keep = set(stored.keys_to_store)
    src: list[int] = []
    sizes: list[int] = []
    starts: list[int] = []
    bpc = sched.config.blocks_per_chunk
    for c in sched.config.kv_group_configs:
        mine = [
            (j, key, blocks)
            for g, j, key, blocks in proofs
            if g.group_idx == c.group_idx and key in keep
        ]
        sizes.append(sum(len(blocks) for _, _, blocks in mine))
        starts.append(mine[0][0] * bpc if mine else 0)
        for j, key, blocks in mine:
            src.extend(blocks)
            sched._events_tracker.record_store(req, c, j, key)
    m = sys.modules[type(sched).__module__]  # vLLM's own job types
    job_id = sched._generate_job_id()
    status.transfer_jobs.add(job_id)
    for bid in src:  # sliding-window blocks may be freed before the request finishes
        sched._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
    sched._jobs[job_id] = m.TransferJobStatus(
        req_id=req.request_id,
        pending_count=sched.config.num_workers,
        keys=keep,
        is_store=True,
        deferred_fence_block_ids=[],
        fenced_block_ids=src,
    )
    store_jobs[job_id] = m.TransferJob(
        req_id=req.request_id,
        src_spec=m.GPULoadStoreSpec(src, group_sizes=sizes, block_indices=starts),
        dst_spec=stored.store_spec,
    )


# ------------------------------------------------------------------ window_minus_one
def window_minus_one(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``get_sliding_window_size_in_chunks(kv_cache_spec, tokens_per_chunk)`` for the
    window-plus-one class (docs/findings.md): vLLM's own answer is ``max(cdiv(w, tpc),
    cdiv(w - 1 + extra, tpc))``; a query at a boundary attends to the ``w - 1`` tokens
    before it, which is what the store side keeps (``SlidingWindowManager``), so the
    first term asks for one chunk more exactly when ``(w - 1) mod tpc == 0``. The load
    window (``load_window_size_in_chunks``) already counts ``w - 1``. Other specs: vLLM's
    answer."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = args[0] if args else kwargs["kv_cache_spec"]
    tpc = args[1] if len(args) > 1 else kwargs["tokens_per_chunk"]
    out = wrapped(*args, **kwargs)
    if out is None or not isinstance(spec, SlidingWindowSpec):
        return out
    context = spec.sliding_window - 1 + spec.extra_retained_tokens
    return max(1, -(-context // tpc))


# ------------------------------------------------------------------ promotion_pins_prefix
_PRIMARY_HITS: weakref.WeakKeyDictionary[Any, dict[str, list[Any]]] = weakref.WeakKeyDictionary()
"""Tiered manager -> request id -> the keys its lookups found ready in the CPU tier during
the current scheduler step (cleared at ``on_schedule_end``)."""


def note_primary_hits(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``TieringOffloadingManager.lookup(key, req_context, *, exclude_tier_idx)``: vLLM's
    answer; a HIT (ready in the CPU tier) is remembered for the request."""
    from vllm.v1.kv_offload.base import LookupResult

    result = wrapped(*args, **kwargs)
    if result is LookupResult.HIT:
        key = args[0] if args else kwargs["key"]
        ctx = args[1] if len(args) > 1 else kwargs["req_context"]
        _PRIMARY_HITS.setdefault(instance, {}).setdefault(ctx.req_id, []).append(key)
    return result


def promote_pinning_prefix(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``TieringOffloadingManager._initiate_promotion(tier_idx, key, req_context)`` with
    the request's CPU-tier hits of this step pinned (those still there and ready), so
    ``prepare_write`` evicts other keys or returns None."""
    ctx = args[2] if len(args) > 2 else kwargs["req_context"]
    primary = instance.primary_tier
    policy = primary._policy
    mine = _PRIMARY_HITS.get(instance, {}).get(ctx.req_id, [])
    pinned = []
    for key in dict.fromkeys(mine):
        chunk = policy.get(key)
        if chunk is not None and chunk.is_ready:
            pinned.append(key)
    if not pinned:
        return wrapped(*args, **kwargs)
    primary.prepare_read(pinned, ctx)
    try:
        return wrapped(*args, **kwargs)
    finally:
        primary.complete_read(pinned, ctx)


def forget_primary_hits(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``TieringOffloadingManager.on_schedule_end``: a new step's lookups start afresh."""
    _PRIMARY_HITS.pop(instance, None)
    return wrapped(*args, **kwargs)
