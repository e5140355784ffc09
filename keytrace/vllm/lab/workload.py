"""Realistic traffic through the real vLLM scheduler, recorded: what a server sees.

`run_workload` drives one or more real schedulers (`Harness`, one per data-parallel engine,
all recorded into one trace) with a seeded workload:

- conversations of several turns; each turn is the previous prompt, the previous output
  and a new message, so every turn extends the last one;
- a few system prompts shared across conversations;
- identical resends of earlier turns;
- arrivals spread over engine steps, so several requests are in flight at once;
- a CPU tier small enough for LRU evictions, few enough GPU blocks for preemptions;
- store acknowledgements delayed by a few steps (lookups see HIT_PENDING, vLLM defers);
- every few steps vLLM's own ``reset_prefix_cache(reset_running_requests=True)``: the GPU
  prefix cache is dropped and running requests are preempted (they look up again), as
  under GPU memory pressure; the CPU tier keeps its content;
- async scheduling; two engines, with a conversation's next turn sometimes routed to the
  other one (its offloaded prefix then lives on an engine the turn cannot reach);
- with ``tiers`` (e.g. ``("fs",)``): vLLM's tiered manager, the CPU tier as its primary
  over those secondary tiers, one disk folder shared by the engines (as llm-d's shared
  file system); a request the tiered manager defers `keytrace.vllm.lab.harness.ABORT_DEFERRALS` times in a row is
  aborted, as a client that gives up would.

Lengths are drawn from ranges several full-attention chunks wide, so prompts land on every
residue class of that chunk. Everything is derived from ``seed``: the same spec records
the same traffic. Imports vLLM (through the harness).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from keytrace.analysis.diff import DiffReport
from keytrace.analysis.geometry import Drafter, Geometry, builtin
from keytrace.errors import KeytraceError
from keytrace.live.registry import AlarmSettings
from keytrace.vllm import require_vllm
from keytrace.vllm.lab.oracle import OracleCase

ProgressFn = Callable[[str, int, int], None]
STALL_STEPS = 500


@dataclass(frozen=True)
class WorkloadSpec:
    """Every knob of `run_workload`. Token ranges are in units of the full-attention
    chunk A (so one spec means the same thing on every geometry)."""

    geometry: str = "dsv4"
    seed: int = 0
    conversations: int = 24
    turns: tuple[int, int] = (2, 4)
    system_prompts: int = 2
    system_chunks: tuple[float, float] = (2.0, 8.0)
    message_chunks: tuple[float, float] = (0.3, 6.0)
    output_tokens: tuple[int, int] = (1, 24)
    resend_rate: float = 0.2
    arrival_steps: int = 40
    think_steps: tuple[int, int] = (5, 40)
    engines: int = 2
    reroute_rate: float = 0.25
    cpu_chunks: int | None = None  # default: small enough for LRU evictions
    gpu_prompts: float = 2.0  # GPU blocks for this many average prompts: churn, preemption
    store_delay: int = 3
    gpu_flush_steps: int = 20  # every N steps: GPU prefix cache dropped, running preempted
    async_scheduling: bool = True
    budget: int | None = None  # max_num_batched_tokens; default the geometry's
    inject: str | None = None
    fix: str | None = None  # a candidate fix (keytrace.vllm.mods.fixes) active for the whole run
    tiers: tuple[str, ...] = ()  # secondary tiers under the CPU tier (keytrace.vllm.lab.harness)
    drafter: Drafter | None = None  # a speculative drafter on the built-in geometry
    blocks_per_chunk: int | None = None  # default: the built-in geometry's
    dcp: int | None = None  # decode context parallel size; default the geometry's (1)
    prefix_match_unit: int | None = None  # vLLM's --prefix-match-unit; default none
    retention_interval: int | None = 0  # vLLM's prefix_cache_retention_interval (None: dense)


@dataclass
class WorkloadResult:
    trace_dir: str
    spec: WorkloadSpec
    requests: int = 0
    turns: int = 0
    resends: int = 0
    rerouted: int = 0
    gpu_flushes: int = 0
    steps: int = 0
    seconds: float = 0.0
    aborted: int = 0
    longest_prompt: int = 0
    request_engines: dict[str, int] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    """Every request's prompt token ids (the trace records no tokens; the oracle needs them)."""


@dataclass
class _Conversation:
    cid: int
    home: int
    history: list[int]
    turns_left: int
    next_step: int
    waiting: tuple[int, str, int, list[int]] | None = None  # engine, req id, outputs, prompt


def _unit(geometry: Geometry) -> int:
    return geometry.alignment_unit


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30_000) for _ in range(n)]


def _blocks(geo: Geometry, tokens: int) -> int:
    """GPU blocks vLLM wants free to admit a request of ``tokens``: a block per
    ``block_size`` tokens in every group (measured on 0.33.0: a prompt prefilled in one
    step is allocated whole in windowed groups too, which free the rest afterwards); a
    block spans `Geometry.tokens_per_block` tokens (more than ``block_size`` under decode
    context parallelism)."""
    return sum(-(-tokens // geo.tokens_per_block(i)) + 1 for i in range(len(geo.groups)))


def workload_geometry(spec: WorkloadSpec) -> Geometry:
    """The geometry the workload runs on: the built-in one with the spec's pressure.

    The GPU block pool holds ``gpu_prompts`` average prompts (never less than the longest
    possible one, so every request can run alone): small enough that the GPU prefix cache
    churns and running requests get preempted.
    """
    geo = builtin(spec.geometry)
    if spec.drafter is not None:
        geo = geo.with_(drafter=spec.drafter)
    if spec.blocks_per_chunk is not None:
        geo = geo.with_(blocks_per_chunk=spec.blocks_per_chunk)
    if spec.dcp is not None:
        geo = geo.with_(dcp=spec.dcp)
    if spec.prefix_match_unit is not None:
        geo = geo.with_(prefix_match_unit=spec.prefix_match_unit)
    if spec.retention_interval != geo.retention_interval:
        geo = geo.with_(retention_interval=spec.retention_interval)
    a = _unit(geo)
    budget = spec.budget or geo.max_num_batched_tokens

    def mid(r: tuple[float, float]) -> float:
        return (r[0] + r[1]) / 2

    turns = mid(spec.turns)
    mean = a * (mid(spec.system_chunks) + turns * mid(spec.message_chunks))
    mean += turns * mid(spec.output_tokens)
    longest = int(a * (spec.system_chunks[1] + spec.turns[1] * spec.message_chunks[1]))
    longest += spec.turns[1] * spec.output_tokens[1] + a
    pool = max(int(spec.gpu_prompts * _blocks(geo, int(mean))), _blocks(geo, longest))
    return geo.with_(
        async_scheduling=spec.async_scheduling,
        max_num_batched_tokens=budget,
        max_model_len=max(geo.max_model_len, longest + 1024),
        cpu_chunks=spec.cpu_chunks or 64 * len(geo.groups),
        num_gpu_blocks=pool + 16,
    )


def run_workload(
    spec: WorkloadSpec,
    trace_dir: str | None,
    *,
    progress: ProgressFn | None = None,
    alarm: AlarmSettings | None = None,
) -> WorkloadResult:
    """Record ``spec``'s traffic into ``trace_dir`` (see the module docstring); with
    ``trace_dir=None`` run the same traffic unrecorded (the recorder benchmark's baseline).
    The final flush of every part is part of the run."""
    require_vllm()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="keytrace-tier-") as disk:
        return _run(spec, trace_dir, progress, alarm, disk)


@dataclass
class WorkloadStudy:
    """A recorded workload and what was found in it (`study_workload`)."""

    result: WorkloadResult
    report: DiffReport
    """The differ's report of the trace."""
    alarm_counts: dict[str, int] | None = None
    """The live alarm's episodes by verdict (None: it did not run)."""
    alarm_warnings: int = 0
    oracle: list[OracleCase] | None = None
    """Every shortfall looked up again in isolation (None: the oracle did not run)."""

    @property
    def disagreements(self) -> list[OracleCase]:
        return [c for c in self.oracle or () if not c.agree]


def study_workload(
    spec: WorkloadSpec,
    trace_dir: str,
    *,
    alarm: bool = False,
    oracle: bool = False,
    progress: ProgressFn | None = None,
) -> WorkloadStudy:
    """Record ``spec``'s traffic into ``trace_dir``, diff it, and, as asked, run the live
    alarm beside the recording and the isolated-lookup oracle on every shortfall
    (`keytrace.vllm.lab.oracle.check`): what ``keytrace workload`` prints."""
    from keytrace.analysis.diff import diff
    from keytrace.format.reader import open_trace
    from keytrace.live.registry import live_totals

    result = run_workload(
        spec, trace_dir, progress=progress, alarm=AlarmSettings() if alarm else None
    )
    study = WorkloadStudy(result, diff(open_trace(trace_dir)))
    if alarm:
        study.alarm_counts, study.alarm_warnings = live_totals()
    if oracle:
        from keytrace.vllm.lab.oracle import check

        study.oracle = check(trace_dir, result.prompts, progress=progress)
    return study


def _run(
    spec: WorkloadSpec,
    trace_dir: str | None,
    progress: ProgressFn | None,
    alarm: AlarmSettings | None,
    disk: str,
) -> WorkloadResult:
    from keytrace.vllm.hook.patches import fixed, injected, recording
    from keytrace.vllm.lab.config import tiered
    from keytrace.vllm.lab.harness import Harness

    rng = random.Random(spec.seed)
    geo = workload_geometry(spec)
    if spec.tiers:
        geo = tiered(geo, spec.tiers, disk)
    a = _unit(geo)
    systems = [
        _tokens(rng, int(a * rng.uniform(*spec.system_chunks))) for _ in range(spec.system_prompts)
    ]
    convs = [
        _Conversation(
            cid=c,
            home=c % spec.engines,
            history=list(systems[rng.randrange(len(systems))]) if systems else [],
            turns_left=rng.randint(*spec.turns),
            next_step=rng.randrange(max(1, spec.arrival_steps)),
        )
        for c in range(spec.conversations)
    ]
    resends: list[tuple[int, int, list[int], int]] = []  # (due step, engine, prompt, outputs)
    res = WorkloadResult(trace_dir=trace_dir or "", spec=spec)
    t0 = time.monotonic()
    total_turns = sum(c.turns_left for c in convs)
    record = (
        recording(trace_dir, alarm)
        if trace_dir is not None or alarm is not None
        else contextlib.nullcontext()
    )
    with fixed(spec.fix), injected(spec.inject), record:
        engines = [
            Harness(geo, dp_rank=i, store_delay=spec.store_delay, request_prefix=f"e{i}-r")
            for i in range(spec.engines)
        ]
        step = last_progress = 0
        while True:
            for c in convs:
                if c.waiting is None and c.turns_left > 0 and c.next_step <= step:
                    _send_turn(c, spec, rng, engines, res, a)
            due = [r for r in resends if r[0] <= step]
            for r in due:
                resends.remove(r)
                rid = engines[r[1]].submit_tokens(r[2], max_tokens=r[3])
                res.resends += 1
                res.request_engines[rid] = r[1]
                res.prompts[rid] = r[2]
            for h in engines:
                busy = h.scheduler.has_requests() or not h.worker.idle
                if busy and h.step().num_scheduled_tokens:
                    last_progress = step
                res.aborted += h.abort_stalled()
            step += 1
            if spec.gpu_flush_steps and step % spec.gpu_flush_steps == 0:
                res.gpu_flushes += sum(h.flush_gpu_cache() for h in engines)
            if step - last_progress > STALL_STEPS:
                raise KeytraceError(
                    f"workload stalled: nothing scheduled for {STALL_STEPS} steps (GPU pool of "
                    f"{geo.num_gpu_blocks} blocks too small for a waiting request?)"
                )
            for c in convs:
                _collect_turn(c, spec, rng, engines, resends, step)
            if progress is not None:
                done = total_turns - sum(c.turns_left for c in convs)
                progress("turns", done, total_turns)
            if all(c.turns_left == 0 and c.waiting is None for c in convs) and not resends:
                break
        for h in engines:
            while h.scheduler.has_requests():  # the last turns; a stalled one is aborted
                h.step()
                res.aborted += h.abort_stalled()
            h.run_until_idle()
        res.steps = step
    res.requests = len(res.request_engines)
    res.seconds = time.monotonic() - t0
    return res


def _send_turn(
    c: _Conversation,
    spec: WorkloadSpec,
    rng: random.Random,
    engines: list,  # type: ignore[type-arg]
    res: WorkloadResult,
    a: int,
) -> None:
    prompt = c.history + _tokens(rng, max(1, int(a * rng.uniform(*spec.message_chunks))))
    engine = c.home
    if spec.engines > 1 and rng.random() < spec.reroute_rate:
        engine = (c.home + 1 + rng.randrange(spec.engines - 1)) % spec.engines
        res.rerouted += 1
    outputs = rng.randint(*spec.output_tokens)
    rid = engines[engine].submit_tokens(prompt, max_tokens=outputs)
    c.waiting = (engine, rid, outputs, prompt)
    res.turns += 1
    res.request_engines[rid] = engine
    res.prompts[rid] = prompt
    res.longest_prompt = max(res.longest_prompt, len(prompt))


def _collect_turn(
    c: _Conversation,
    spec: WorkloadSpec,
    rng: random.Random,
    engines: list,  # type: ignore[type-arg]
    resends: list[tuple[int, int, list[int], int]],
    step: int,
) -> None:
    if c.waiting is None:
        return
    engine, rid, outputs, prompt = c.waiting
    if rid in engines[engine].scheduler.requests:
        return
    from keytrace.vllm.lab.harness import OUTPUT_TOKEN

    c.waiting = None
    c.turns_left -= 1
    c.history = prompt + [OUTPUT_TOKEN] * outputs
    c.next_step = step + rng.randint(*spec.think_steps)
    if rng.random() < spec.resend_rate:
        target = rng.randrange(spec.engines)
        resends.append((step + rng.randint(1, 6), target, prompt, outputs))
