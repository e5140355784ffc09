"""The vLLM configuration of a `Geometry`, as a CPU-only machine can build it: the
``VllmConfig`` (a normal ``kv_transfer_config`` naming the real ``OffloadingConnector``), a
tiny model ``config.json`` written to a temporary folder (no weights are read), and the
``KVCacheConfig`` that KV-cache planning would produce, with the fields
``EngineCore._initialize_kv_caches`` sets. What `keytrace.vllm.lab.harness` builds its
real scheduler from.

Importing this module imports vLLM (and torch).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from keytrace.analysis.geometry import REPLAYABLE_TIERS, Geometry, GroupGeom
from keytrace.vllm.hook.patches import lab_platform

VOCAB = 32_000
_TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "torch_dtype": "float16",
}


@functools.lru_cache(maxsize=8)
def _model_config(max_model_len: int) -> ModelConfig:
    """ModelConfig from a tiny local config.json; cached because it costs seconds.

    The folder name is fixed per max_model_len, so every process records the same model
    name in its header (the reader refuses traces whose headers differ).
    """
    folder = os.path.join(tempfile.gettempdir(), f"keytrace-tiny-llama-{max_model_len}")
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".config.json.{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump({**_TINY_MODEL, "max_position_embeddings": max_model_len}, fh)
    os.replace(tmp, os.path.join(folder, "config.json"))
    return ModelConfig(
        model=folder,
        tokenizer=None,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float16",
    )


def _spec(g: GroupGeom) -> KVCacheSpec:
    common: dict[str, Any] = dict(
        block_size=g.block_size, num_kv_heads=1, head_size=16, dtype=torch.float16
    )
    # ``is_draft`` (0.32.0+) only steers KV planning, which the harness does itself; a
    # release without the field plans draft layers by other means
    if "is_draft" in {f.name for f in dataclasses.fields(FullAttentionSpec)}:
        common["is_draft"] = g.eagle
    if g.kind == "mla":
        return MLAAttentionSpec(**{**common, "head_size": 32})
    if g.kind == "full_attention":
        return FullAttentionSpec(**common)
    assert g.sliding_window is not None
    return SlidingWindowSpec(
        **common,
        sliding_window=g.sliding_window,
        extra_retained_tokens=g.extra_retained_tokens,
    )


def default_num_gpu_blocks(geometry: Geometry, max_prompt_tokens: int | None = None) -> int:
    """Enough GPU blocks for two requests of the longest prompt in every group.

    The pool is bookkeeping only, but building it costs time per block, so a harness that
    knows its longest prompt sizes the pool to it instead of to ``max_model_len``.
    """
    tokens = min(geometry.max_model_len, (max_prompt_tokens or geometry.max_model_len) + 64)
    per_req = sum(-(-tokens // g.block_size) + 2 for g in geometry.groups)
    return 2 * per_req + 64


def build_vllm_config(geometry: Geometry, *, cpu_bytes_to_use: int) -> VllmConfig:
    """A VllmConfig whose KV transfer config names the real OffloadingConnector."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": cpu_bytes_to_use,
        "blocks_per_chunk": geometry.blocks_per_chunk,
        **geometry.extra,
    }
    cache = CacheConfig(
        # always the geometry's: vLLM's default moved (16 up to 0.33.0, 64 from 0.34.0)
        block_size=_cache_block_size(geometry),
        enable_prefix_caching=True,
        prefix_cache_retention_interval=geometry.retention_interval,
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=geometry.max_num_batched_tokens,
        max_num_seqs=16,
        max_model_len=geometry.max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=geometry.long_prefill_token_threshold,
        async_scheduling=geometry.async_scheduling,
        is_encoder_decoder=False,
    )
    # vLLM 0.34.0's CPU platform refuses an x86 CPU without triton-cpu; a scheduler runs
    # no kernel, so the lab's own row lets the check pass while this config is built
    with lab_platform():
        config = VllmConfig(
            model_config=_model_config(geometry.max_model_len),
            cache_config=cache,
            scheduler_config=sched,
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
        )
    # CUDA resolves the HMA on for this connector; a CPU-only platform may not. After
    # __post_init__ the flag is read only by the connector factory's HMA check and by
    # planning, which the harness replaces (build_kv_cache_config).
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    # The CPU platform turns async scheduling off; CUDA's uniproc executor keeps an explicit
    # request on. The flag only selects scheduling behaviour that the harness drives itself
    # (AsyncScheduler, output of step t applied after step t + 1 is scheduled).
    config.scheduler_config.async_scheduling = geometry.async_scheduling
    _check_unchanged(config, geometry)
    return config


def _cache_block_size(geometry: Geometry) -> int:
    """The cache config's block size: the geometry's smallest (each group's own is in its
    KV-cache spec, `build_kv_cache_config`)."""
    return min(g.block_size for g in geometry.groups)


def _check_unchanged(config: VllmConfig, geometry: Geometry) -> None:
    """vLLM's config resolution kept what the geometry sets (a platform may rewrite the
    block size, the budget or the scheduling mode: the harness would then build another
    geometry than the one it names)."""
    sc, cc = config.scheduler_config, config.cache_config
    problems = []
    if cc.block_size != _cache_block_size(geometry):
        problems.append(f"block_size={cc.block_size}")
    if sc.max_num_batched_tokens != geometry.max_num_batched_tokens:
        problems.append(f"max_num_batched_tokens={sc.max_num_batched_tokens}")
    if not sc.enable_chunked_prefill:
        problems.append("chunked prefill disabled")
    if not cc.enable_prefix_caching:
        problems.append("prefix caching disabled")
    if cc.prefix_cache_retention_interval != geometry.retention_interval:
        problems.append(f"retention_interval={cc.prefix_cache_retention_interval}")
    if bool(sc.async_scheduling) != geometry.async_scheduling:
        problems.append(f"async_scheduling={sc.async_scheduling}")
    if problems:
        raise RuntimeError("VllmConfig changed the geometry: " + ", ".join(problems))


def build_kv_cache_config(
    geometry: Geometry, config: VllmConfig, *, max_prompt_tokens: int | None = None
) -> KVCacheConfig:
    """The KVCacheConfig planning would produce, with the fields EngineCore then sets."""
    groups = [
        KVCacheGroupSpec([f"layer.{i}.{g.name or g.kind}"], _spec(g), is_eagle_group=g.eagle)
        for i, g in enumerate(geometry.groups)
    ]
    kv = KVCacheConfig(
        num_blocks=geometry.num_gpu_blocks or default_num_gpu_blocks(geometry, max_prompt_tokens),
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )
    kv.prefix_cache_retention_interval = geometry.retention_interval
    config.cache_config.num_gpu_blocks = kv.num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv, config)
    kv.hash_block_size = hash_bs
    # 0.32.0 added the cache-hit alignment (EngineCore resolves it after planning); on
    # older releases neither the function nor the field exists, and EngineCore sets neither
    resolve_alignment = getattr(kv_cache_utils, "resolve_cache_hit_alignment_tokens", None)
    if resolve_alignment is not None:
        kv.cache_hit_alignment_tokens = resolve_alignment(kv, config, sched_bs, hash_bs)
    return kv


def chunk_bytes(geometry: Geometry, kv: KVCacheConfig) -> int:
    """Bytes per CPU chunk exactly as CPUOffloadingSpec computes them (world size 1)."""
    from vllm.utils.math_utils import round_up
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    per_block = sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv.kv_cache_groups
    )
    return int(
        round_up(per_block * geometry.blocks_per_chunk, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    )


TIER_TYPES = REPLAYABLE_TIERS
"""Secondary tiers the harness builds: vLLM's in-memory ``example`` tier (synchronous: a
run is exactly repeatable) and its ``fs`` tier (files under a directory; asynchronous
lookups and transfers on threads, which `Harness.settle_tiers` waits for between steps).
Both run on a CPU; ``obj``/``p2p`` need NIXL and ``kvcr`` its own package."""


def tiered(geometry: Geometry, tiers: tuple[str, ...], root_dir: str | None = None) -> Geometry:
    """``geometry`` with vLLM's ``TieringOffloadingSpec``: its CPU tier becomes the primary
    over ``tiers`` (each of `TIER_TYPES`; an ``fs`` tier keeps its files under
    ``root_dir``, which every engine of a run shares, as llm-d's shared file system does;
    without one, each harness gives it a temporary folder of its own)."""
    configs: list[dict[str, Any]] = []
    for t in tiers:
        if t == "example":
            configs.append({"type": "example"})
        elif t == "fs":
            fs: dict[str, Any] = {"type": "fs", "n_read_threads": 2, "n_write_threads": 2}
            if root_dir is not None:
                fs["root_dir"] = root_dir
            configs.append(fs)
        else:
            raise ValueError(f"unknown tier {t!r}; the harness builds {', '.join(TIER_TYPES)}")
    extra = {**geometry.extra, "spec_name": "TieringOffloadingSpec", "secondary_tiers": configs}
    return geometry.with_(extra=extra)
