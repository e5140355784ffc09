"""Where every token to prefill came from, per engine: the operator's answer to "is my
offload hit rate low because of capacity, or because of a bug?".

Each non-deferred lookup episode accounts for the tokens it had to prefill, N (the prompt,
plus what a preempted request had generated before it resumed), exactly once (a deferred
episode is asked again; a resumed request is recomputed, so it counts again):

- ``gpu_prefix``: S, the local GPU prefix-cache hit;
- ``offload``: the external tokens the scheduler accepted from the offload tier (on a
  tiered manager: those the CPU tier already held);
- ``promoted`` (with the secondary tier): on a tiered manager, the accepted tokens whose
  anchor-group chunk this request's lookups promoted from that tier into the CPU tier
  (`promoted_tokens`); with ``offload`` they are what the scheduler accepted;
- ``short:<cause>`` (with the binding group): for a shortfall, E - S - offload, the tokens
  between what was served and the expected boundary, by the first decisive cause
  (``in_flight``, ``evicted``, ``other_engine``, ``store_failed`` explain it; the rest are
  rule disagreements);
- ``limited`` (with the `keytrace.judge.definitions.Limit`): tokens not loaded because
  something asked so (`keytrace.judge.definitions.by_request_tokens`): the request's
  ``max_load_tokens`` (from what was served, or from E under the cap, to E without it), or,
  for an episode that missed a key its earlier request's ``max_offload_tokens`` withheld or
  the manager's ``store_threshold`` filtered, up to the lookup cap L;
- ``cold_shared``: for a cold episode, the tokens up to a boundary another engine had
  written through to a tier this engine shares (`keytrace.judge.identity.shares_tier`)
  before the episode: this engine should have read it there, a finding (exit 1);
- ``cold_routing``: for a cold episode, the rest of the tokens up to a boundary another
  engine had stored for this prompt before that moment (a completed store; an eviction
  since is not followed) in a tier this engine cannot read (its private CPU tier: by
  design, routing; the conversation's earlier turn ran there);
- ``cold_hash_identity``: the rest of a cold episode's tokens on an engine that shares a
  tier with an engine hashing differently (`keytrace.judge.identity.identity_findings`):
  what the other stored was never findable under this engine's keys;
- ``cold_not_stored``: the rest of a cold episode's tokens;
- ``past_boundary``: everything after E (or after what was served): recomputed by design.

The rows therefore add up to the sum of N over those episodes, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from keytrace.analysis import frames
from keytrace.judge.definitions import (
    ASKED_AGAIN,
    EXPLAINED_CAUSES,
    LIMIT_LABELS,
    SHORTFALLS,
    Verdict,
    by_request_tokens,
    served,
    short_of_E,
)
from keytrace.judge.ops import as_expr, eq, plain
from keytrace.judge.rules import Group

CATEGORIES = (
    "gpu_prefix",
    "offload",
    "promoted",
    "short",
    "limited",
    "cold_shared",
    "cold_routing",
    "cold_hash_identity",
    "cold_not_stored",
    "past_boundary",
)
LABELS = {
    "gpu_prefix": "GPU prefix cache",
    "offload": "offload tier (loaded)",
    "cold_shared": "cold: on a shared tier this engine should have read (finding)",
    "cold_routing": "cold: stored on another engine's private tier (routing)",
    "cold_hash_identity": "cold: an engine on its shared tier hashes differently (hash identity)",
    "cold_not_stored": "cold: not stored anywhere",
    "past_boundary": "recomputed past E (by design)",
}


@dataclass(frozen=True)
class LostRow:
    engine: str  # an engine id (or recorder instance), or "all"
    category: str  # one of CATEGORIES
    cause: str | None  # for "short": the cause
    group: int | None  # for "short": the binding group
    tokens: int
    episodes: int
    tier: int | None = None  # for "promoted": the secondary tier's index (header)

    @property
    def explained(self) -> bool:
        """A shortfall cause that is timing, capacity or routing rather than a rule bug."""
        return self.cause in EXPLAINED_CAUSES

    @property
    def label(self) -> str:
        if self.category == "short":
            kind = "timing/capacity" if self.explained else "RULE"
            where = f", group {self.group}" if self.group is not None else ""
            return f"short of E ({kind}): {self.cause}{where}"
        if self.category == "promoted":
            return f"offload tier, promoted from secondary tier {self.tier}"
        if self.category == "limited":
            return LIMIT_LABELS.get(self.cause or "", f"limited: {self.cause}")
        return LABELS[self.category]


@dataclass(frozen=True)
class LostTokens:
    """Rows per engine and for ``all``; each engine's rows add up to its ``prompt_tokens``
    (the tokens its lookups had to prefill: prompts, plus outputs of resumed requests)."""

    prompt_tokens: dict[str, int]
    episodes: dict[str, int]
    rows: list[LostRow] = field(default_factory=list)


def account(
    judged: pl.DataFrame,
    routing: pl.DataFrame,
    promotions: pl.DataFrame | None = None,
    split: frozenset[int] = frozenset(),
) -> pl.LazyFrame:
    """Per counted episode its tokens in each of `CATEGORIES` (one column each; on a tiered
    trace ``promoted_<tier>`` per secondary tier in place of ``promoted``), from judged
    episodes.

    ``judged`` holds per episode: inst, s, req_id, engine, verdict, S, N, X, A, E, cause,
    bind_gid, L, E_free, limit; ``routing``: (inst, s, E_other, E_shared) for cold episodes
    another engine held a boundary for (`routing_boundaries`; E_shared: on a tier this one
    shares); ``promotions``: `promotions` (None: not a tiered trace); ``split``: the
    recorder instances of engines in a hash-identity finding.
    """
    gpu, offload = served(pl.col("S"), pl.col("N"), pl.col("A"), pl.col("X"))
    ep = (
        judged.lazy()
        .filter(~pl.col("verdict").is_in(plain(ASKED_AGAIN)))
        .join(routing.lazy(), on=["inst", "s"], how="left")
        .with_columns(gpu.alias("gpu_prefix"), offload.alias("offload"))
        .with_columns((pl.col("gpu_prefix") + pl.col("offload")).alias("served"))
    )
    promoted = ["promoted"]
    if promotions is not None:
        tiers = sorted(promotions.get_column("tier").unique().to_list())
        promoted = [f"promoted_{t}" for t in tiers]
        by_tier = promoted_tokens(ep, promotions).collect()
        for t, col in zip(tiers, promoted, strict=True):
            mine = by_tier.filter(pl.col("tier") == t).select(
                "inst", "s", pl.col("tokens").alias(col)
            )
            ep = ep.join(mine.lazy(), on=["inst", "s"], how="left").with_columns(
                pl.col(col).fill_null(0)
            )
        ep = ep.with_columns(pl.col("offload") - pl.sum_horizontal(*promoted, pl.lit(0)))
    else:
        ep = ep.with_columns(pl.lit(0, pl.Int64).alias("promoted"))
    short = pl.when(pl.col("verdict").is_in(plain(SHORTFALLS))).then(
        short_of_E(pl.col("E"), pl.col("gpu_prefix"), pl.col("served") - pl.col("gpu_prefix"))
    )
    cold = eq(pl.col("verdict"), Verdict.COLD)
    if "E_shared" not in ep.collect_schema().names():
        ep = ep.with_columns(pl.lit(None, pl.Int64).alias("E_shared"))
    on_shared = pl.when(cold).then(
        pl.max_horizontal(pl.col("E_shared").fill_null(0) - pl.col("served"), 0)
    )
    routed = pl.when(cold).then(
        pl.max_horizontal(pl.col("E_other").fill_null(0) - pl.col("served"), 0)
    )
    limited = as_expr(
        by_request_tokens(
            pl.col("verdict"), pl.col("E"), pl.col("E_free"), pl.col("L"), pl.col("served")
        )
    )
    ep = ep.with_columns(
        short.fill_null(0).alias("short"),
        on_shared.fill_null(0).alias("cold_shared"),
        limited.fill_null(0).alias("limited"),
    ).with_columns(
        pl.max_horizontal(routed.fill_null(0) - pl.col("cold_shared"), 0).alias("cold_routing")
    )
    cold_rest = pl.col("N") - pl.col("served") - pl.col("cold_shared") - pl.col("cold_routing")
    in_split = pl.col("inst").is_in(sorted(split))
    rest = [c for c in CATEGORIES if c != "promoted"]
    return ep.with_columns(
        pl.when(cold & in_split).then(cold_rest).otherwise(0).alias("cold_hash_identity"),
        pl.when(cold & ~in_split).then(cold_rest).otherwise(0).alias("cold_not_stored"),
        pl.when(eq(pl.col("verdict"), Verdict.COLD))
        .then(0)
        .otherwise(pl.col("N") - pl.col("served") - pl.col("short") - pl.col("limited"))
        .alias("past_boundary"),
    ).select("engine", "cause", "bind_gid", "limit", *rest[:2], *promoted, *rest[2:])


def promotions(tiers: pl.LazyFrame, groups: list[Group]) -> pl.DataFrame:
    """(inst, req_id, seq, tier, lo, hi): the token range [lo, hi) of every anchor-group
    chunk a request's lookup promoted from a secondary tier into the CPU tier
    (``tiers``: `keytrace.analysis.frames.tiers`). The anchor group stands for the chunk's
    tokens, as it does for boundaries: a promotion of another group's chunk alone moves
    no token from one row to another."""
    from keytrace.judge.definitions import anchor

    a = anchor(groups)
    return frames.collect(
        tiers.filter((pl.col("event") == "promotion_prepared") & (pl.col("gid") == a.gid))
        .drop_nulls("req_id")
        .select(
            "inst",
            "req_id",
            "seq",
            pl.col("tier").cast(pl.Int32),
            (pl.col("end_token") - a.tpc).alias("lo"),
            pl.col("end_token").alias("hi"),
        )
    )


def promoted_tokens(episodes: pl.LazyFrame, promotions: pl.DataFrame) -> pl.LazyFrame:
    """(inst, s, tier, tokens): of each episode's accepted tokens (gpu_prefix, served],
    those in a chunk its request promoted before the episode, by the tier it came from (a
    chunk promoted more than once: its latest promotion)."""
    lo = pl.max_horizontal("lo", "gpu_prefix")
    hi = pl.min_horizontal("hi", "served")
    return (
        episodes.filter(pl.col("served") > pl.col("gpu_prefix"))
        .select("inst", "s", "req_id", "gpu_prefix", "served")
        .join(promotions.lazy(), on=["inst", "req_id"])
        .filter(pl.col("seq") < pl.col("s"))
        .sort("seq")
        .group_by("inst", "s", "lo")
        .agg(pl.all().last())
        .with_columns(pl.max_horizontal(hi - lo, 0).alias("tokens"))
        .group_by("inst", "s", "tier")
        .agg(pl.col("tokens").sum())
    )


_BY = ("engine", "cause", "bind_gid", "limit")
"""`fold`'s grouping: every other column of `account`'s frame is a category's tokens."""


def _category(column: str) -> str:
    """The category of one of `account`'s columns (``promoted_<tier>``: ``promoted``)."""
    return "promoted" if column.startswith("promoted") else column


def _tier(column: str) -> int | None:
    """The secondary tier of a ``promoted_<tier>`` column, else None."""
    return int(column.rsplit("_", 1)[1]) if column.startswith("promoted_") else None


@dataclass(frozen=True)
class Partial:
    """`fold`'s totals over some episodes; `summarize` adds up any number of them (every
    total is a sum or a count, so a trace judged in batches gets the account of the whole)."""

    per_cause: pl.DataFrame
    """(engine, cause, bind_gid, limit): per category its tokens and ``n_<category>``, the number
    of episodes with any."""
    prompts: pl.DataFrame
    """(engine, N, episodes): the tokens the engine's counted episodes had to prefill."""


def fold(per_episode: pl.LazyFrame, prompt: pl.DataFrame) -> Partial:
    """`account`'s episodes folded into per-engine, per-cause totals.

    Aggregated before anything is unpivoted: one row per episode and category would be
    six times the episodes (measured: +145 MB at 150M trace rows).
    ``prompt``: (engine, N) per counted episode, for the totals the rows must add up to.
    """
    columns = [c for c in per_episode.collect_schema().names() if c not in _BY]
    per_cause = frames.collect(
        per_episode.group_by(*_BY).agg(
            *(pl.col(c).sum().alias(c) for c in columns),
            *((pl.col(c) > 0).sum().cast(pl.Int64).alias(f"n_{c}") for c in columns),
        )
    )
    prompts = prompt.group_by("engine").agg(pl.col("N").sum(), pl.len().alias("episodes"))
    return Partial(per_cause, prompts.with_columns(pl.col("episodes").cast(pl.Int64)))


def summarize(partials: list[Partial]) -> LostTokens:
    """Per-engine totals and an ``all`` total from `fold`'s partials: per category, the
    tokens and the number of episodes with any; ``short`` rows per cause and group."""
    if not partials:
        return LostTokens(prompt_tokens={}, episodes={}, rows=[])
    # diagonal: a tiered trace's partials have a promoted_<tier> column per tier their own
    # episodes promoted from (a partition of engines that never promoted has none)
    per_cause = (
        pl.concat([p.per_cause for p in partials], how="diagonal_relaxed")
        .group_by(*_BY)
        .agg(pl.all().sum())
        .lazy()
    )
    columns = [
        c for c in per_cause.collect_schema().names() if c not in _BY and not c.startswith("n_")
    ]
    long = pl.concat(
        [
            per_cause.select(
                "engine",
                pl.lit(_category(c)).alias("category"),
                (
                    pl.col("cause")
                    if c == "short"
                    else pl.col("limit")
                    if c == "limited"
                    else pl.lit(None, pl.String)
                ).alias("cause"),
                (pl.col("bind_gid") if c == "short" else pl.lit(None, pl.Int32)).alias("group"),
                pl.lit(_tier(c), pl.Int32).alias("tier"),
                pl.col(c).cast(pl.Int64).alias("tokens"),
                pl.col(f"n_{c}").cast(pl.Int64).alias("episodes"),
            )
            for c in columns
        ]
    )
    every = pl.lit("all").alias("engine")
    agg = (
        pl.concat([long, long.with_columns(every)])
        .group_by("engine", "category", "cause", "group", "tier")
        .agg(pl.col("tokens").sum(), pl.col("episodes").sum())
        .filter(pl.col("tokens") > 0)
        .pipe(frames.collect)
    )
    order = {c: i for i, c in enumerate(CATEGORIES)}
    rows = [
        LostRow(str(e), cat, cause, grp, int(tok), int(n), tier)
        for e, cat, cause, grp, tier, tok, n in sorted(
            agg.iter_rows(),
            key=lambda r: (
                r[0] == "all",
                str(r[0]),
                order[r[1]],
                str(r[2]),
                r[3] or -1,
                r[4] if r[4] is not None else -1,
            ),
        )
    ]
    prompts = pl.concat([p.prompts for p in partials], how="vertical_relaxed")
    totals = (
        pl.concat([prompts, prompts.with_columns(every)])
        .group_by("engine")
        .agg(pl.col("N").sum(), pl.col("episodes").sum())
        .sort(pl.col("engine") == "all", "engine")  # engines by name, then all: stable output
    )
    return LostTokens(
        prompt_tokens={str(e): int(p) for e, p, _ in totals.iter_rows()},
        episodes={str(e): int(n) for e, _, n in totals.iter_rows()},
        rows=rows,
    )


@dataclass(frozen=True)
class Routing:
    """What `routing_boundaries` reads besides the cold episodes, of the whole trace (one
    pass, `routing`): ``own`` (inst, req_id, key), every request's offers of a boundary key
    at any time; ``elsewhere`` (other, key, b, first_ts, held_ts), when each instance first
    offered each boundary's key and first completed a store of it."""

    own: pl.DataFrame
    elsewhere: pl.DataFrame


def routing(stores: pl.LazyFrame, elsewhere: pl.DataFrame, groups: list[Group]) -> Routing:
    """`Routing` from the store rows (of one instance or several) and ``elsewhere``
    (other, key, b, first_ts): every instance's boundary keys, the keys some request
    offered for the chunk ending at one of its boundaries, when each first did
    (`keytrace.analysis.partition.cross_engine`, from each instance's
    `keytrace.analysis.boundaries.boundary_offers`). Empty when the anchor group is not
    full attention (no routing account then)."""
    from keytrace.analysis.boundaries import anchor_offers
    from keytrace.judge.definitions import anchor

    if elsewhere.height == 0 or not anchor(groups).full_attention:
        own = pl.DataFrame(schema={"inst": pl.Int64, "req_id": pl.String, "key": pl.Binary})
        return Routing(own, elsewhere.clear())
    own = frames.collect(
        anchor_offers(stores, groups)
        .filter(pl.col("key").is_in(elsewhere["key"].unique().implode()))
        .select("inst", "req_id", "key")
        .unique()
    )
    return Routing(own, elsewhere)


def shared_missed(summary: LostTokens) -> int:
    """Tokens of cold episodes that a tier this engine shares held for it (``cold_shared``,
    all engines): a finding."""
    return sum(r.tokens for r in summary.rows if r.engine == "all" and r.category == "cold_shared")


def shared_boundaries(
    cold: pl.DataFrame, facts: Routing, writes: pl.DataFrame | None, shared: pl.DataFrame | None
) -> pl.DataFrame:
    """(inst, s, E_shared) for cold episodes: the largest boundary ``b`` in (S, L] whose
    key (one this episode's request offered) another instance had written through to a
    tier this one shares before the episode (`keytrace.judge.identity.on_shared_tier`):
    there for this engine to read. ``writes``: `keytrace.analysis.boundaries.shared_writes`;
    ``shared``: (inst, other, tier)."""
    from keytrace.judge.identity import on_shared_tier

    empty = pl.DataFrame(schema={"inst": pl.Int64, "s": pl.Int64, "E_shared": pl.Int64})
    if cold.height == 0 or facts.own.height == 0 or writes is None or shared is None:
        return empty
    if writes.height == 0:
        return empty
    mine = facts.own.join(cold.select("inst", "req_id").unique(), on=["inst", "req_id"])
    return (
        cold.select("inst", "s", "req_id", "t", "S", "L")
        .lazy()
        .join(mine.lazy(), on=["inst", "req_id"])
        .join(writes.lazy(), on="key")
        .join(shared.select("inst", "other").unique().lazy(), on=["inst", "other"])
        .filter(
            on_shared_tier(pl.col("written"), pl.col("t"))
            & (pl.col("b") > pl.col("S"))
            & (pl.col("b") <= pl.col("L"))
        )
        .group_by("inst", "s")
        .agg(pl.col("b").max().cast(pl.Int64).alias("E_shared"))
        .pipe(frames.collect)
    )


def routing_boundaries(cold: pl.DataFrame, facts: Routing) -> pl.DataFrame:
    """(inst, s, E_other) for cold episodes: the largest boundary ``b`` in (S, L] of a
    request on *another* instance that stored, a store completed before the episode's wall
    clock, the same full-attention key for the chunk ending at ``b`` as this episode's
    request offered (its prompt shares that prefix). An offer that failed or was rejected
    put nothing on that engine's tier: no routing (an eviction since is not followed). Keys are content-addressed, so the request's own
    full-attention store rows name its prefix even though its lookup stopped early (and
    they may come after the episode: `Routing` is of the whole trace)."""
    empty = pl.DataFrame(schema={"inst": pl.Int64, "s": pl.Int64, "E_other": pl.Int64})
    if cold.height == 0 or facts.own.height == 0:
        return empty
    mine = facts.own.join(cold.select("inst", "req_id").unique(), on=["inst", "req_id"])
    return (
        cold.select("inst", "s", "req_id", "t", "S", "L")
        .lazy()
        .join(mine.lazy(), on=["inst", "req_id"])
        .join(facts.elsewhere.lazy(), on="key")
        .filter(
            (pl.col("other") != pl.col("inst"))
            & (pl.col("held_ts") < pl.col("t"))
            & (pl.col("b") > pl.col("S"))
            & (pl.col("b") <= pl.col("L"))
        )
        .group_by("inst", "s")
        .agg(pl.col("b").max().alias("E_other"))
        .pipe(frames.collect)
    )
