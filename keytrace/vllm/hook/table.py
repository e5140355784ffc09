"""Every patch keytrace makes on vLLM: one table (`TABLE`), applied and undone in one place
(`keytrace.vllm.hook.layers`).

A row (`keytrace.vllm.hook.layers.Patch`) names

- its *feature*: ``record`` (the recorder's observers), ``inject:<name>`` (a historical store
  bug, `keytrace.vllm.mods.inject`), ``fix:<name>`` (a candidate fix, `keytrace.vllm.mods.fixes`),
  ``harness`` (the CPU harness's own observers), ``lab`` (what the CPU lab needs from vLLM's
  CPU platform to build a config at all; switched on only around the lab's own
  ``VllmConfig`` constructions, `keytrace.vllm.hook.patches.lab_platform`);
- its *target*: ``scheduler`` is a class attribute of ``OffloadingConnectorScheduler``,
  applied when the feature is enabled; ``config`` a function of vLLM's offloading config
  module (read when a connector is built), and ``tiering_class`` an attribute of the class
  ``TieringOffloadingManager`` (a candidate fix: managers built afterwards have it), applied
  the same way, as is ``platform``, an attribute of vLLM's ``CpuPlatform`` class;
  ``manager`` and ``connector`` are attributes of one *instance*, applied as
  each instance appears (the manager when a recorded scheduler is built, the connector when
  a harness is built). The manager is never patched at class level: tiering managers alias
  ``prepare_write = self.prepare_store`` on their primary tier, and a class patch would
  record tier promotions as stores. A tiered manager also gets its ``tiering`` rows (what it
  does below its public methods), its primary tier the ``primary`` rows (the promotion
  aliases) and each secondary tier the ``tier`` rows;
- the attribute, and a factory that makes the wrapper (given the instance's binding).
"""

from __future__ import annotations

from collections.abc import Mapping

from keytrace.vllm.hook import hooks
from keytrace.vllm.hook.bootstrap import record_init
from keytrace.vllm.hook.layers import Patch, Wrapper, register_table
from keytrace.vllm.hook.wrappers import (
    notify,
    observe,
    observe_hot,
    observe_iter,
    replace,
    with_triton_seen,
)
from keytrace.vllm.mods import catalog, fixes, inject


def _store_mask_rows(
    kind: str, fns: dict[str, Wrapper], known: Mapping[str, str]
) -> tuple[Patch, ...]:
    """Rows that replace the store path's mask (``kind`` "inject" or "fix"), one a name."""
    assert set(fns) == set(known)
    return tuple(
        Patch(
            f"{kind}:{name}",
            "scheduler",
            "_reachable_store_block_mask",
            replace(fn),
            params=inject.MASK_ARGS,
        )
        for name, fn in fns.items()
    )


# What an active store-path change logs, and where its description lives.
CHANGES: dict[str, tuple[str, Mapping[str, str]]] = {
    "inject": ("injected historical bug %r into", catalog.INJECTIONS),
    "fix": ("applied candidate fix %r to", catalog.FIXES),
}


TABLE: tuple[Patch, ...] = (
    # recording: scheduler class (episode, allocation, step, finish, reset context)
    Patch(
        "record",
        "scheduler",
        "__init__",
        record_init,
        params=("spec", "vllm_config", "kv_cache_config"),
    ),
    Patch(
        "record",
        "scheduler",
        "get_num_new_matched_tokens",
        observe("get_num_new_matched_tokens", before=hooks.episode_begin, after=hooks.episode_end),
        params=("request", "num_computed_tokens"),
    ),
    Patch(
        "record",
        "scheduler",
        "update_state_after_alloc",
        observe("update_state_after_alloc", after=hooks.accepted),
        params=("request", None, "num_external_tokens"),
    ),
    Patch(
        "record",
        "scheduler",
        "build_connector_meta",
        observe("build_connector_meta", before=hooks.step_begin, after=hooks.step_end, always=True),
        params=("scheduler_output",),
    ),
    Patch(
        "record",
        "scheduler",
        "request_finished",
        observe("request_finished", after=hooks.request_finished),
        params=("request",),
    ),
    Patch("record", "scheduler", "reset_cache", observe("reset_cache", after=hooks.flush)),
    # optional private helpers: exact scan boundaries (inferred from group changes without)
    Patch(
        "record",
        "scheduler",
        "_maximal_prefix_lookup",
        observe("scan", before=hooks.scan_begin),
        essential=False,
    ),
    Patch(
        "record",
        "scheduler",
        "_sliding_window_lookup",
        observe("scan", before=hooks.scan_begin),
        essential=False,
    ),
    # recording: the manager instance each recorded scheduler creates
    Patch(
        "record",
        "manager",
        "lookup",
        observe_hot("manager.lookup", hooks.lookup, hooks.lookup_direct),
        params=("key", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "prepare_store",
        observe("manager.prepare_store", after=hooks.prepare_store),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "complete_store",
        observe("manager.complete_store", after=hooks.complete_store),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "prepare_load",
        observe("manager.prepare_load", after=hooks.prepare_load),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "complete_load",
        observe("manager.complete_load", after=hooks.complete_load),
        params=("keys", "req_context"),
    ),
    Patch("record", "manager", "reset_cache", observe("manager.reset_cache", after=hooks.reset)),
    # recording: below a tiered manager's public methods (vLLM 0.33.0's tiering manager)
    Patch(
        "record",
        "tiering",
        "_initiate_promotion",
        observe(
            "tiering.promotion",
            before=hooks.promotion_begin,
            after=hooks.promotion_end,
            always=True,
        ),
        essential=False,
        params=("tier_idx",),
    ),
    Patch(
        "record",
        "tiering",
        "complete_store",
        observe(
            "tiering.complete_store", before=hooks.store_begin, after=hooks.store_end, always=True
        ),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "tiering",
        "_should_store_to_tier",
        observe("tiering.backpressure", after=hooks.backpressure),
        essential=False,
        params=("tier",),
    ),
    Patch("record", "tiering", "reset_cache", observe("tiering.reset", after=hooks.reset_tiers)),
    Patch(
        "record",
        "tiering",
        "on_reset_flushed",
        observe("tiering.reset_flushed", after=hooks.reset_flushed),
        essential=False,
    ),
    Patch(
        "record",
        "primary",
        "prepare_write",
        observe("primary.prepare_write", after=hooks.prepare_write),
    ),
    Patch(
        "record",
        "primary",
        "complete_write",
        observe("primary.complete_write", after=hooks.complete_write),
    ),
    # a failed promotion whose tier may still write its chunks (vLLM 0.34.0): the keys
    # leave the cache now, the chunks return to the pool when the tier says so
    Patch(
        "record",
        "tiering",
        "_complete_promotion",
        observe(
            "tiering.complete_promotion",
            before=hooks.promotion_settling,
            after=hooks.promotion_settled,
            always=True,
        ),
        essential=False,
        params=("job_metadata", "completed_job"),
    ),
    Patch(
        "record",
        "primary",
        "defer_write_release",
        observe("primary.defer_write_release", after=hooks.defer_release),
        essential=False,
        params=("keys",),
    ),
    Patch(
        "record",
        "primary",
        "release_deferred_write",
        observe("primary.release_deferred_write", after=hooks.release_deferred),
        essential=False,
        params=("chunk_ids",),
    ),
    Patch("record", "tier", "lookup", observe("tier.lookup", after=hooks.tier_lookup)),
    Patch(
        "record",
        "tier",
        "submit_store",
        observe("tier.submit_store", after=hooks.tier_submit_store),
    ),
    Patch(
        "record",
        "tier",
        "get_finished_jobs",
        observe("tier.get_finished_jobs", after=hooks.tier_finished),
    ),
    Patch("record", "tier", "take_events", observe_iter("tier.take_events", hooks.tier_events)),
    # historical store-side bugs (testing only)
    *_store_mask_rows(
        "inject",
        {
            "pre48911": inject.pre48911,
            "no_eagle_plus1": inject.no_eagle_plus1,
            "short_window_tail": inject.short_window_tail,
        },
        catalog.INJECTIONS,
    ),
    *_store_mask_rows(
        "fix",
        {
            "mtp_left_chunk": fixes.mtp_left_chunk,
            "unkeyable_peek_fallback": fixes.unkeyable_peek_fallback,
            "lookahead_replay_boundary": fixes.lookahead_replay_boundary,
        },
        {k: v for k, v in catalog.FIXES.items() if k in catalog.STORE_MASK_FIXES},
    ),
    # a fix on both sides: lookup accepts a proof key for a peek, store writes it
    Patch(
        "fix:eagle_proof_key",
        "scheduler",
        "_lookup_complete_chunks",
        replace(fixes.lookup_with_unkeyable_peek),
        params=("req_status", "max_num_new_tokens"),
    ),
    Patch(
        "fix:eagle_proof_key",
        "scheduler",
        "_sliding_window_lookup",
        replace(fixes.scan_with_proof),
        params=("keys", "sliding_window_size", "req_context", "initial_window_size"),
    ),
    Patch(
        "fix:eagle_proof_key",
        "scheduler",
        "_build_store_jobs",
        replace(fixes.store_peek_proofs),
        params=("scheduler_output",),
    ),
    # a lookup-side fix of the window in chunks, where vLLM computes it for every group
    Patch(
        "fix:window_minus_one",
        "config",
        "get_sliding_window_size_in_chunks",
        replace(fixes.window_minus_one),
        params=("kv_cache_spec", "tokens_per_chunk"),
    ),
    # a tiered manager's promotions pin the keys their own request found in the primary
    Patch(
        "fix:promotion_pins_prefix",
        "tiering_class",
        "lookup",
        replace(fixes.note_primary_hits),
        params=("key", "req_context", "exclude_tier_idx"),
    ),
    Patch(
        "fix:promotion_pins_prefix",
        "tiering_class",
        "_initiate_promotion",
        replace(fixes.promote_pinning_prefix),
        params=("tier_idx", "key", "req_context"),
    ),
    Patch(
        "fix:promotion_pins_prefix",
        "tiering_class",
        "on_schedule_end",
        replace(fixes.forget_primary_hits),
        params=("context",),
    ),
    # the CPU harness's own observers on the connector instance it builds
    Patch("harness", "connector", "get_num_new_matched_tokens", notify("on_lookup")),
    Patch("harness", "connector", "update_state_after_alloc", notify("on_alloc")),
    # the CPU lab builds configs on an x86 CPU without triton-cpu (a scheduler runs no kernel)
    Patch(
        "lab",
        "platform",
        "check_and_update_config",
        replace(with_triton_seen),
        params=("vllm_config",),
    ),
)
"""Every patch keytrace makes on vLLM, in the order it is applied."""


FEATURES: tuple[str, ...] = tuple(dict.fromkeys(p.feature for p in TABLE))

register_table(TABLE)
