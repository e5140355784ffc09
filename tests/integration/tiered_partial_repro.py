"""vLLM's CPU primary asserts on a load when a partial-tail probe's promotion evicts the
complete hit the connector has just confirmed. Imports only vLLM: run it as a script on any
vLLM with tiered offloading (``python tests/integration/tiered_partial_repro.py``, add
``--fix`` for the candidate fix); the tests import it too (tests/integration/
test_tiered_partial_tails.py, which also reproduces it on the real scheduler).

The manager calls are exactly those vLLM's connector makes on the real scheduler
(``recurrent`` geometry: three recurrent groups 0-2 and a full-attention group 3, block
64, ``--prefix-match-unit 16``, partial tails on), for three prompts, on a CPU primary of
8 chunks over the in-memory ``example`` tier:

1. A, 81 tokens, stores its complete keys at 64 (the full-attention chunk and each
   recurrent group's state) and its partial tail at 80 (one key per group): 8 chunks.
2. B, 17 tokens of another prefix, stores its tail at 16 (4 keys): the primary evicts A's
   tail (the least recent: the LRU ranks a request's keys tail first), which stays on the
   secondary tier.
3. A resend of A: the complete-chunk lookup answers HIT for the 4 keys at 64 (complete
   hit 64); the partial-tail probe at 80 finds each tail key on the secondary tier only,
   and ``TieringOffloadingManager.lookup`` promotes it, evicting the least recent idle
   chunk of the full primary: the 4 keys at 64, one per promotion. The probe is pending,
   so ``_lookup`` answers the complete hit (64) and ``update_state_after_alloc`` asks
   ``prepare_load`` for the keys at 64: ``AssertionError: Chunk ... not found in cache``.
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

NUM_PRIMARY_CHUNKS = 8
GROUPS = (0, 1, 2, 3)  # recurrent 0-2, full attention 3
FULL_ATTENTION = 3
_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _manager() -> TieringOffloadingManager:
    region = SharedOffloadRegion(
        engine_id=f"tiered-partial-{uuid.uuid4()}",
        num_chunks=NUM_PRIMARY_CHUNKS,
        rank=None,
        kv_bytes_per_chunk=mmap.PAGESIZE,
        cpu_page_size=mmap.PAGESIZE,
    )
    primary = CPUPrimaryTierOffloadingManager(num_chunks=NUM_PRIMARY_CHUNKS, mmap_region=region)
    tier = ExampleSecondaryTierManager(
        offloading_spec=None,  # unused by the example tier
        primary_kv_view=primary.get_kv_memoryview(),
        tier_type="example",
    )
    return TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])


def _keys(prefix: str, position: int) -> list[Any]:
    """One key per group at a token position (the block hash there + the group id, as
    ``make_offload_key`` builds it)."""
    return [make_offload_key(f"{prefix}@{position}".encode(), g) for g in GROUPS]


def _label(key: Any) -> str:
    """``A@64/g0``: the prompt, the token position and the group of a key of `_keys`."""
    raw = bytes(key)
    return f"{raw[:-4].decode()}/g{int.from_bytes(raw[-4:], 'big')}"


def _context(req_id: str, positions: dict[Any, int]) -> ReqContext:
    """A ReqContext with key positions, as the connector sets them
    (``RequestOffloadState.update_offload_keys``, ``_make_boundary_key``)."""
    ctx = ReqContext(req_id=req_id)
    for key, position in positions.items():
        ctx.set_offload_key_position(key, position)
    return ctx


def _store(m: TieringOffloadingManager, batches: list[list[Any]], ctx: ReqContext) -> list[Any]:
    """One request's stores as the connector issues them, completed (GPU -> primary, then
    the cascade to the example tier); returns the keys the primary evicted."""
    m.on_new_request(ctx)
    evicted: list[Any] = []
    for keys in batches:
        out = m.prepare_store(keys, ctx)
        assert out is not None
        evicted += out.evicted_keys
        m.complete_store(keys, ctx)
        m.on_schedule_end(_END)
    m.on_request_finished(ctx)
    m.on_schedule_end(_END)
    return evicted


def reproduce() -> dict[str, Any]:
    """Run the three prompts; what vLLM answered at each call of the resend's step."""
    m = _manager()
    try:
        complete, tail = _keys("A", 64), _keys("A", 80)
        a = _context("A", {**dict.fromkeys(complete, 64), **dict.fromkeys(tail, 80)})
        # the connector stores each recurrent state on its own, then the chunk, then the tail
        _store(m, [[k] for k in complete[:FULL_ATTENTION]] + [[complete[3]], tail], a)
        b_tail = _keys("B", 16)
        evicted_by_b = _store(m, [b_tail], _context("B", dict.fromkeys(b_tail, 16)))

        resend = _context("A2", {**dict.fromkeys(complete, 64), **dict.fromkeys(tail, 80)})
        m.on_new_request(resend)
        # _lookup_complete_chunks: the full-attention group first, then the recurrent ones
        order = [complete[FULL_ATTENTION], *complete[:FULL_ATTENTION]]
        complete_results = [m.lookup(k, resend).name for k in order]
        primary_before = set(m.primary_tier._policy.chunks)
        # _lookup_partial_tail at 80: every group's key, in group order
        probe_results = [m.lookup(k, resend).name for k in tail]
        evicted_by_probe = sorted(
            _label(k) for k in primary_before if k not in m.primary_tier._policy.chunks
        )
        # pending probe, complete hit 64 > 0: _lookup answers 64, and
        # update_state_after_alloc loads the keys at 64 (group order)
        error = None
        try:
            m.prepare_load(complete, resend)
        except AssertionError as exc:
            error = str(exc)
        return {
            "evicted_by_b": sorted(_label(k) for k in evicted_by_b),
            "complete_results": complete_results,
            "probe_results": probe_results,
            "evicted_by_probe": evicted_by_probe,
            "error": error,
            "missing": next((_label(k) for k in complete if error and repr(k) in error), None),
        }
    finally:
        m.shutdown()


@contextmanager
def protect_step_hits() -> Iterator[None]:
    """The candidate fix, patched in for the duration (keytrace's ``promotion_pins_prefix``
    in vLLM-only form): around each promotion, the keys the same request's lookups found
    ready in the primary during this scheduler step are pinned with vLLM's own reference
    counts (``prepare_read``/``complete_read``), so the promotion evicts other idle chunks
    or fails, and lookup then answers MISS (vLLM's answer for a primary that cannot take a
    promotion). That keeps ``prepare_load``'s contract: its callers pass keys confirmed
    HIT by lookup() earlier this step."""
    cls = TieringOffloadingManager
    lookup, promote, end = cls.lookup, cls._initiate_promotion, cls.on_schedule_end

    @functools.wraps(lookup)
    def patched_lookup(self: Any, key: Any, req_context: Any, **kw: Any) -> Any:
        result = lookup(self, key, req_context, **kw)
        if result is LookupResult.HIT:
            hits = self.__dict__.setdefault("_step_hits", {})
            hits.setdefault(req_context.req_id, {})[key] = None
        return result

    @functools.wraps(promote)
    def patched_promote(self: Any, tier_idx: int, key: Any, req_context: Any) -> Any:
        primary = self.primary_tier
        mine = self.__dict__.get("_step_hits", {}).get(req_context.req_id, {})
        pinned = [k for k in mine if (c := primary._policy.get(k)) is not None and c.is_ready]
        if not pinned:
            return promote(self, tier_idx, key, req_context)
        primary.prepare_read(pinned, req_context)
        try:
            return promote(self, tier_idx, key, req_context)
        finally:
            primary.complete_read(pinned, req_context)

    @functools.wraps(end)
    def patched_end(self: Any, context: Any) -> None:
        self.__dict__.pop("_step_hits", None)
        end(self, context)

    cls.lookup = patched_lookup  # type: ignore[method-assign]
    cls._initiate_promotion = patched_promote  # type: ignore[method-assign]
    cls.on_schedule_end = patched_end  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.lookup, cls._initiate_promotion, cls.on_schedule_end = lookup, promote, end  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", action="store_true", help="with the candidate fix patched in")
    args = parser.parse_args()
    import vllm

    if args.fix:
        with protect_step_hits():
            found = reproduce()
    else:
        found = reproduce()
    print(json.dumps({"version": vllm.__version__, "fix": args.fix, **found}))


if __name__ == "__main__":
    main()
