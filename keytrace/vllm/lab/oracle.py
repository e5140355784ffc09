"""The oracle for the differ's verdicts on real traffic: isolated lookup on the real scheduler.

A shortfall episode recorded under concurrency, evictions, in-flight stores, preemption and
two engines is looked up again alone: its request, with its real token ids, on a fresh
real scheduler whose real CPU manager holds, stored and settled,

- the full-attention chunks up to the episode's expected boundary E (which were resident:
  E never exceeds the resident full-attention prefix), and no further: the differ's claim
  is about E, and a lookup allowed past it could reach some other boundary (another
  engine's, say) and say nothing about E (where E falls inside a full-attention chunk, as
  a retention interval that is no multiple of the chunk puts it, that chunk too: a hit at
  E loads its first tokens), and
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

On a tiered manager (a CPU primary over secondary tiers) a second isolated lookup runs on a
fresh tiered manager (vLLM's, over its in-memory ``example`` tier) with the recorded primary
capacity, its primary holding what of the request's keys was resident there at the episode
and its secondary what was durable on a tier: an uncontended manager, the same capacity.
A shortfall on a tiered trace is then a ``mismatch`` exactly when the first isolated lookup
is still short (the store path), or the second one reaches E (the tiered manager could
have served it alone) and the shortfall is not only timing (``in_flight``, ``promoting``,
``promotions_held``, ``primary_busy``: isolation removes that too); otherwise ``explained``. The second
lookup's engine has no GPU prefix cache: the request's full-attention chunks below the
episode's S are pinned in extra primary slots instead (`isolated_lookup`'s
``pinned_local``), so the slots promotions compete for are the recorded ones.

Needs the token ids (the trace does not carry them): `keytrace.vllm.lab.workload` keeps them.
Imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import polars as pl

from keytrace.analysis import frames
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import Geometry, geometry_from_header
from keytrace.analysis.results import EpisodeVerdict
from keytrace.format.keys import key_gid
from keytrace.format.reader import Trace, open_trace
from keytrace.judge.definitions import TIER_TIMING_CAUSES
from keytrace.judge.partial import partial_tails_on

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
    tiered_external: int | None = None
    """The second isolated lookup's tokens (a tiered trace), or None."""

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
            + (
                ""
                if self.tiered_external is None
                else f"; on a fresh tiered manager: external {self.tiered_external}"
            )
        )


TIMING = ("in_flight", *TIER_TIMING_CAUSES)
"""Causes isolation takes away on a tiered manager as well: the store or promotion would
have finished, the other work in flight that held the primary's slots is not there."""


def agrees(
    verdict: str, reaches_E: bool, tier_reaches_E: bool | None = None, timing: bool = False
) -> bool:
    """The differ's verdict against the isolated lookups (see the module doc):
    ``tier_reaches_E`` is the tiered isolated lookup's (None: not a tiered trace),
    ``timing`` whether the shortfall's decisive causes are all timing."""
    mismatch = not reaches_E or bool(tier_reaches_E and not timing)
    return (verdict == "mismatch") == mismatch


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
    from keytrace.vllm.lab.harness import OUTPUT_TOKEN
    from keytrace.vllm.lab.replay import isolated_lookup

    trace = open_trace(trace_dir)
    # the first isolated lookup is on a plain CPU tier, ample: is the key there at all?
    geo = _ample(trace)
    report = diff(trace, all_episodes=True)
    todo = [v for v in report.episodes if v.verdict in ("explained", "mismatch")]
    when = _episode_times(trace)
    store = _offers(trace)
    probes = _recorded_keys(trace)
    full_attention = _full_attention_chunks(trace)
    tier_state = _tier_state(trace, todo) if frames.is_tiered(trace) else None
    partial = partial_tails_on(trace.header)
    tier_geo = None
    if tier_state is not None:
        from keytrace.vllm.lab.config import tiered

        base = geometry_from_header(trace.header).untiered().with_(num_gpu_blocks=None)
        tier_geo = tiered(base, ("example",))
    fa_chunks = (
        [
            tier_geo.tokens_per_chunk(i)
            for i, g in enumerate(tier_geo.groups)
            if g.sliding_window is None
        ]
        if tier_geo is not None
        else []
    )
    cases = []
    for i, v in enumerate(todo):
        t, n = when[(v.instance_id, v.episode)]
        fa_limit = v.E if v.E is not None else n
        before = store.filter(
            (
                ((pl.col("inst") == v.instance_id) & (pl.col("seq") < v.episode))
                | ((pl.col("inst") != v.instance_id) & (pl.col("ts") < t))
            )
            & _below(full_attention, fa_limit)
        ).unique("key")
        resident = list(zip(before["key"].to_list(), before["end_token"].to_list(), strict=True))
        prompt = list(token_ids[v.req_id])
        tokens = prompt + [OUTPUT_TOKEN] * (n - len(prompt))
        # with partial tails the GPU prefix's recurrent state anchors the window (vLLM
        # 0.33.0): a fresh engine has none, so the request's own keys below S stand in
        local = v.S if partial else 0
        _local, external = isolated_lookup(
            geo, tokens, resident, expect=probes.get(v.req_id), local_states=local
        )
        tier_external = None
        if tier_state is not None and tier_geo is not None:
            primary, secondary = tier_state.get((v.instance_id, v.episode), ([], []))
            below = sum(v.S // tpc for tpc in fa_chunks)
            _local, tier_external = isolated_lookup(
                tier_geo.with_(cpu_chunks=tier_geo.cpu_chunks + below),
                tokens,
                primary,
                secondary=secondary,
                pinned_local=v.S,
                expect=probes.get(v.req_id),
            )
        cases.append(_case(v, n, len(resident), external, tier_external))
        if progress is not None:
            progress("isolated lookups", i + 1, len(todo))
    return cases


def _full_attention_chunks(trace: Trace) -> dict[int, int]:
    """The trace's full-attention groups: group id -> tokens per chunk."""
    return {
        int(g["group_id"]): int(g["tokens_per_chunk"])
        for g in trace.header["groups"]
        if g.get("offloaded") and g.get("window_chunks") is None
    }


def _below(full_attention: Mapping[int, int], limit: int | pl.Expr) -> pl.Expr:
    """Keep a key unless it is a full-attention chunk wholly past ``limit`` (E): the chunks
    a hit at E loads, and no further. A chunk holding E inside it is kept: E need not be a
    full-attention chunk boundary (a retention interval of 192 tokens over a chunk of 128
    keeps window tails at 192; vLLM's lookup then stops the hit inside the full-attention
    chunk it found, and loads that chunk's first tokens)."""
    keep = ~pl.col("gid").is_in(list(full_attention))
    for gid, tpc in full_attention.items():
        keep = keep | ((pl.col("gid") == gid) & (pl.col("end_token") - tpc < limit))
    return keep


def _ample(trace: Trace) -> Geometry:
    """The trace's geometry on a plain CPU tier too large to evict and a GPU pool sized by
    the harness: where an isolated lookup asks only whether the keys are there."""
    return (
        geometry_from_header(trace.header)
        .untiered()
        .with_(cpu_chunks=AMPLE_CPU_CHUNKS, num_gpu_blocks=None)
    )


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


def _tier_state(
    trace: Trace, todo: Sequence[EpisodeVerdict]
) -> dict[tuple[int, int], tuple[list[tuple[bytes, int | None]], list[bytes]]]:
    """Per episode: the request's keys (every one the trace names: its lookups, listed keys
    and store rows) resident in the primary at the episode, with their end tokens, and those
    durable on a secondary tier then, by the differ's own definitions."""
    from keytrace.analysis.history import causes, durable
    from keytrace.analysis.unknown import records_of

    eps = pl.DataFrame(
        [(v.instance_id, v.episode, v.req_id) for v in todo],
        schema={"inst": pl.Int64, "s": pl.Int64, "req_id": pl.String},
        orient="row",
    )
    times = frames.collect(frames.episodes(trace).select("inst", "s", "t"))
    listed = frames.unqueried(trace).select("inst", "req_id", "end_token", "key")
    own = frames.collect(
        pl.concat(
            [
                records_of(trace, eps.lazy()),
                listed.join(eps.lazy(), on=["inst", "req_id"], how="semi"),
            ]
        ).unique()
    )
    # and the keys the verdict names (derived ones too: vLLM never keyed those for it)
    needed = pl.DataFrame(
        [
            (v.instance_id, v.episode, bytes.fromhex(n.key), n.token_end)
            for v in todo
            for n in v.needed
            if n.key
        ],
        schema={"inst": pl.Int64, "s": pl.Int64, "key": pl.Binary, "end_token": pl.Int64},
        orient="row",
    )
    per_episode = pl.concat(
        [eps.join(own, on=["inst", "req_id"]).select("inst", "s", "key", "end_token"), needed]
    )
    # full attention only up to E, as for the first isolated lookup: allowed past it, the
    # lookup could aim at another boundary and say nothing about E
    limit = pl.DataFrame(
        [(v.instance_id, v.episode, v.E) for v in todo],
        schema={"inst": pl.Int64, "s": pl.Int64, "E": pl.Int64},
        orient="row",
    )
    at = (
        eps.join(times, on=["inst", "s"])
        .join(per_episode, on=["inst", "s"])
        .with_columns(key_gid(pl.col("key")).alias("gid"))
        .join(limit, on=["inst", "s"])
        .filter(_below(_full_attention_chunks(trace), pl.col("E")))
        .drop("E")
        .unique(["inst", "s", "key"])
        .with_row_index("pid")
        .with_columns(pl.col("pid").cast(pl.Int64))
    )
    tiers = frames.tiers(trace)
    probes = at.select(
        "pid",
        "inst",
        "s",
        "t",
        "key",
        "gid",
        pl.col("end_token").alias("token_end"),
        pl.lit(None, dtype=pl.Int64).alias("keyable_end"),
        "req_id",
    )
    group_ids = [g["group_id"] for g in trace.header["groups"]]
    state = causes(probes, frames.stores(trace), group_ids, tiers).join(
        durable(at.select("inst", "s", "key"), tiers), on=["inst", "s", "key"]
    )
    out: dict[tuple[int, int], tuple[list[tuple[bytes, int | None]], list[bytes]]] = {}
    for inst, s, key, end, cause, held in state.select(
        "inst", "s", "key", "token_end", "cause", "durable"
    ).iter_rows():
        primary, secondary = out.setdefault((inst, s), ([], []))
        if cause == "resident":
            primary.append((bytes(key), end))
        if held:
            secondary.append(bytes(key))
    return out


def _case(
    v: EpisodeVerdict,
    num_tokens: int,
    keys: int,
    external: int,
    tier_external: int | None = None,
) -> OracleCase:
    _group, _chunk, cause = v.evidence()
    reaches = v.E is not None and external >= v.E
    tier_reaches = None if tier_external is None else v.E is not None and tier_external >= v.E
    decisive = _decisive(v)
    timing = bool(decisive) and all(c in TIMING for c in decisive)
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
        agree=agrees(v.verdict, reaches, tier_reaches, timing),
        tiered_external=tier_external,
    )


def _decisive(v: EpisodeVerdict) -> list[str]:
    """The shortfall's decisive causes (`keytrace.judge.definitions.decisive`) from its
    needed chunks."""
    from keytrace.judge import definitions as d

    causes = [(n.group_id, n.cause) for n in v.needed]
    return list(d.decisive(d.candidates_of(causes, v.binding_group)))


@dataclass(frozen=True)
class LimitCase:
    """One episode the differ called ``limited`` by ``max_load_tokens``, looked up again in
    isolation twice: with the request's recorded cap and without it."""

    req_id: str
    episode: int
    max_load_tokens: int
    E: int | None
    E_free: int | None
    external_tokens: int | None
    capped_external: int
    free_external: int

    @property
    def agree(self) -> bool:
        """The cap, and nothing else, kept the tokens away: alone, with every key offered
        before the episode resident, the capped lookup serves what the request got (no
        less than E under the cap) and the uncapped one reaches E without it."""
        under = self.E if self.E is not None else 0
        return (
            self.capped_external == (self.external_tokens or 0)
            and self.capped_external >= under
            and self.E_free is not None
            and self.free_external >= self.E_free
        )

    def describe(self) -> str:
        return (
            f"{self.req_id} (episode {self.episode}): max_load_tokens={self.max_load_tokens}, "
            f"E={self.E}, E without the cap={self.E_free}, served {self.external_tokens}; "
            f"isolated: {self.capped_external} with the cap, {self.free_external} without"
        )


def check_limits(trace_dir: str, token_ids: Mapping[str, Sequence[int]]) -> list[LimitCase]:
    """Look up every episode the differ called ``limited`` by ``max_load_tokens`` again in
    isolation (a fresh real scheduler whose ample CPU tier holds every key any request
    offered before the episode, stored and settled), with the recorded
    ``kv_transfer_params`` cap and without it. Whether a capped request that got less than
    the tier held is vLLM's cap arithmetic working as coded (`LimitCase.agree`) or a
    disagreement under the cap."""
    from keytrace.vllm.lab.harness import OUTPUT_TOKEN
    from keytrace.vllm.lab.replay import isolated_lookup

    trace = open_trace(trace_dir)
    geo = _ample(trace)
    report = diff(trace, all_episodes=True)
    todo = [v for v in report.episodes if v.verdict == "limited" and v.limit == "max_load_tokens"]
    caps = {
        (i, s): m
        for i, s, m in frames.collect(
            frames.episodes(trace).select("inst", "s", "max_load").drop_nulls("max_load")
        ).iter_rows()
    }
    when = _episode_times(trace)
    store = _offers(trace)
    probes = _recorded_keys(trace)
    out = []
    for v in todo:
        t, n = when[(v.instance_id, v.episode)]
        before = store.filter(
            ((pl.col("inst") == v.instance_id) & (pl.col("seq") < v.episode))
            | ((pl.col("inst") != v.instance_id) & (pl.col("ts") < t))
        ).unique("key")
        resident = list(zip(before["key"].to_list(), before["end_token"].to_list(), strict=True))
        prompt = list(token_ids[v.req_id])
        tokens = prompt + [OUTPUT_TOKEN] * (n - len(prompt))
        cap = int(caps[(v.instance_id, v.episode)])
        runs = [
            isolated_lookup(
                geo,
                tokens,
                resident,
                expect=probes.get(v.req_id),
                kv_transfer_params=params,
            )[1]
            for params in ({"max_load_tokens": cap}, None)
        ]
        out.append(LimitCase(v.req_id, v.episode, cap, v.E, v.E_free, v.external_tokens, *runs))
    return out
