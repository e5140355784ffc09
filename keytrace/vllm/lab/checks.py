"""The CPU lab's own capability (``harness``): the recording checks, and every vLLM
constructor the harness calls with keywords (`HARNESS_CALLS`). Imports vLLM only to
inspect it; importing this module imports neither vLLM nor torch."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator

from keytrace.vllm.hook.patches import TABLE
from keytrace.vllm.hook.support import Capability, Check, importable, lab_checks, record_checks

HARNESS_CALLS: dict[str, tuple[str, ...]] = {
    "vllm.config.CacheConfig": ("block_size", "enable_prefix_caching"),
    "vllm.config.SchedulerConfig": (
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "async_scheduling",
        "is_encoder_decoder",
    ),
    "vllm.config.VllmConfig": (
        "model_config",
        "cache_config",
        "scheduler_config",
        "kv_transfer_config",
        "speculative_config",
    ),
    "vllm.config.SpeculativeConfig": (
        "method",
        "model",
        "num_speculative_tokens",
        "target_model_config",
        "target_parallel_config",
    ),
    "vllm.config.ModelConfig": (
        "model",
        "tokenizer",
        "skip_tokenizer_init",
        "max_model_len",
        "dtype",
    ),
    "vllm.config.KVTransferConfig": ("kv_connector", "kv_role", "kv_connector_extra_config"),
    "vllm.v1.kv_cache_interface.KVCacheConfig": (
        "num_blocks",
        "kv_cache_tensors",
        "kv_cache_groups",
    ),
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec": ("is_eagle_group",),
    "vllm.v1.request.Request": (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "pooling_params",
        "block_hasher",
    ),
    "vllm.v1.outputs.ModelRunnerOutput": ("req_ids", "sampled_token_ids", "kv_connector_output"),
}
"""Every vLLM constructor the CPU harness calls with keywords, and the keywords it always
passes (``ModelRunnerOutput``'s ``req_id_to_index`` only where the class has it: 0.34.0
dropped it)."""


def _accepts(dotted: str, keywords: tuple[str, ...]) -> Check:
    module, _, name = dotted.rpartition(".")
    what = f"{name}({', '.join(keywords)})"
    try:
        target = getattr(importlib.import_module(module), name)
        params = inspect.signature(target).parameters
    except Exception as exc:
        return Check(what, f"{dotted} cannot be inspected ({type(exc).__name__}: {exc})")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return Check(what)
    missing = [k for k in keywords if k not in params]
    return Check(what, f"{dotted} takes no {', '.join(missing)}" if missing else "")


def harness_checks() -> Iterator[Check]:
    """The checks behind ``harness``: recording's, the lab's own row on vLLM's CPU
    platform (`keytrace.vllm.hook.support.lab_checks`), then the harness's calls."""
    yield from record_checks(TABLE)
    yield from lab_checks(TABLE)
    for dotted, keywords in HARNESS_CALLS.items():
        yield _accepts(dotted, keywords)
    yield importable(
        "the harness's vLLM imports resolve",
        "vllm.v1.core.kv_cache_utils",
        ("get_request_block_hasher", "init_none_hash", "resolve_kv_cache_block_sizes"),
    )
    try:
        importlib.import_module("keytrace.vllm.lab.harness")
    except Exception as exc:
        yield Check("keytrace's harness imports", f"{type(exc).__name__}: {exc}")
    else:
        yield Check("keytrace's harness imports")


_PASSED: dict[tuple[str, int], Capability] = {}
"""Passed evaluations by (vLLM version, id of the scheduler class): every `Harness` calls
`keytrace.vllm.require_vllm`, and a sweep or fuzz run builds thousands; a failed one is
evaluated afresh (it is an error path)."""


def harness_capability() -> Capability:
    """Evaluate ``harness`` on the installed vLLM (a pass is remembered for this code)."""
    from keytrace.vllm.hook.compat import load_targets, vllm_version

    key = (vllm_version(), id(load_targets()[0]))
    found = _PASSED.get(key)
    if found is None:
        found = Capability("harness", tuple(harness_checks()))
        if found.ok:
            _PASSED[key] = found
    return found
