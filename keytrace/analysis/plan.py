"""What a replay needs from a trace, as plain data (no vLLM): the `ReplayPlan`.

A plan names one recorded episode and the requests that stored its chain before it, by
prompt length only (token ids are never recorded or needed: the harness's synthetic tokens
share prefixes exactly like the recorded chain did), plus the geometry and step budget from
the header, the recorded step schedule, and what the differ said about the episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from keytrace._version import __version__
from keytrace.analysis import frames
from keytrace.analysis.diff import EpisodeVerdict, diff
from keytrace.analysis.geometry import geometry_from_header
from keytrace.errors import TraceError
from keytrace.format.reader import Trace
from keytrace.format.schema import SCHEMA_VERSION
from keytrace.judge.definitions import ASKED_AGAIN, FINDINGS, Verdict, is_request


@dataclass(frozen=True)
class ReplayPlan:
    geometry: dict[str, Any]
    prime_lengths: list[int]
    episode_length: int
    local_tokens: int
    expected_E: int | None
    recorded_external: int | None
    recorded_verdict: str
    binding_group: int | None
    terminal_chunk: int | None
    cause: str | None
    request: str
    recorded_steps: list[list[int]] | None = field(default_factory=list)
    """Tokens scheduled per step, per replayed request; None when the trace has no step
    rows (they are needed only to compare schedules, never for a verdict)."""
    keytrace_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    vllm_version: str = "?"
    request_limits: list[dict[str, Any]] = field(default_factory=list)
    """What each replayed request asked of the connector, primes first, then the episode's
    (``max_load_tokens``, ``max_offload_tokens``, ``skip_reading_kv``, as its first recorded
    episode row says; `keytrace.vllm.lab.replay.replay` resends them); empty: none asked
    anything (and every plan written before limits were recorded)."""
    num_hash_lookahead_tokens: int = 0
    """L of the recording (its header's ``num_hash_lookahead_tokens``: each block hash
    covers the next L tokens, vLLM 0.34.0 with an EAGLE/MTP drafter). vLLM resolves it
    from the drafter when the lab replays; the vLLM-only test sets it itself."""

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values; L only when it is not 0, so plans without
        lookahead read and write as they did before it was recorded."""
        out = asdict(self)
        if not self.num_hash_lookahead_tokens:
            del out["num_hash_lookahead_tokens"]
        return out


def _choose(report_all: Sequence[EpisodeVerdict], request: str | None) -> EpisodeVerdict:
    """The episode to replay: ``request``'s last answered one; else the first finding (a
    mismatch, else the first episode of a stalled request), else the first explained or
    hit episode, else the last."""
    eps = [v for v in report_all if v.verdict not in ASKED_AGAIN]
    if request is None:
        for want in FINDINGS:
            pick = [v for v in report_all if v.verdict == want]
            if pick:
                return pick[0]
    if request is not None:
        mine = [v for v in eps if is_request(v.req_id, request)]
        if not mine:
            raise TraceError(
                f"request {request!r} has no non-deferred lookup episode in this trace"
            )
        return mine[-1]
    for want in (Verdict.EXPLAINED, Verdict.HIT):
        pick = [v for v in eps if v.verdict == want]
        if pick:
            return pick[0]
    if eps:
        return eps[-1]
    raise TraceError("trace has no lookup episode to replay")


def plan_from_trace(trace: Trace, *, request: str | None = None) -> ReplayPlan:
    """Build the plan for ``request``'s last episode, or the trace's first mismatch.

    Raises `TraceError` when the header lacks what replay needs.
    """
    report = diff(trace, request=request, all_episodes=True)
    return plan_for(trace, _choose(report.episodes, request))


def plan_for(trace: Trace, v: EpisodeVerdict) -> ReplayPlan:
    """The replay plan of one judged episode: its chain (the differ's own: the earlier
    requests whose intended boundaries it shares, oldest first) as primes, then itself."""
    try:
        geometry = geometry_from_header(trace.header)
    except ValueError as exc:
        raise TraceError(f"cannot replay: {exc}") from exc
    prompts = dict(
        frames.episodes(trace)
        .filter(pl.col("inst") == v.instance_id)
        .group_by("req_id")
        .agg(pl.col("P").max())
        .pipe(frames.collect)
        .iter_rows()
    )
    primes = [(rid, prompts[rid]) for rid in v.chain if rid in prompts]
    group, chunk, cause = v.evidence()
    asked = _request_limits(trace, v.instance_id, [rid for rid, _ in primes] + [v.req_id])
    return ReplayPlan(
        geometry=geometry.to_dict(),
        prime_lengths=[p for _, p in primes],
        episode_length=v.num_prompt_tokens,
        local_tokens=v.S,
        expected_E=v.E,
        recorded_external=v.external_tokens,
        recorded_verdict=v.verdict,
        binding_group=group,
        terminal_chunk=chunk,
        cause=cause,
        request=v.req_id,
        recorded_steps=_recorded_steps(trace, v, [rid for rid, _ in primes]),
        vllm_version=str(trace.header.get("vllm_version", "?")),
        request_limits=asked if any(any(a.values()) for a in asked) else [],
        num_hash_lookahead_tokens=int(trace.header.get("num_hash_lookahead_tokens") or 0),
    )


def _request_limits(trace: Trace, inst: int, req_ids: list[str]) -> list[dict[str, Any]]:
    """Per request (in ``req_ids``' order), what its first episode row on ``inst`` says it
    asked of the connector."""
    eps = frames.collect(
        frames.episodes(trace)
        .filter(pl.col("inst") == inst)
        .sort("s")
        .group_by("req_id", maintain_order=True)
        .agg(pl.col("max_load", "max_offload", "skip").first())
    )
    rows = {r: (m, o, bool(k)) for r, m, o, k in eps.iter_rows()}
    out = []
    for rid in req_ids:
        m, o, k = rows.get(rid, (None, None, False))
        out.append({"max_load_tokens": m, "max_offload_tokens": o, "skip_reading_kv": k})
    return out


def _recorded_steps(trace: Trace, v: EpisodeVerdict, primes: list[str]) -> list[list[int]] | None:
    if not trace.parts_of("step"):
        return None
    steps = (
        trace.frame("step")
        .filter((pl.col("instance_id") == v.instance_id) & ~pl.col("finished"))
        .with_columns(pl.col("req_id").cast(pl.String))
        .sort("seq")
        .pipe(frames.collect)
    )
    # Primes: their steps before the episode; the episode's own request: its steps after it.
    recorded = [
        steps.filter((pl.col("req_id") == rid) & (pl.col("seq") < v.episode))[
            "scheduled_tokens"
        ].to_list()
        for rid in primes
    ]
    recorded.append(
        steps.filter((pl.col("req_id") == v.req_id) & (pl.col("seq") > v.episode))[
            "scheduled_tokens"
        ].to_list()
    )
    return recorded
