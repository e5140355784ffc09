"""Drive the real vLLM scheduler + OffloadingConnector + its manager on a CPU (`Harness`).

Real, unmodified vLLM: ``Scheduler`` (hybrid KV-cache coordinator, chunked prefill, GPU
prefix cache bookkeeping), the ``OffloadingConnector`` built by the scheduler from a normal
``kv_transfer_config`` (``build_offloading_config`` -> ``CPUOffloadingSpec`` or
``TieringOffloadingSpec`` -> ``OffloadingConnectorScheduler``), and the manager it creates.

Replaced, because a CPU cannot provide them: the GPU worker (`keytrace.vllm.lab.worker`),
the model's weights and KV-cache memory planning (`keytrace.vllm.lab.config` builds the
configs from a `Geometry`). This module drives steps: requests in, the fake worker's
acknowledgements, the model runner's output, what the connector answered.

Importing this module imports vLLM (and torch). The CLI imports it lazily.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from keytrace.analysis.geometry import Geometry
from keytrace.errors import VllmUnavailableError
from keytrace.vllm import require_vllm
from keytrace.vllm.lab import environment
from keytrace.vllm.lab.config import (
    VOCAB,
    build_kv_cache_config,
    build_vllm_config,
    chunk_bytes,
)
from keytrace.vllm.lab.worker import AckWorker, is_sync

log = logging.getLogger("keytrace")

OUTPUT_TOKEN = 7
"""The token the stand-in model samples, every step (a request's history is its prompt and
this token once per output)."""

ABORT_DEFERRALS = 64
"""Deferred lookups in a row after which `Harness.abort_stalled` aborts a request: past
keytrace's stalled rule (`keytrace.judge.definitions.STALL_EPISODES`), so the trace
holds the stalled verdict first."""


def _release(region: Any) -> None:
    """Unlink an unclosed harness's shared memory region (vLLM's ``cleanup``); from a
    finalizer, so it never raises."""
    if region is None:
        return
    try:
        region.cleanup()
    except Exception:
        log.debug("keytrace harness: releasing a shared memory region failed", exc_info=True)


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
        self.world_size = int(probe.parallel_config.world_size)
        self.cpu_bytes_to_use = geometry.cpu_chunks * chunk_bytes(
            geometry, kv_probe, self.world_size
        )
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
        self._hasher = _block_hasher(hash_bs, hash_fn, self.num_hash_lookahead_tokens)
        self.worker = AckWorker(store_delay, workers=self.world_size)
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
    @property
    def num_hash_lookahead_tokens(self) -> int:
        """vLLM's own L: the tokens after each block its hash covers
        (``VllmConfig.num_hash_lookahead_tokens``, resolved from the geometry's drafter and
        the connector; 0 where this vLLM has no such field)."""
        return int(getattr(self.vllm_config, "num_hash_lookahead_tokens", 0) or 0)

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
        offload = self.connector_scheduler.config
        cfgs = offload.kv_group_configs
        if len(cfgs) != len(self.geometry.groups):
            raise RuntimeError(
                f"{len(cfgs)} offloaded groups, geometry has {len(self.geometry.groups)}"
            )
        dcp = (int(offload.dcp_world_size), int(self.scheduler.dcp_world_size))
        if dcp != (self.geometry.dcp, self.geometry.dcp):
            raise RuntimeError(f"decode context parallel size (connector, scheduler) {dcp}")
        for i, (cfg, g) in enumerate(zip(cfgs, self.geometry.groups, strict=True)):
            if cfg.tokens_per_chunk != self.geometry.tokens_per_chunk(i):
                raise RuntimeError(
                    f"group {cfg.group_idx}: tokens_per_chunk {cfg.tokens_per_chunk}"
                )
            if bool(cfg.is_eagle_group) != g.eagle:
                raise RuntimeError(f"group {cfg.group_idx}: is_eagle_group {cfg.is_eagle_group}")
            if (cfg.sliding_window_size_in_chunks is not None) != g.has_window:
                raise RuntimeError(
                    f"group {cfg.group_idx}: window {cfg.sliding_window_size_in_chunks}"
                )
        self._check_lookahead()

    def _check_lookahead(self) -> None:
        """The scheduler and the connector use the config's hash lookahead, which the
        harness's block hasher uses too (the connector never checks that the request's
        hashes were computed with it)."""
        lookahead = self.num_hash_lookahead_tokens
        used = getattr(self.scheduler, "num_hash_lookahead_tokens", lookahead)
        switch = getattr(self.connector_scheduler, "use_lookahead_block_hashes", lookahead > 0)
        if used != lookahead or bool(switch) != (lookahead > 0):
            raise RuntimeError(
                f"hash lookahead: config {lookahead}, scheduler {used}, connector {switch}"
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
        return [(base + i * 31 + (i // 997)) % (VOCAB - 100) + 50 for i in range(n)]

    def submit(
        self,
        num_tokens: int,
        *,
        chain: int = 0,
        max_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Add a request of ``num_tokens`` synthetic prompt tokens; returns its id."""
        return self.submit_tokens(
            self.tokens(num_tokens, chain=chain),
            max_tokens=max_tokens,
            kv_transfer_params=kv_transfer_params,
        )

    def submit_tokens(
        self,
        token_ids: list[int],
        *,
        max_tokens: int = 1,
        req_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        skip_reading_prefix_cache: bool | None = None,
    ) -> str:
        """Add a request with these prompt token ids; returns its id. ``kv_transfer_params``
        reach the connector as a server's request body's do (``SamplingParams.extra_args``);
        ``skip_reading_prefix_cache`` is the sampling params' own flag."""
        self._req_counter += 1
        rid = req_id or f"{self.request_prefix}{self._req_counter}"
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args=extra,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
        )
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
            sampled.append([OUTPUT_TOKEN] if done else [])
        fields: dict[str, Any] = {}
        if _RUNNER_OUTPUT_HAS_INDEX:
            fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_out, **fields
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
        has just finished, an asynchronous load: vLLM cannot preempt it (it is not
        running, and holds its blocks), and would raise."""
        if self._unpreemptable():
            return False
        if self._pending_async is not None:
            self.scheduler.update_from_output(*self._pending_async)
            self._pending_async = None
        return bool(
            self.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
        )

    def _unpreemptable(self) -> bool:
        """A request holds GPU blocks outside the running queue: its asynchronous load is
        in flight, or has landed and it waits to be scheduled with the loaded tokens
        (back in the waiting queue, ``WAITING`` or ``PREEMPTED`` as it was before the
        load, with computed tokens; preemption leaves a request none)."""
        sched = self.scheduler
        if getattr(sched, "finished_recving_kv_req_ids", None):
            return True
        running = {r.request_id for r in sched.running}
        return any(
            r.status.name == "WAITING_FOR_REMOTE_KVS"
            or (r.request_id not in running and r.num_computed_tokens > 0)
            for r in sched.requests.values()
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


def _block_hasher(hash_block_size: int, hash_fn: Any, lookahead: int) -> Any:
    """vLLM's request block hasher as ``EngineCore`` builds it: with the hash lookahead
    where ``get_request_block_hasher`` takes one (0.33.0+), else the two-argument form of
    older releases, which have no lookahead to pass."""
    takes = len(inspect.signature(get_request_block_hasher).parameters)
    if takes >= 3:
        return get_request_block_hasher(hash_block_size, hash_fn, lookahead)
    if lookahead:
        raise RuntimeError(f"hash lookahead {lookahead}, but this vLLM's hasher takes none")
    return get_request_block_hasher(hash_block_size, hash_fn)


_RUNNER_OUTPUT_HAS_INDEX = "req_id_to_index" in {
    f.name for f in dataclasses.fields(ModelRunnerOutput)
}
"""The model runner's output maps request ids to rows itself (required up to 0.33.0;
0.34.0 dropped the field and indexes ``req_ids``)."""


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
            sorted(
                (j, t.req_id, spec_ids(t.dst_spec), is_sync(t)) for j, t in meta.load_jobs.items()
            )
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
