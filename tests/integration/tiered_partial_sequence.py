"""The minimal sequence of requests that makes vLLM's CPU primary assert on a load under
a tiered manager with partial tails, on the real scheduler (the lab's harness, recording
off), for test_tiered_partial_tails.py; 0.34.0 runs it from its source tree in a fresh
interpreter. tiered_partial_repro.py is the same at the manager level, importing only
vLLM.

``recurrent`` geometry (recurrent groups 0-2, full-attention group 3, block 64), hash unit
16 (``--prefix-match-unit 16``: partial tails on), a CPU primary of 8 chunks over ``tier``:

1. A, 81 tokens: the complete keys at 64 (group 3's chunk, groups 0-2's states) and the
   tail at 80 (a key per group) fill the primary; all of them reach the tier.
2. B, 17 tokens of another prefix, stores its tail at 16 (4 keys) and evicts A's tail
   (the LRU ranks a request's keys tail first). Its stores stay in flight (a worker slow
   to acknowledge them): its chunks are not idle, so A's keys at 64 are the only idle ones.
3. R, a resend of A (GPU prefix cache reset): the complete-chunk lookup finds the keys at
   64 HIT; the probe of the tail at 80 finds each key on the tier only and the tiered
   manager promotes it, evicting a key at 64 each time; the probe is pending, the lookup
   answers the complete hit (64), and ``update_state_after_alloc``'s ``prepare_load``
   asks the primary for the evicted keys.

The ``example`` tier answers a lookup at once: R's first lookup asserts. The ``fs`` tier
answers asynchronously (RETRY the first time: the lookup then serves the complete hit),
so there R's first lookup loads 64 and leaves the tier's answer for the tail in; R is
then preempted (vLLM's ``reset_prefix_cache(reset_running_requests=True)``, as a server's
reset endpoint does), and its next lookup asserts.
"""

from __future__ import annotations

import traceback
from typing import Any

from keytrace.analysis.geometry import RECURRENT
from keytrace.vllm.hook.patches import fixed
from keytrace.vllm.lab.config import tiered
from keytrace.vllm.lab.harness import Harness

PROMPT = 81  # a complete chunk (64) and a tail at 80
OTHER = 17  # a tail at 16: 4 keys, as many as A's tail
CPU_CHUNKS = 8  # A's keys, exactly
HASH_UNIT = 16


def _key_groups(h: Harness, hashes: list[Any], position: int) -> list[int]:
    """The groups whose key at ``position`` of a request (its block ``hashes``) the
    primary holds."""
    from vllm.v1.kv_offload.base import make_offload_key

    held = h.cpu_keys()
    return [
        g for g in range(4) if bytes(make_offload_key(hashes[position // HASH_UNIT - 1], g)) in held
    ]


def run(tier: str, fix: bool = False) -> dict[str, Any]:
    """The sequence on ``tier`` (``example`` or ``fs``); with ``fix``, keytrace's candidate
    fix ``promotion_pins_prefix`` (keytrace.vllm.mods.fixes) active for the resend. What
    vLLM did, as JSON data."""
    geo = tiered(RECURRENT.with_(prefix_match_unit=HASH_UNIT, cpu_chunks=CPU_CHUNKS), (tier,))
    h = Harness(geo, max_prompt_tokens=128)
    found: dict[str, Any] = {"tier": tier, "fix": fix, "error": None, "raised_in": []}
    try:
        h.submit(PROMPT, chain=0)
        h.run_until_idle()
        h.reset_gpu_prefix_cache()
        found["a_in_primary"] = len(h.cpu_keys())
        h.worker.store_delay = 20
        h.submit(OTHER, chain=1)
        for _ in range(3):  # scheduled, computed, its store prepared
            h.step()
        rid = h.submit(PROMPT, chain=0, max_tokens=8)
        hashes = h.scheduler.requests[rid].block_hashes
        found["before"] = {"64": _key_groups(h, hashes, 64), "80": _key_groups(h, hashes, 80)}
        try:
            with fixed("promotion_pins_prefix" if fix else None):
                _resend(h, tier)
        except AssertionError as exc:
            found["error"] = str(exc)
            found["raised_in"] = [f.name for f in traceback.extract_tb(exc.__traceback__)]
            found["missing_group0_at_64"] = _names_key(hashes, str(exc))
        found["after"] = {"64": _key_groups(h, hashes, 64), "80": _key_groups(h, hashes, 80)}
        obs = h.observations[rid]
        found["lookups"] = [list(x) for x in obs.lookups]
        found["accepted"] = list(obs.accepted)
        found["finished"] = rid not in h.scheduler.requests
    finally:
        h.close()
    return found


def _resend(h: Harness, tier: str) -> None:
    if tier == "fs":
        for _ in range(2):  # the lookup (the tier answers RETRY), the load, the prefill
            h.step()
        if not h.flush_gpu_cache():
            raise RuntimeError("the resend could not be preempted")
    h.worker.store_delay = 1
    h.run_until_idle()


def _names_key(hashes: list[Any], message: str) -> bool:
    """The message names R's group-0 key at 64 (its recurrent state there)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return repr(make_offload_key(hashes[64 // HASH_UNIT - 1], 0)) in message
