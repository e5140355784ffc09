"""The oracle for the differ's verdicts on real traffic: isolated lookup on the real scheduler.

A shortfall episode recorded under concurrency, evictions, in-flight stores, preemption and
two engines is looked up again alone: its request, with its real token ids, on a fresh
real scheduler whose real CPU manager holds, stored and settled,

- the full-attention chunks up to the episode's expected boundary E (which were resident:
  E never exceeds the resident full-attention prefix), and no further: the differ's claim
  is about E, and a lookup allowed past it could reach some other boundary (another
  engine's, say) and say nothing about E, and
- every windowed-group key any request *offered* before the episode (on its engine before
  its sequence number, on other engines before its wall-clock time).

What the store path decided to write stays; eviction, in-flight timing, allocation failure
and routing of the chunks E needs are taken away. So the differ must say

- ``explained`` exactly when the isolated lookup reaches the episode's E: every cause it
  may name (in flight, evicted, another engine, a failed store) is one isolation removed;
- ``mismatch`` exactly when it is still short: the store path never decided to write what
  lookup needs (or wrote it under another group, or declined it).

Why not replay the chain's requests as primes instead: some of vLLM's store decisions
depend on the GPU prefix cache at that moment (a request whose GPU hit reached deeper in
full attention than in its windowed groups keeps window tails at that junction too), which
a sequential replay does not reproduce; the recorded offers are what vLLM decided.

Needs the token ids (the trace does not carry them): `keytrace.vllm.lab.workload` keeps them.
Imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import polars as pl

from keytrace.analysis import frames
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import geometry_from_header
from keytrace.analysis.results import EpisodeVerdict
from keytrace.format.reader import Trace, open_trace

ProgressFn = Callable[[str, int, int], None]
AMPLE_CPU_CHUNKS = 2_000_000
OFFERED = ("prepared", "failed")  # accepted, or refused for lack of room: capacity


@dataclass(frozen=True)
class OracleCase:
    """One shortfall episode: what the differ said and what its isolated lookup did."""

    req_id: str
    engine_id: str | None
    episode: int
    verdict: str
    cause: str | None
    binding_group: int | None
    num_tokens: int
    local_tokens: int
    external_tokens: int | None
    E: int | None
    resident_keys: int
    isolated_external: int
    agree: bool

    @property
    def isolated_reaches_E(self) -> bool:
        return self.E is not None and self.isolated_external >= self.E

    def describe(self) -> str:
        """One line for a failing test."""
        return (
            f"{self.req_id} ({self.engine_id}, episode {self.episode}): differ said {self.verdict}"
            f" (group {self.binding_group}, cause {self.cause}; S={self.local_tokens}, "
            f"external {self.external_tokens}, E={self.E}); isolated lookup of "
            f"{self.num_tokens} tokens over {self.resident_keys} offered keys: external "
            f"{self.isolated_external}"
        )


def agrees(verdict: str, reaches_E: bool) -> bool:
    """The differ's verdict against the isolated lookup (see the module doc)."""
    return reaches_E if verdict == "explained" else not reaches_E


def check(
    trace_dir: str,
    token_ids: Mapping[str, Sequence[int]],
    *,
    progress: ProgressFn | None = None,
) -> list[OracleCase]:
    """Look up every shortfall episode of ``trace_dir`` again in isolation.

    ``token_ids`` maps each request id to the token ids it was submitted with (its prompt;
    output tokens sampled before a preemption are taken as the workload's fixed token).
    """
    from keytrace.vllm.lab.replay import isolated_lookup
    from keytrace.vllm.lab.workload import OUTPUT_TOKEN

    trace = open_trace(trace_dir)
    geo = geometry_from_header(trace.header).with_(cpu_chunks=AMPLE_CPU_CHUNKS, num_gpu_blocks=None)
    report = diff(trace, all_episodes=True)
    todo = [v for v in report.episodes if v.verdict in ("explained", "mismatch")]
    when = _episode_times(trace)
    store = _offers(trace)
    probes = _recorded_keys(trace)
    full_attention = {
        g["group_id"] for g in trace.header["groups"] if g.get("window_chunks") is None
    }
    cases = []
    for i, v in enumerate(todo):
        t, n = when[(v.instance_id, v.episode)]
        fa_limit = v.E if v.E is not None else n
        before = store.filter(
            (
                ((pl.col("inst") == v.instance_id) & (pl.col("seq") < v.episode))
                | ((pl.col("inst") != v.instance_id) & (pl.col("ts") < t))
            )
            & (~pl.col("gid").is_in(list(full_attention)) | (pl.col("end_token") <= fa_limit))
        ).unique("key")
        resident = list(zip(before["key"].to_list(), before["end_token"].to_list(), strict=True))
        prompt = list(token_ids[v.req_id])
        tokens = prompt + [OUTPUT_TOKEN] * (n - len(prompt))
        _local, external = isolated_lookup(geo, tokens, resident, expect=probes.get(v.req_id))
        cases.append(_case(v, n, len(resident), external))
        if progress is not None:
            progress("isolated lookups", i + 1, len(todo))
    return cases


def _episode_times(trace: Trace) -> dict[tuple[int, int], tuple[int, int]]:
    ep = frames.episodes(trace).select("inst", "s", "t", "N").collect()
    return {(i, s): (t, n) for i, s, t, n in ep.iter_rows()}


def _recorded_keys(trace: Trace) -> dict[str, tuple[bytes, int]]:
    """One recorded (key, end token) per request, to check the isolation hashes alike."""
    rows = (
        frames.lookups(trace, heads_only=True)
        .filter(pl.col("end_token").is_not_null())
        .group_by("req_id")
        .agg(pl.col("key", "end_token").first())
        .collect()
    )
    return {r: (bytes(k), int(e)) for r, k, e in rows.iter_rows()}


def _offers(trace: Trace) -> pl.DataFrame:
    """Every key offered to the store path (accepted, or refused for lack of room), with
    where, when and the token its chunk ends at."""
    return (
        trace.frame("store")
        .filter(pl.col("event").cast(pl.String).is_in(OFFERED) & pl.col("key").is_not_null())
        .select(
            pl.col("instance_id").alias("inst"),
            "seq",
            pl.col("ts_ns").alias("ts"),
            pl.col("group_id").alias("gid"),
            "key",
            "end_token",
        )
        .collect()
    )


def _case(v: EpisodeVerdict, num_tokens: int, keys: int, external: int) -> OracleCase:
    _group, _chunk, cause = v.evidence()
    reaches = v.E is not None and external >= v.E
    return OracleCase(
        req_id=v.req_id,
        engine_id=v.engine_id,
        episode=v.episode,
        verdict=v.verdict,
        cause=cause,
        binding_group=v.binding_group,
        num_tokens=num_tokens,
        local_tokens=v.S,
        external_tokens=v.external_tokens,
        E=v.E,
        resident_keys=keys,
        isolated_external=external,
        agree=agrees(v.verdict, reaches),
    )
