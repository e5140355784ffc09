"""Drive the real vLLM 0.33.0 scheduler + OffloadingConnector + CPUOffloadingManager on a CPU.

Real, unmodified vLLM: ``Scheduler`` (hybrid KV-cache coordinator, chunked prefill, GPU
prefix cache bookkeeping), the ``OffloadingConnector`` built by the scheduler from a normal
``kv_transfer_config`` (``build_offloading_config`` -> ``CPUOffloadingSpec`` ->
``OffloadingConnectorScheduler``), and the ``CPUOffloadingManager`` it creates.

Replaced, because a CPU cannot provide them:

- the GPU worker: `AckWorker` reads each step's ``OffloadingConnectorMetadata`` and
  acknowledges jobs the way the real worker does (stores one step after they are issued,
  flushed jobs and loads at once, ``finished_recving`` for asynchronous loads);
- the model: a tiny ``config.json`` written to a temporary folder (no weights are read);
- KV-cache memory planning: the ``KVCacheConfig`` is built from a `Geometry`, then the
  fields ``EngineCore._initialize_kv_caches`` would set are set the same way.

Importing this module imports vLLM (and torch). The CLI imports it lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from keytrace.analysis.geometry import REPLAYABLE_TIERS, Geometry, GroupGeom
from keytrace.errors import VllmUnavailableError
from keytrace.vllm import require_vllm
from keytrace.vllm.lab import environment

_VOCAB = 32_000
_TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": _VOCAB,
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
        block_size=min(g.block_size for g in geometry.groups),
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
    # planning, which the harness replaces (cpu-scheduler-harness.md).
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    # The CPU platform turns async scheduling off; CUDA's uniproc executor keeps an explicit
    # request on. The flag only selects scheduling behaviour that the harness drives itself
    # (AsyncScheduler, output of step t applied after step t + 1 is scheduled).
    config.scheduler_config.async_scheduling = geometry.async_scheduling
    _check_unchanged(config, geometry)
    return config


def _check_unchanged(config: VllmConfig, geometry: Geometry) -> None:
    sc, cc = config.scheduler_config, config.cache_config
    problems = []
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


def _chunk_bytes(geometry: Geometry, kv: KVCacheConfig) -> int:
    """Bytes per CPU chunk exactly as CPUOffloadingSpec computes them (world size 1)."""
    from vllm.utils.math_utils import round_up
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    per_block = sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv.kv_cache_groups
    )
    return int(
        round_up(per_block * geometry.blocks_per_chunk, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    )


log = logging.getLogger("keytrace")

TIER_TYPES = REPLAYABLE_TIERS

ABORT_DEFERRALS = 64
"""Deferred lookups in a row after which `Harness.abort_stalled` aborts a request: past
keytrace's stalled rule (`keytrace.judge.definitions.STALL_EPISODES`), so the trace
holds the stalled verdict first."""
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


def _release(region: Any) -> None:
    """Unlink an unclosed harness's shared memory region (vLLM's ``cleanup``); from a
    finalizer, so it never raises."""
    if region is None:
        return
    try:
        region.cleanup()
    except Exception:
        log.debug("keytrace harness: releasing a shared memory region failed", exc_info=True)


# ------------------------------------------------------------------ fake worker
class AckWorker:
    """Stands in for the GPU worker: acknowledges transfer jobs, moves no bytes.

    Timing follows ``OffloadingConnectorWorker``: stores issued at step t are submitted at
    the start of step t+1 and reported complete in t+1's output (``store_delay`` 1; a
    larger delay models slow transfers, so later lookups see the keys HIT_PENDING);
    flushed jobs are waited for (complete at once); loads complete in the step they are
    issued, asynchronous ones also report their request in ``finished_recving``.
    """

    def __init__(self, store_delay: int = 1) -> None:
        self.store_delay = max(1, store_delay)
        self.deferred_stores: list[tuple[int, int]] = []  # (job, steps left)
        self.acked: set[int] = set()
        self.stores_issued = 0
        self.loads_issued = 0

    def run(self, meta: OffloadingConnectorMetadata) -> KVConnectorOutput:
        completed: dict[int, int] = {}
        flush = set(meta.jobs_to_flush or ())
        waiting = []
        for job, left in self.deferred_stores:
            if left <= 1 or job in flush:
                completed[job] = 1
            else:
                waiting.append((job, left - 1))
        self.deferred_stores = waiting
        for job in meta.store_jobs:
            self.stores_issued += 1
            if job in flush:
                completed[job] = 1
            else:
                self.deferred_stores.append((job, self.store_delay))
        recving: set[str] = set()
        for job, entry in meta.load_jobs.items():
            self.loads_issued += 1
            completed[job] = 1
            if not entry.sync:
                recving.add(entry.req_id)
        completed = {j: c for j, c in completed.items() if j not in self.acked}
        self.acked.update(completed)
        return KVConnectorOutput(
            finished_sending=set(),
            finished_recving=recving,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed),
        )

    @property
    def idle(self) -> bool:
        return not self.deferred_stores


# ---------------------------------------------------------------------- results
@dataclass
class EpisodeObservation:
    """What the harness saw at the connector's public API for one request."""

    req_id: str
    num_prompt_tokens: int
    lookups: list[tuple[int, int | None]] = field(default_factory=list)  # (local, external)
    accepted: list[int | None] = field(default_factory=list)  # per lookup; None: no alloc

    @property
    def local_tokens(self) -> int:
        return self.lookups[-1][0] if self.lookups else 0

    @property
    def external_tokens(self) -> int:
        """External tokens of the last non-deferred lookup (0 if every lookup deferred)."""
        for _, ext in reversed(self.lookups):
            if ext is not None:
                return ext
        return 0

    @property
    def accepted_tokens(self) -> int:
        """External tokens the core scheduler accepted after the last lookup."""
        return (self.accepted[-1] or 0) if self.accepted else 0


@dataclass
class ScenarioResult:
    """Outcome of prime -> GPU-only reset -> identical request."""

    num_tokens: int
    prime: EpisodeObservation
    replay: EpisodeObservation
    steps: int

    @property
    def local_tokens(self) -> int:
        return self.replay.local_tokens

    @property
    def external_tokens(self) -> int:
        return self.replay.external_tokens

    @property
    def accepted_tokens(self) -> int:
        return self.replay.accepted_tokens


# ---------------------------------------------------------------------- harness
class Harness:
    """One real scheduler-side offloading setup built from a `Geometry`."""

    def __init__(
        self,
        geometry: Geometry,
        *,
        seed: int = 0,
        dp_rank: int | None = None,
        max_prompt_tokens: int | None = None,
        store_delay: int = 1,
        request_prefix: str = "r",
    ) -> None:
        require_vllm()
        too_early = environment.resolved_too_early()
        if too_early:
            raise VllmUnavailableError(too_early)
        geometry = self._with_tier_dirs(geometry)
        self.geometry = geometry
        self.seed = seed
        probe = build_vllm_config(geometry, cpu_bytes_to_use=1)
        kv_probe = build_kv_cache_config(geometry, probe)
        self.cpu_bytes_to_use = geometry.cpu_chunks * _chunk_bytes(geometry, kv_probe)
        self.vllm_config = build_vllm_config(geometry, cpu_bytes_to_use=self.cpu_bytes_to_use)
        if dp_rank is not None:
            self.vllm_config.parallel_config.data_parallel_index = dp_rank
            self.vllm_config.parallel_config.data_parallel_rank = dp_rank
        self.kv_cache_config = build_kv_cache_config(
            geometry, self.vllm_config, max_prompt_tokens=max_prompt_tokens
        )
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        self.hash_block_size = hash_bs
        cls = AsyncScheduler if geometry.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=sched_bs,
            hash_block_size=hash_bs,
            log_stats=False,
        )
        connector = self.scheduler.connector
        if connector is None or type(connector).__name__ != "OffloadingConnector":
            raise RuntimeError(f"scheduler built connector {type(connector).__name__}")
        self.connector = connector
        self.connector_scheduler = connector.connector_scheduler
        self.manager = self.connector_scheduler.manager
        # A tiered manager's primary maps a /dev/shm region (left behind, thousands of
        # harnesses filled /dev/shm). `close` shuts vLLM down properly; should a harness
        # be dropped unclosed, the region is released when it is collected. The finalizer
        # holds the region only: holding the scheduler would keep the harness alive (the
        # connector's harness rows are bound to it) and nothing would ever be released.
        region = getattr(getattr(self.manager, "primary_tier", None), "_mmap_region", None)
        self._closer = weakref.finalize(self, _release, region)
        self._closed = False
        self._check_built()
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_bs, hash_fn)
        self.worker = AckWorker(store_delay)
        self.request_prefix = request_prefix
        self.observations: dict[str, EpisodeObservation] = {}
        self.step_count = 0
        self.digests: list[tuple[Any, ...]] = []  # one per step: what the scheduler decided
        self._req_counter = 0
        self._observe_connector()
        self._pending_async: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def close(self) -> None:
        """Shut the scheduler down as vLLM does (its connector, its manager, a tiered
        manager's tiers and shared memory). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closer.detach()
        try:
            self.scheduler.shutdown()
        except Exception as exc:  # a tier that will not stop: said, not raised
            log.warning(
                "keytrace harness: vLLM's scheduler shutdown failed (%s: %s)",
                type(exc).__name__,
                exc,
            )

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ construction
    def _check_built(self) -> None:
        """The connector must have exactly the geometry asked for, and a real manager (a
        CPU tier, alone or as the primary of a tiered manager)."""
        base = self.cpu_tier
        if not isinstance(base, CPUOffloadingManager):
            raise RuntimeError(f"expected CPUOffloadingManager, got {type(base).__name__}")
        num_chunks = getattr(base, "_num_chunks", None)
        if num_chunks is None:
            num_chunks = getattr(getattr(base, "info", None), "num_chunks", None)
        if num_chunks is not None and num_chunks != self.geometry.cpu_chunks:
            raise RuntimeError(
                f"CPU manager has {num_chunks} chunks, asked for {self.geometry.cpu_chunks}"
            )
        cfgs = self.connector_scheduler.config.kv_group_configs
        if len(cfgs) != len(self.geometry.groups):
            raise RuntimeError(
                f"{len(cfgs)} offloaded groups, geometry has {len(self.geometry.groups)}"
            )
        for cfg, g in zip(cfgs, self.geometry.groups, strict=True):
            if cfg.tokens_per_chunk != g.block_size * self.geometry.blocks_per_chunk:
                raise RuntimeError(
                    f"group {cfg.group_idx}: tokens_per_chunk {cfg.tokens_per_chunk}"
                )
            if bool(cfg.is_eagle_group) != g.eagle:
                raise RuntimeError(f"group {cfg.group_idx}: is_eagle_group {cfg.is_eagle_group}")
            if (cfg.sliding_window_size_in_chunks is None) != (g.sliding_window is None):
                raise RuntimeError(
                    f"group {cfg.group_idx}: window {cfg.sliding_window_size_in_chunks}"
                )

    def _observe_connector(self) -> None:
        """Watch the connector's public API through the patch table's ``harness`` rows."""
        from keytrace.vllm.hook.patches import apply_instance

        apply_instance("harness", "connector", self.connector, self)

    def on_lookup(self, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """After ``get_num_new_matched_tokens(request, num_computed_tokens)``."""
        request = args[0] if args else kwargs["request"]
        local = args[1] if len(args) > 1 else kwargs["num_computed_tokens"]
        obs = self.observations.get(request.request_id)
        if obs is not None:
            obs.lookups.append((local, result[0]))
            obs.accepted.append(None)

    def on_alloc(self, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """After ``update_state_after_alloc(request, blocks, num_external_tokens)``.

        The first allocation after a lookup carries its accepted count; later calls (e.g.
        when an async load resumes the request) pass 0.
        """
        request = args[0] if args else kwargs["request"]
        n = args[2] if len(args) > 2 else kwargs["num_external_tokens"]
        obs = self.observations.get(request.request_id)
        if obs is not None and obs.accepted and obs.accepted[-1] is None:
            obs.accepted[-1] = n

    # ---------------------------------------------------------------- requests
    def tokens(self, n: int, *, chain: int = 0) -> list[int]:
        """Deterministic synthetic token ids; equal ``chain`` means equal prefixes."""
        base = (self.seed * 1_000_003 + chain * 7919) % 9973
        return [(base + i * 31 + (i // 997)) % (_VOCAB - 100) + 50 for i in range(n)]

    def submit(self, num_tokens: int, *, chain: int = 0, max_tokens: int = 1) -> str:
        """Add a request of ``num_tokens`` synthetic prompt tokens; returns its id."""
        return self.submit_tokens(self.tokens(num_tokens, chain=chain), max_tokens=max_tokens)

    def submit_tokens(
        self, token_ids: list[int], *, max_tokens: int = 1, req_id: str | None = None
    ) -> str:
        """Add a request with these prompt token ids; returns its id."""
        self._req_counter += 1
        rid = req_id or f"{self.request_prefix}{self._req_counter}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self.observations[rid] = EpisodeObservation(rid, len(token_ids))
        self.scheduler.add_request(req)
        return rid

    # ------------------------------------------------------------------- steps
    def step(self) -> SchedulerOutput:
        """One engine step: schedule, fake worker, model output, update."""
        out = self.scheduler.schedule()
        self.step_count += 1
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        self.digests.append(_digest(out, meta))
        kv_out = self.worker.run(meta)
        mro = self._model_output(out, kv_out)
        if self.geometry.async_scheduling:
            if self._pending_async is not None:
                self.scheduler.update_from_output(*self._pending_async)
            self._pending_async = (out, mro)
        else:
            self.scheduler.update_from_output(out, mro)
        if self.secondary_tiers:
            self.settle_tiers()
        return out

    def _model_output(self, out: SchedulerOutput, kv_out: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = self.scheduler.requests.get(rid)
            # The real runner samples only once the request's known tokens are computed.
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _with_tier_dirs(self, geometry: Geometry) -> Geometry:
        """``geometry`` with a fresh temporary ``root_dir`` for each ``fs`` tier that has
        none (a replay of a recorded trace: `keytrace.analysis.geometry.geometry_from_header`
        drops the recorded folder, which holds the original run's data), removed when the
        harness is collected."""
        tiers = geometry.extra.get("secondary_tiers")
        if not tiers or all(t.get("type") != "fs" or t.get("root_dir") for t in tiers):
            return geometry
        root = tempfile.mkdtemp(prefix="keytrace-tier-")
        weakref.finalize(self, shutil.rmtree, root, True)
        rooted = [
            {**t, "root_dir": os.path.join(root, f"tier{i}")}
            if t.get("type") == "fs" and not t.get("root_dir")
            else t
            for i, t in enumerate(tiers)
        ]
        return geometry.with_(extra={**geometry.extra, "secondary_tiers": rooted})

    def run_until_idle(self, max_steps: int = 100_000, *, give_up: bool = False) -> int:
        """Step until no request is left and every store was acknowledged. ``give_up``:
        abort a request deferred `ABORT_DEFERRALS` times in a row (`abort_stalled`), as a
        client would, where a tiered manager would otherwise keep it waiting forever."""
        steps = 0
        quiet = 0
        while quiet < 2:
            if steps >= max_steps:
                raise RuntimeError(f"scheduler did not drain in {max_steps} steps")
            self.step()
            if give_up:
                self.abort_stalled()
            steps += 1
            busy = (
                self.scheduler.has_requests()
                or not self.worker.idle
                or (bool(self.secondary_tiers) and self.manager.has_pending_work())
            )
            quiet = 0 if busy else quiet + 1
        if self._pending_async is not None:
            self.scheduler.update_from_output(*self._pending_async)
            self._pending_async = None
        return steps

    def abort_stalled(self) -> int:
        """Abort every request whose last `ABORT_DEFERRALS` lookups were deferred; how many."""
        from vllm.v1.request import RequestStatus

        stuck = [
            rid
            for rid in list(self.scheduler.requests)
            if (obs := self.observations.get(rid)) is not None
            and len(obs.lookups) >= ABORT_DEFERRALS
            and all(x is None for _, x in obs.lookups[-ABORT_DEFERRALS:])
        ]
        if stuck:
            self.scheduler.finish_requests(stuck, RequestStatus.FINISHED_ABORTED)
        return len(stuck)

    def reset_gpu_prefix_cache(self) -> None:
        """Drop the GPU prefix cache only; the CPU tier keeps what it stored."""
        if not self.scheduler.reset_prefix_cache(reset_connector=False):
            raise RuntimeError("GPU prefix cache reset refused (requests still running)")

    def flush_gpu_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_running_requests=True)`` (what the server's
        reset endpoint does): preempt every running request and drop the GPU prefix cache;
        the CPU tier keeps what it stored. Skipped (False) while a request waits for, or
        has just finished, an asynchronous load: vLLM cannot preempt it."""
        sched = self.scheduler
        loading = any(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in sched.requests.values())
        if loading or getattr(sched, "finished_recving_kv_req_ids", None):
            return False
        if self._pending_async is not None:
            self.scheduler.update_from_output(*self._pending_async)
            self._pending_async = None
        return bool(
            self.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
        )

    def scenario(self, num_tokens: int, *, chain: int = 0) -> ScenarioResult:
        """Prime ``num_tokens`` (stores acknowledged), reset GPU cache, resend, observe."""
        first = self.submit(num_tokens, chain=chain)
        steps = self.run_until_idle()
        self.reset_gpu_prefix_cache()
        second = self.submit(num_tokens, chain=chain)
        steps += self.run_until_idle()
        return ScenarioResult(
            num_tokens=num_tokens,
            prime=self.observations[first],
            replay=self.observations[second],
            steps=steps,
        )

    # ----------------------------------------------------------------- helpers
    @property
    def cpu_tier(self) -> Any:
        """The CPU manager: the manager itself, or a tiered manager's primary tier."""
        return getattr(self.manager, "primary_tier", self.manager)

    @property
    def secondary_tiers(self) -> list[Any]:
        """A tiered manager's secondary tiers (none for a CPU-only one)."""
        return list(getattr(self.manager, "secondary_tiers", None) or ())

    def settle_tiers(self, timeout: float = 10.0) -> None:
        """Wait until every secondary tier's I/O submitted so far is done: its transfer
        jobs (``drain_jobs``, vLLM's own) and its asynchronous lookups (the fs tier's
        lookup thread). Between two steps this models I/O that finishes while the model
        runs, as on a server whose disk keeps up, and makes a run repeatable. Reads the
        lookup state only (``_lookup_manager``); vLLM's code runs unchanged."""
        deadline = time.monotonic() + timeout
        for tier in self.secondary_tiers:
            tier.drain_jobs()
            lookups = getattr(tier, "_lookup_manager", None)
            states = getattr(lookups, "_lookup_state", None)
            if states is None:
                continue
            while time.monotonic() < deadline and any(
                getattr(st.phase, "name", "") == "IN_FLIGHT" for st in list(states.values())
            ):
                if not getattr(lookups, "_pending_results").empty():  # noqa: B009
                    break  # answered: the next lookup applies it
                time.sleep(0.001)

    def cpu_keys(self) -> dict[bytes, bool]:
        """Keys the real CPU manager holds now -> ready flag (read-only inspection)."""
        return _policy_keys(self.cpu_tier)


def _digest(out: SchedulerOutput, meta: OffloadingConnectorMetadata) -> tuple[Any, ...]:
    """A comparable summary of one step's scheduling and transfer decisions."""

    def spec_ids(spec: Any) -> tuple[int, ...]:
        ids = getattr(spec, "block_ids", None)
        return tuple(int(x) for x in ids) if ids is not None else ()

    return (
        tuple(sorted(out.num_scheduled_tokens.items())),
        tuple(sorted(out.finished_req_ids or ())),
        tuple(sorted((j, t.req_id, spec_ids(t.src_spec)) for j, t in meta.store_jobs.items())),
        tuple(
            sorted((j, t.req_id, spec_ids(t.dst_spec), t.sync) for j, t in meta.load_jobs.items())
        ),
        tuple(sorted(meta.jobs_to_flush or ())),
    )


def _policy_keys(manager: CPUOffloadingManager) -> dict[bytes, bool]:
    policy = getattr(manager, "_policy", None) or getattr(manager, "policy", None)
    for attr in ("chunks", "blocks", "_blocks", "cache", "_cache"):
        table = getattr(policy, attr, None)
        if isinstance(table, dict):
            return {bytes(k): bool(getattr(v, "is_ready", True)) for k, v in table.items()}
    raise RuntimeError("cannot read the CPU manager's key table")
