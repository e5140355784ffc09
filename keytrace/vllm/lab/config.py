"""The vLLM configuration of a `Geometry`, as a CPU-only machine can build it: the
``VllmConfig`` (a normal ``kv_transfer_config`` naming the real ``OffloadingConnector``, and
a real ``SpeculativeConfig`` for a geometry's drafter), tiny model ``config.json`` files
written to a temporary folder (no weights are read), and the ``KVCacheConfig`` that
KV-cache planning would produce, with the fields ``EngineCore._initialize_kv_caches`` sets.
What `keytrace.vllm.lab.harness` builds its real scheduler from.

Importing this module imports vLLM (and torch).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from keytrace.analysis.geometry import REPLAYABLE_TIERS, Drafter, Geometry, GroupGeom

VOCAB = 32_000
_TINY_HEADS = 4
_TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": _TINY_HEADS,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "torch_dtype": "float16",
}


_TINY_EAGLE = {
    **_TINY_MODEL,
    "architectures": ["EagleLlamaForCausalLM"],
    "num_hidden_layers": 1,
}
"""An EAGLE head for the tiny Llama: vLLM reads a draft's ``config.json`` (never its
weights) and accepts only a registered draft architecture."""

_TINY_EAGLE3 = {**_TINY_EAGLE, "architectures": ["LlamaForCausalLMEagle3"]}

_TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "torch_dtype": "bfloat16",
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_theta": 10000,
}
"""A DeepSeek-V3-like checkpoint whose ``num_nextn_predict_layers`` MTP modules vLLM's MTP
drafter reads (as ``n_predict``). Only the speculative config's target: the harness's own
model stays the tiny Llama (vLLM's CPU platform forces block size 16 on an MLA model)."""


def _local_model(name: str, config: dict[str, Any]) -> str:
    """A folder holding ``config`` as its ``config.json``, at a fixed path per ``name`` (so
    every process records the same model name in its header: the reader refuses traces
    whose headers differ); replaced atomically, as concurrent processes write it too."""
    folder = os.path.join(tempfile.gettempdir(), f"keytrace-{name}")
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".config.json.{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(config, fh)
    os.replace(tmp, os.path.join(folder, "config.json"))
    return folder


@functools.lru_cache(maxsize=8)
def _model_config(max_model_len: int, tensor_parallel_size: int = 1) -> ModelConfig:
    """ModelConfig from a tiny local config.json; cached because it costs seconds. Over
    ``tensor_parallel_size`` > 1 ranks (decode context parallelism needs them) its
    attention heads are as many as vLLM requires to split them (a multiple of the ranks),
    in a folder of its own: every other model stays the bytes it was."""
    if tensor_parallel_size == 1:
        return _tiny_model_config(
            _local_model(
                f"tiny-llama-{max_model_len}",
                {**_TINY_MODEL, "max_position_embeddings": max_model_len},
            ),
            max_model_len,
            "float16",
        )
    heads = math.lcm(_TINY_HEADS, tensor_parallel_size)
    return _tiny_model_config(
        _local_model(
            f"tiny-llama-tp{tensor_parallel_size}-{max_model_len}",
            {
                **_TINY_MODEL,
                "num_attention_heads": heads,
                "hidden_size": 16 * heads,
                "max_position_embeddings": max_model_len,
            },
        ),
        max_model_len,
        "float16",
    )


def _tiny_model_config(folder: str, max_model_len: int, dtype: str) -> ModelConfig:
    return ModelConfig(
        model=folder,
        tokenizer=None,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype=dtype,
    )


@functools.lru_cache(maxsize=8)
def _mtp_target_config(max_model_len: int, mtp_modules: int) -> ModelConfig:
    """The DeepSeek-V3-like checkpoint an MTP drafter of ``mtp_modules`` modules reads."""
    folder = _local_model(
        f"tiny-deepseek-v3-{mtp_modules}mtp-{max_model_len}",
        {
            **_TINY_DEEPSEEK_V3,
            "max_position_embeddings": max_model_len,
            "num_nextn_predict_layers": mtp_modules,
        },
    )
    return _tiny_model_config(folder, max_model_len, "bfloat16")


def parallel_config(geometry: Geometry) -> ParallelConfig:
    """The geometry's parallelism: decode context parallel size `Geometry.dcp` over as
    many tensor parallel ranks (vLLM requires the TP size to be a multiple of it; the
    scheduler side sees the ranks only as ``world_size`` workers acknowledging each
    transfer). A new config every call: ``VllmConfig`` may change it."""
    if geometry.dcp == 1:
        return ParallelConfig()
    return ParallelConfig(
        tensor_parallel_size=geometry.dcp, decode_context_parallel_size=geometry.dcp
    )


def speculative_config(
    drafter: Drafter, max_model_len: int, tensor_parallel_size: int = 1
) -> SpeculativeConfig:
    """A real ``SpeculativeConfig`` for ``drafter``, built offline from tiny local
    ``config.json`` files: vLLM resolves everything that follows from it (the hash
    lookahead above all) by its own rules, on every release.

    EAGLE and EAGLE3 draft for the harness's tiny Llama, with a registered draft
    architecture; MTP drafts from a DeepSeek-V3-like checkpoint with ``mtp_modules`` MTP
    modules (vLLM rewrites it into its MTP draft config, ``n_predict`` modules), which is
    the speculative target only. A new config every call: ``VllmConfig`` may change it.
    ``tensor_parallel_size``: the target's (a geometry with decode context parallelism)."""
    target_parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    if drafter.method == "mtp":
        return SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=drafter.num_speculative_tokens,
            target_model_config=_mtp_target_config(max_model_len, drafter.mtp_modules),
            target_parallel_config=target_parallel,
        )
    head = _TINY_EAGLE3 if drafter.method == "eagle3" else _TINY_EAGLE
    folder = _local_model(
        f"tiny-{drafter.method}-{max_model_len}",
        {**head, "max_position_embeddings": max_model_len},
    )
    return SpeculativeConfig(
        method=drafter.method,
        model=folder,
        num_speculative_tokens=drafter.num_speculative_tokens,
        target_model_config=_model_config(max_model_len, tensor_parallel_size),
        target_parallel_config=target_parallel,
    )


def _mamba_spec(g: GroupGeom, drafter: Drafter | None) -> KVCacheSpec:
    """A recurrent group's spec in ``align`` mode: one small state per block (its shape
    only sizes pages), one speculative block per draft token as vLLM's Mamba layers ask
    (``num_speculative_blocks``) and, where the group has them, the prefill checkpoints
    vLLM's Mamba2 layers ask for (``mamba_mixer2.py``: ``num_prefill_checkpoint_blocks``
    1 and the group's ``prefill_checkpoint_alignment``; no kernel runs, so the fake
    worker exports nothing: the scheduler side only keys the block)."""
    fields = {f.name for f in dataclasses.fields(MambaSpec)}
    extra: dict[str, Any] = {"mamba_cache_mode": "align"} if "mamba_cache_mode" in fields else {}
    if drafter is not None and "num_speculative_blocks" in fields:
        extra["num_speculative_blocks"] = drafter.num_speculative_tokens
    if g.prefill_checkpoint_alignment is not None:
        if "num_prefill_checkpoint_blocks" not in fields:
            raise RuntimeError("this vLLM's MambaSpec has no prefill checkpoints")
        extra["num_prefill_checkpoint_blocks"] = 1
        extra["prefill_checkpoint_alignment"] = g.prefill_checkpoint_alignment
    return MambaSpec(block_size=g.block_size, shapes=((4, 16),), dtypes=(torch.float16,), **extra)


def _spec(g: GroupGeom, drafter: Drafter | None = None) -> KVCacheSpec:
    if g.recurrent:
        return _mamba_spec(g, drafter)
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
    spans = (geometry.tokens_per_block(i) for i in range(len(geometry.groups)))
    per_req = sum(-(-tokens // span) + 2 for span in spans)
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
        prefix_match_unit=geometry.prefix_match_unit,
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
    drafter = geometry.drafter
    # imported here: importing the lab loads no recording machinery (the pytest plugin
    # and a test that only builds a harness later must find it unloaded)
    from keytrace.vllm.hook.patches import lab_platform

    tp = geometry.dcp  # decode context parallelism needs that many TP ranks at least
    with lab_platform():
        config = VllmConfig(
            model_config=_model_config(geometry.max_model_len, tp),
            cache_config=cache,
            scheduler_config=sched,
            parallel_config=parallel_config(geometry),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
            # given here, so VllmConfig resolves what follows from it (the hash lookahead)
            speculative_config=None
            if drafter is None
            else speculative_config(drafter, geometry.max_model_len, tp),
        )
    if any(g.recurrent for g in geometry.groups):
        # what vLLM's hybrid-model config hook sets under prefix caching; the lab's tiny
        # model is not hybrid, and nothing resets these for a model that is not
        config.cache_config.mamba_cache_mode = "align"
        config.cache_config.mamba_block_size = _cache_block_size(geometry)
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
    if config.parallel_config.decode_context_parallel_size != geometry.dcp:
        problems.append(
            f"decode_context_parallel_size={config.parallel_config.decode_context_parallel_size}"
        )
    if problems:
        raise RuntimeError("VllmConfig changed the geometry: " + ", ".join(problems))


def build_kv_cache_config(
    geometry: Geometry, config: VllmConfig, *, max_prompt_tokens: int | None = None
) -> KVCacheConfig:
    """The KVCacheConfig planning would produce, with the fields EngineCore then sets."""
    groups = [
        KVCacheGroupSpec(
            [f"layer.{i}.{g.name or g.kind}"], _spec(g, geometry.drafter), is_eagle_group=g.eagle
        )
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


def chunk_bytes(geometry: Geometry, kv: KVCacheConfig, world_size: int = 1) -> int:
    """Bytes per CPU chunk exactly as CPUOffloadingSpec computes them: one copy of a
    worker's block per rank of ``world_size``."""
    from vllm.utils.math_utils import round_up
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    per_block = sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv.kv_cache_groups
    )
    return int(
        round_up(
            per_block * world_size * geometry.blocks_per_chunk,
            CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT,
        )
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
