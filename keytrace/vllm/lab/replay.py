"""Replay a recorded episode through the real vLLM scheduler on a CPU (imports vLLM lazily).

Used by `keytrace replay` and by every generated regression test: the prime requests that
stored the episode's chain run cold and have their stores acknowledged, the GPU prefix cache
(only) is reset, then the episode's request runs. Everything is recorded and diffed, so a
failing regression explains itself with the binding group, terminal chunk and cause.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from keytrace.analysis.diff import CAUSE_TEXT, diff
from keytrace.analysis.geometry import Geometry
from keytrace.analysis.plan import ReplayPlan, plan_from_trace
from keytrace.analysis.results import NO_VERDICT
from keytrace.errors import TraceError
from keytrace.format.keys import key_gid, make_key
from keytrace.format.reader import Trace, open_trace
from keytrace.judge.definitions import FINDINGS
from keytrace.judge.rules import LIMIT_KEYS
from keytrace.judge.trust import trust_line
from keytrace.vllm import require_vllm


@dataclass(frozen=True)
class ReplayResult:
    external_tokens: int
    local_tokens: int
    expected_E: int | None
    verdict: str
    binding_group: int | None
    binding_label: str | None
    terminal_chunk: int | None
    cause: str | None
    reason: str
    steps: list[list[int]]
    trace_dir: str
    rules_note: str | None = None
    """The diff's first line where the rules are not verified for the installed vLLM
    (`keytrace.judge.trust.trust_line`; None: verified, nothing to say)."""

    def outcome(self) -> dict[str, Any]:
        """The verdict and its evidence, as fuzz.json and minimal.json record them."""
        return {
            "verdict": self.verdict,
            "E": self.expected_E,
            "external_tokens": self.external_tokens,
            "binding_group": self.binding_group,
            "terminal_chunk": self.terminal_chunk,
            "cause": self.cause,
        }

    def explain(self) -> str:
        """One paragraph for an assertion message."""
        e = "-" if self.expected_E is None else f"{self.expected_E:,}"
        msg = f"replay got {self.external_tokens:,} external tokens; expected boundary E={e}; verdict {self.verdict}"
        if self.binding_group is not None:
            msg += f"; binding group {self.binding_group} ({self.binding_label})"
        if self.terminal_chunk is not None:
            msg += f", terminal chunk {self.terminal_chunk:,}"
        cause = CAUSE_TEXT.get(self.cause, self.cause) if self.cause is not None else None
        if cause is not None and cause in self.reason:  # the reason names the cause: once
            msg += f": {self.reason}"
        else:
            msg += f": {cause}" if cause is not None else ""
            msg += f" ({self.reason})" if self.reason else ""
        return msg + f"; trace: {self.trace_dir}"


def replay(
    geometry: Geometry | dict[str, Any],
    prime_lengths: Sequence[int],
    episode_length: int,
    *,
    trace_dir: str | os.PathLike[str] | None = None,
    inject: str | None = None,
    fix: str | None = None,
    request_limits: Sequence[Mapping[str, Any]] = (),
) -> ReplayResult:
    """Prime, reset the GPU prefix cache, run the episode's request; record and diff it.

    The one record-then-diff path: `keytrace replay`, generated regressions, sweeps and the
    demo all come through here. With ``prime_lengths=[n]`` and ``episode_length=n`` it is
    an identical resend after a GPU-only reset.

    ``inject``/``fix`` default to ``KEYTRACE_INJECT``/``KEYTRACE_FIX`` (a generated
    regression's red run, and its green run with a candidate fix); either way they are
    applied for this replay only. ``request_limits``: what each request asked of the
    connector, primes first (`keytrace.analysis.plan.ReplayPlan.request_limits`), resent as
    ``kv_transfer_params`` and the skip flag.
    """
    require_vllm()
    from keytrace.vllm.hook.patches import ENV_FIX, ENV_INJECT, fixed, injected, recording
    from keytrace.vllm.lab.harness import Harness

    inject = inject or os.environ.get(ENV_INJECT) or None
    fix = fix or os.environ.get(ENV_FIX) or None

    geo = geometry if isinstance(geometry, Geometry) else Geometry.from_dict(geometry)
    d = (
        os.fspath(trace_dir)
        if trace_dir is not None
        else tempfile.mkdtemp(prefix="keytrace-replay-")
    )
    longest = max([episode_length, *prime_lengths])
    order: list[str] = []
    with fixed(fix), injected(inject), recording(d):
        h = Harness(geo, max_prompt_tokens=longest)
        asked = list(request_limits) or [{}] * (len(prime_lengths) + 1)

        def submit(n: int, i: int) -> str:
            lim = asked[i] if i < len(asked) else {}
            params = {k: lim[k] for k in LIMIT_KEYS if lim.get(k) is not None}
            return h.submit_tokens(
                h.tokens(n, chain=0),
                kv_transfer_params=params or None,
                skip_reading_prefix_cache=True if lim.get("skip_reading_kv") else None,
            )

        for i, n in enumerate(prime_lengths):
            order.append(submit(n, i))
            h.run_until_idle(give_up=True)
        if prime_lengths:
            h.reset_gpu_prefix_cache()
        rid = submit(episode_length, len(prime_lengths))
        order.append(rid)
        h.run_until_idle(give_up=True)
    h.close()
    trace = open_trace(d)
    report = diff(trace, request=rid, all_episodes=True)
    v = report.episodes[-1]
    steps_df = (
        trace.frame("step")
        .filter(~pl.col("finished"))
        .with_columns(pl.col("req_id").cast(pl.String))
        .sort("seq")
        .collect()
    )
    steps = [steps_df.filter(pl.col("req_id") == r)["scheduled_tokens"].to_list() for r in order]
    group, chunk, cause = v.evidence()
    return ReplayResult(
        external_tokens=h.observations[rid].external_tokens,
        local_tokens=h.observations[rid].local_tokens,
        expected_E=v.E,
        # a geometry keytrace has no rules for (recurrent groups): recorded, not judged
        verdict=NO_VERDICT if report.verdict == NO_VERDICT else v.verdict,
        binding_group=group,
        binding_label=v.binding_label if group is not None else None,
        terminal_chunk=chunk,
        cause=cause,
        reason=v.reason if group is not None or v.verdict in FINDINGS else "",
        steps=steps,
        trace_dir=d,
        rules_note=trust_line(report.rules),
    )


@dataclass(frozen=True)
class TraceReplay:
    """`replay_trace`'s answer: the plan taken from the trace, the replay, and notes."""

    plan: ReplayPlan
    result: ReplayResult
    steps_match: bool | None
    """None: the trace has no step rows, so there was no schedule to compare with."""
    notes: list[str]


def replay_trace(
    trace: Trace, *, request: str | None = None, out_dir: str | None = None
) -> TraceReplay:
    """Plan ``request``'s last episode (default: the first mismatch) and replay it.

    Refuses a trace recorded on another vLLM version: the scheduler rules may differ, so a
    comparison would mean nothing.
    """
    from keytrace.vllm.hook.support import code_identity, vllm_info

    plan = plan_from_trace(trace, request=request)
    require_vllm()
    installed = vllm_info().version or "?"
    if code_identity(plan.vllm_version) != code_identity(installed):
        raise TraceError(
            f"trace was recorded on vLLM {plan.vllm_version}; replay would run vLLM "
            f"{installed}: the scheduler rules may differ, refusing to compare"
        )
    notes = []
    if plan.local_tokens:
        notes.append(
            f"the episode had {plan.local_tokens:,} local (GPU prefix) tokens; the replay "
            "resets the GPU prefix cache, so it starts from 0"
        )
    result = replay(
        plan.geometry,
        plan.prime_lengths,
        plan.episode_length,
        trace_dir=out_dir,
        request_limits=plan.request_limits,
    )
    if plan.recorded_steps is None:
        notes.append(
            "the trace has no step rows, so the step schedule is not compared "
            "(pass its step.parquet too); the verdict does not need them"
        )
        return TraceReplay(plan, result, None, notes)
    return TraceReplay(plan, result, result.steps == plan.recorded_steps, notes)


def _local_keys(h: Any, rid: str, local: int) -> list[tuple[bytes, int | None]]:
    """The request's full-attention keys (with end tokens) for the chunks below ``local``."""
    if local <= 0:
        return []
    hashes = h.scheduler.requests[rid].block_hashes
    out: list[tuple[bytes, int | None]] = []
    for gid, g in enumerate(h.geometry.groups):
        if g.sliding_window is not None:
            continue
        tpc = h.geometry.tokens_per_chunk(gid)
        for c in range(local // tpc):
            end = (c + 1) * tpc
            out.append((make_key(hashes[end // h.hash_block_size - 1], gid), end))
    return out


def _local_states(h: Any, rid: str, local: int) -> list[tuple[bytes, int | None]]:
    """The request's keys a lookup from 0 needs to reach ``local`` as its GPU prefix did:
    the full-attention chunks below it (`_local_keys`) and each recurrent group's state
    ending at it (the GPU kept one there for the prefix hit)."""
    if local <= 0:
        return []
    hashes = h.scheduler.requests[rid].block_hashes
    out: list[tuple[bytes, int | None]] = []
    for gid, g in enumerate(h.geometry.groups):
        tpc = h.geometry.tokens_per_chunk(gid)
        if g.recurrent and local % tpc == 0:
            out.append((make_key(hashes[local // h.hash_block_size - 1], gid), local))
        elif not g.has_window:
            for c in range(local // tpc):
                end = (c + 1) * tpc
                out.append((make_key(hashes[end // h.hash_block_size - 1], gid), end))
    return out


def isolated_lookup(
    geometry: Geometry,
    token_ids: Sequence[int],
    resident: Sequence[tuple[bytes, int | None]],
    *,
    expect: tuple[bytes, int] | None = None,
    secondary: Sequence[bytes] = (),
    pinned_local: int = 0,
    local_states: int = 0,
    max_steps: int = 400,
    kv_transfer_params: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """(local, external) tokens the real scheduler gives ``token_ids`` on a fresh engine
    whose real CPU manager holds exactly ``resident`` (keys with their end-token positions),
    stored and settled: no eviction, nothing in flight, one engine, no concurrency.

    The keys go through the manager's own ``prepare_store``/``complete_store``; everything
    else (hashing, the connector's lookup, the core scheduler) is stock vLLM. A tiered
    ``geometry`` (`keytrace.vllm.lab.config.tiered` over vLLM's in-memory ``example``
    tier) holds ``resident`` in its primary tier and ``secondary`` in that tier: the lookup
    then promotes what it needs, over as many steps as it takes (at most ``max_steps``;
    then the request is aborted and served nothing). ``pinned_local``: the recorded
    episode had that many tokens from the GPU prefix cache, which a fresh engine lacks;
    the request's full-attention chunks below it are placed in the primary and pinned
    there (the caller adds their slots to its capacity), as the GPU held them: found, and
    never a promotion's victim. ``local_states``: the same for a plain CPU tier, where the
    recorded episode's GPU prefix held recurrent states: the request's full-attention
    chunks below it and its recurrent states at it are stored (not pinned: the tier is
    ample), as a partial-tail lookup on vLLM 0.33.0 anchors its window on them.

    ``expect``: a recorded (key, end token) of this request; raises `TraceError` unless the
    request hashes to it here (other token ids, or a different ``PYTHONHASHSEED``, which
    seeds vLLM's hash chain, would make every key differ and the answer meaningless).
    ``kv_transfer_params``: what the request asks of the connector (a recorded request's
    ``max_load_tokens``, say), as a server passes them.
    """
    require_vllm()
    from vllm.v1.kv_offload.base import ReqContext

    from keytrace.vllm.lab.harness import Harness

    with Harness(geometry, max_prompt_tokens=len(token_ids)) as h:
        rid = h.submit_tokens(list(token_ids), max_tokens=1, kv_transfer_params=kv_transfer_params)
        resident = list(resident) + _local_keys(h, rid, pinned_local)
        resident += _local_states(h, rid, local_states)
        if resident:
            ctx = ReqContext(req_id="keytrace-isolation")
            for key, end in resident:
                if end is not None:
                    ctx.set_offload_key_position(key, end)
            keys = [k for k, _ in resident]
            out = h.cpu_tier.prepare_store(keys, ctx)
            if out is None:
                raise RuntimeError("the isolated CPU tier refused the keys: raise its capacity")
            h.cpu_tier.complete_store(out.keys_to_store, ctx)
            pinned = [k for k, _ in _local_keys(h, rid, pinned_local)]
            if pinned:
                h.cpu_tier.prepare_load(pinned, ctx)  # held as a load would hold them: pinned
        for tier in h.secondary_tiers:
            tier.chunks.update(dict.fromkeys(secondary, True))  # vLLM's example tier: key -> held
        if expect is not None:
            key, end = expect
            hashes = h.scheduler.requests[rid].block_hashes
            mine = make_key(hashes[end // h.hash_block_size - 1], key_gid(key))
            if mine != bytes(key):
                raise TraceError(
                    "the isolated request does not hash to its recorded keys: its token ids or "
                    "PYTHONHASHSEED (which seeds vLLM's hash chain) differ from the recording"
                )
        for _ in range(max_steps):
            h.step()
            if not h.scheduler.has_requests():
                break
        else:
            from vllm.v1.request import RequestStatus

            h.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            return h.observations[rid].local_tokens, 0
        h.run_until_idle()
        obs = h.observations[rid]
        return obs.local_tokens, obs.accepted_tokens
