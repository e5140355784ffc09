"""Store-vs-lookup differ: per episode the expected boundary E, the verdict and, for a
shortfall, the binding group, the terminal key and the cause of every needed chunk.

``docs/diff.md`` states the definitions in prose; the code that decides them is split by
concern: vLLM's arithmetic in `rules`, per-scan facts in `scans`, intended boundaries in
`boundaries`, the store history and causes in `history`, verdicts in `verdict`. This
module only wires them together over lazy polars frames. Once per trace: the boundary
offers (one row per request boundary). Then per batch of episodes (`BATCH_EPISODES`), a
fixed number of passes: the batch's per-scan summaries, its anchor-group lookups for the
chain, and, for its shortfall episodes only, their needed chunks' lookups and the store
history (up to the batch's end) of just those keys. Python runs per *reported* episode
only, to build the result objects.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import polars as pl

from keytrace.analysis import frames, lost, partial_tails, partition, scans, unknown
from keytrace.analysis.boundaries import anchor, chain, shared_boundaries, shared_writes
from keytrace.analysis.chunkmap import chunk_maps
from keytrace.analysis.history import causes, crowding, durable, gid_in
from keytrace.analysis.results import (
    NO_VERDICT,
    DiffReport,
    EpisodeList,
    EpisodeVerdict,
    NeededChunk,
    TerminalKey,
    chunk_ranges,
    episode_list,
    merge_episode_lists,
)
from keytrace.analysis.runners import LocalRunner, Runner
from keytrace.analysis.verdict import CAUSE_TEXT, base_verdict, shortfall_verdicts
from keytrace.errors import TraceError, UnknownResultError
from keytrace.format.reader import Trace, engine_headers, raise_unknown_results
from keytrace.format.schema import LIMIT_EVENTS, SCAN_PROOF, SCAN_UNQUERIED
from keytrace.format.shape import has_episodes
from keytrace.judge import definitions as d
from keytrace.judge.definitions import Verdict
from keytrace.judge.identity import (
    IdentityFinding,
    identity_classes,
    identity_findings,
    shared_places,
    shares_tier,
)
from keytrace.judge.ops import as_expr, eq, lit, plain
from keytrace.judge.rules import (
    Group,
    excluded_tiers,
    groups_from_header,
    load_cap,
    lookup_cap,
    needed_range,
    retention_of,
    trim_first_of,
)
from keytrace.judge.trust import trace_rules, verdict_withheld

__all__ = ["CAUSE_TEXT", "DiffReport", "EpisodeVerdict", "NeededChunk", "TerminalKey", "diff"]

ProgressFn = Callable[[str, int, int], None]
KEY = ["inst", "s"]


BATCH_EPISODES = 65_536
"""Episodes judged together. The differ's working memory grows with the episodes it judges
at once, not with the key rows it reads, so a long trace is judged in consecutive batches of
at most this many episodes (by sequence number): what is held from one batch to the next is
one row per request and per reported episode. Measured with tools/bench_diff.py at 150M key
rows (145,823 episodes): one batch peaked at 455-474 MB, three at 358-365 MB; the 50M-row
trace's one batch of 48,433 at 297-322 MB (docs/diff.md)."""


def diff(
    trace: Trace,
    *,
    request: str | None = None,
    engine: str | None = None,
    rank: int | None = None,
    all_episodes: bool = False,
    progress: ProgressFn | None = None,
    batch_episodes: int = BATCH_EPISODES,
    maps: int = 0,
    runner: Runner | None = None,
    partitions: int | None = None,
) -> DiffReport:
    """Judge every selected episode; see the module docstring. Returns data, never prints.

    ``all_episodes=False`` reports the shortfall episodes (explained and mismatch) with the
    earliest mismatch in sequence order as ``first_mismatch``; ``True`` reports every
    episode (hit, cold and deferred too). Counts always cover every selected episode.
    ``batch_episodes``: see `BATCH_EPISODES` (the verdicts do not depend on it). ``maps``:
    the report also carries the chunk maps of its first ``maps`` shortfalls, mismatches
    first (`keytrace.analysis.chunkmap`; what ``keytrace diff --html`` draws).
    ``runner``: who judges the engines (`keytrace.analysis.runners`; default: this
    process); ``partitions``: into how many sets of recorder instances the work is cut
    (`keytrace.analysis.partition.plan`; default: the runner's). The report is the same
    bytes whoever judges and however the instances are cut.
    """
    try:
        report = _diff(
            trace,
            request,
            engine,
            rank,
            all_episodes,
            progress,
            batch_episodes,
            runner or LocalRunner(),
            partitions,
        )
    except UnknownResultError:
        raise_unknown_results(trace)  # names the part
    if verdict_withheld(report.rules):
        # the rules would judge another model: the facts stay, the verdict goes
        report = dataclasses.replace(report, verdict=NO_VERDICT, first_mismatch=None)
    if maps <= 0 or not isinstance(report.episodes, EpisodeList):
        return report
    drawn = chunk_maps(trace, groups_from_header(trace.header), report.episodes, maps)
    return dataclasses.replace(report, maps=drawn)


@dataclasses.dataclass
class _Batch:
    """What one batch of episodes contributes to the report (`_judge`)."""

    counts: dict[str, int]
    """Verdict -> episodes, over the batch's selected episodes (empty: none selected)."""
    lost: lost.Partial | None
    reported: EpisodeList | None
    engine_counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """Engine (id, else recorder instance) -> verdict -> episodes."""


def _diff(
    trace: Trace,
    request: str | None,
    engine: str | None,
    rank: int | None,
    all_episodes: bool,
    progress: ProgressFn | None,
    batch_episodes: int,
    runner: Runner,
    partitions: int | None,
) -> DiffReport:
    tick = progress or (lambda stage, done, total: None)
    groups = _groups(trace)
    # engines compared first (keytrace.judge.identity): engines that hash differently are
    # judged apart (their keys can never match), and those sharing a tier are a finding
    engines = engine_headers(trace)
    headers = {name: h for name, (h, _) in engines.items()}
    findings = identity_findings(headers)
    classes = identity_classes(headers) if len(headers) > 1 else []
    split = frozenset(i for f in findings for e in f.engines for i in engines[e][1])
    shipped_all = trace.absolute()  # what workers are handed: any working directory reads it
    subsets = (
        [shipped_all.of_instances(i for e in cls for i in engines[e][1]) for cls in classes]
        if len(classes) > 1
        else [shipped_all]
    )
    shared = _shared_tiers(trace, headers, engines)
    options = _Options(groups, (request, engine, rank), all_episodes, batch_episodes, split, shared)
    results: list[PartitionResult] = []
    for shipped in subsets:
        # engines that hash apart may differ in their lookahead too: each under its own
        own = (
            options
            if shipped is shipped_all
            else dataclasses.replace(options, groups=_groups(shipped))
        )
        results.extend(_judge_all(shipped, own, runner, partitions, tick))
    return _merge(trace, results, all_episodes, findings)


def _judge_all(
    shipped: Trace,
    options: _Options,
    runner: Runner,
    partitions: int | None,
    tick: ProgressFn,
) -> list[PartitionResult]:
    """Every episode of ``shipped`` (engines that hash alike), in partitions."""
    groups = options.groups
    cut = partitions or runner.partitions
    # one partition is the whole trace: no instance is counted, no row filtered
    views = (
        [shipped.of_instances(p) for p in partition.plan(shipped.instance_rows(), cut)]
        if cut > 1
        else [shipped]
    )
    # the facts that cross partitions (keytrace.analysis.partition), then each alone
    several = len(views) > 1
    exported: list[partition.Exports] = runner.map(
        partition.exports, [(v,) for v in views], (groups, several)
    )
    cross = _cross_engine(shipped, views, exported, runner)
    total = sum(e.episodes for e in exported)
    finished = [0]
    tick("episodes", 0, total)

    def judged(i: int) -> None:
        finished[0] += exported[i].episodes
        tick("episodes", finished[0], total)

    writes = None
    if options.shared is not None and options.shared.height:
        every = cross.elsewhere.select(pl.col("other").alias("inst"), "key", "b", "first_ts")
        writes = shared_writes(every, frames.tiers(shipped), options.shared)
    options = dataclasses.replace(options, writes=writes)
    return runner.map(
        judge_partition,
        [(v, e.offers, options) for v, e in zip(views, exported, strict=True)],
        cross,
        done=judged,
    )


def _shared_tiers(
    trace: Trace,
    headers: Mapping[str, Mapping[str, Any]],
    engines: Mapping[str, tuple[dict[str, Any], frozenset[int]]],
) -> pl.DataFrame:
    """(inst, other, tier): the pairs of recorder instances that share a tier
    (`keytrace.judge.identity.shares_tier`, the scope rule), with the index of the shared
    tier on ``other`` (its writes reach ``inst``)."""
    rows: list[tuple[int, int, int]] = []
    for a, (_, ids_a) in engines.items():
        for b, (_, ids_b) in engines.items():
            if a == b or not shares_tier(headers[a], headers[b]):
                continue
            common = set(shared_places(headers[a])) & set(shared_places(headers[b]))
            tiers = sorted(shared_places(headers[b])[p] for p in common)
            rows.extend((i, j, t) for i in ids_a for j in ids_b for t in tiers)
    return pl.DataFrame(
        rows, schema={"inst": pl.Int64, "other": pl.Int64, "tier": pl.Int32}, orient="row"
    )


def _cross_engine(
    trace: Trace, views: list[Trace], exported: list[partition.Exports], runner: Runner
) -> partition.CrossEngine:
    """`partition.CrossEngine` with its first-offer table (none for one partition)."""
    cross = partition.cross_engine(exported)
    if len(views) < 2:
        return cross
    asked = partition.asked_of(exported)
    firsts = runner.map(partition.first_offers_of, [(v,) for v in views], asked)
    offers = partition.FirstOffers(partition.first_offers(firsts), asked, fleet=trace)
    return dataclasses.replace(cross, offers=offers)


@dataclasses.dataclass(frozen=True)
class _Options:
    """What every instance's judgement is told (picklable: it travels to workers)."""

    groups: list[Group]
    selection: tuple[str | None, str | None, int | None]
    all_episodes: bool
    batch_episodes: int
    split: frozenset[int] = frozenset()
    """Recorder instances of engines in a hash-identity finding (their cold tokens are
    ``cold_hash_identity``)."""
    shared: pl.DataFrame | None = None
    """`_shared_tiers`: which instances read which others' shared tiers."""
    writes: pl.DataFrame | None = None
    """`boundaries.shared_writes` of the engines judged together (None: no shared tier)."""


@dataclasses.dataclass
class PartitionResult:
    """One partition's judgement (`judge_partition`): its batches, and its requests that
    stored keys with no lookup rows (`stores_without_lookups`)."""

    batches: list[_Batch]
    unlooked: list[str]


def judge_partition(
    view: Trace, offers: pl.DataFrame, options: _Options, cross: partition.CrossEngine
) -> PartitionResult:
    """Judge every episode of a partition's instances (``view``: `Trace.of_instances`),
    each from its own rows, the partition's boundary ``offers``
    (`partition.Exports.offers`) and the ``cross`` partition facts; consecutive batches of
    episodes (`BATCH_EPISODES`). A top-level function of picklable arguments: a runner may
    call it in another process or on a cluster."""
    groups = options.groups
    routing = lost.routing(frames.stores(view), cross.elsewhere, groups)
    runs = _deferral_runs(view)
    tiered = frames.is_tiered(view)
    promotions = lost.promotions(frames.tiers(view), groups) if tiered else None
    # the primary slots other work held at each promotion that found no room: once, for
    # every batch (a batch's causes read it for its own episodes)
    crowd = crowding(frames.tiers(view)) if tiered else None
    sel = _selection(*options.selection)
    ranges = _episode_ranges(view, options.batch_episodes)
    # every batch's chain first, back to back: this query's memory is the largest of a
    # batch's, and run one after another the allocator hands each the pages of the last
    # (measured at 150M rows: +90 MB for the first, +10 MB for each next one)
    chains = [
        _chains(view.episode_range(lo, hi), groups, offers, options.writes, options.shared)
        for lo, hi, _ in ranges
    ]
    del offers  # what the batches need of it is in `routing` and `chains`
    others = cross.offers if cross.partitions > 1 else None
    batches = [
        _judge(
            view,
            lo,
            hi,
            groups,
            (routing, chained, runs, promotions, crowd),
            sel,
            options.all_episodes,
            others,
            options,
        )
        for (lo, hi, _), chained in zip(ranges, chains, strict=True)
    ]
    return PartitionResult(batches, stores_without_lookups(view))


def _merge(
    trace: Trace,
    results: list[PartitionResult],
    all_episodes: bool,
    findings: list[IdentityFinding] | None = None,
) -> DiffReport:
    """One report from every partition's judgement: counts and token accounts added up,
    reported episodes in sequence order (instance breaking ties), whatever ran them."""
    batches = [b for r in results for b in r.batches]
    if not any(b.counts for b in batches):
        raise TraceError("no episode matches the given --request/--engine/--rank")
    verdicts = merge_episode_lists([b.reported for b in batches if b.reported is not None])
    # found in the column: iterating the report to it built an object per episode before it
    # (with no mismatch, one per episode of the trace)
    mismatches = verdicts.rows.get_column("verdict").cast(pl.String).is_in(d.FINDINGS).arg_true()
    first = verdicts[int(mismatches[0])] if len(mismatches) else None
    counts: dict[str, int] = {}
    for b in batches:
        for k, v in b.counts.items():
            counts[k] = counts.get(k, 0) + v
    engine_counts: dict[str, dict[str, int]] = {}
    for b in batches:
        for name, by_verdict in b.engine_counts.items():
            into = engine_counts.setdefault(name, {})
            for k, v in by_verdict.items():
                into[k] = into.get(k, 0) + v
    unlooked = sorted({r for res in results for r in res.unlooked})
    warnings = list(trace.warnings)
    if unlooked:
        shown = ", ".join(unlooked[:3]) + (" ..." if len(unlooked) > 3 else "")
        warnings.append(
            f"incomplete trace: {len(unlooked)} request(s) stored keys and have no lookup "
            f"rows at all ({shown}): their lookups are not in this trace"
        )
    summary = lost.summarize([b.lost for b in batches if b.lost is not None])
    found = bool(first or findings or lost.shared_missed(summary))
    return DiffReport(
        verdict="mismatch" if found else "agree",
        first_mismatch=first,
        episodes=verdicts,
        counts=dict(sorted(counts.items())),
        evidence_incomplete=trace.incomplete or bool(unlooked),
        warnings=warnings,
        header=trace.header,
        all_episodes=all_episodes,
        lost=summary,
        sample=sample_of(trace.header),
        rules=trace_rules(trace.header),
        engine_counts={e: dict(sorted(c.items())) for e, c in sorted(engine_counts.items())},
        identity=list(findings or []),
    )


def sample_of(header: Mapping[str, Any]) -> float | None:
    """The fraction of prefix chains a trace holds (its header's ``sample``), None: all."""
    value = header.get("sample")
    return float(value) if isinstance(value, (int, float)) and 0 < value < 1 else None


def stores_without_lookups(trace: Trace) -> list[str]:
    """Requests that offered keys to the store path and have no lookup row at all on their
    recorder instance, sorted (their ids; a request is one scheduler's).

    Every request is looked up (``get_num_new_matched_tokens``) before anything of it is
    stored, and its lookup rows are buffered with its store rows, so a request with stores
    and no lookup rows is evidence lost: a flush torn after its store part, a lookup part
    removed. (A request still running when the trace was read has its key rows already;
    only its episode row waits.) Read from the whole trace, whatever is selected."""
    kinds = [k for k in ("lookup", "episode") if trace.parts_of(k)]
    if not trace.parts_of("store"):
        return []
    who = [pl.col("instance_id"), pl.col("req_id").cast(pl.String)]
    stored = (
        trace.frame("store")
        .filter(pl.col("event").cast(pl.String) == "prepared")
        .select(who)
        .unique()
    )
    looked = [trace.frame(k).select(who) for k in kinds]
    if looked:
        stored = stored.join(pl.concat(looked).unique(), on=["instance_id", "req_id"], how="anti")
    found = stored.collect(engine="streaming")["req_id"].to_list()
    return sorted({r for r in found if r})


def _judge(
    trace: Trace,
    lo: int | None,
    hi: int | None,
    groups: list[Group],
    known: tuple[
        lost.Routing, pl.DataFrame, pl.DataFrame, pl.DataFrame | None, pl.DataFrame | None
    ],
    sel: pl.Expr,
    all_episodes: bool,
    others: partition.FirstOffers | None = None,
    options: _Options | None = None,
) -> _Batch:
    """The episodes ``lo <= s < hi`` of a partition (``trace``: `Trace.of_instances`):
    their own lookup rows are read from ``view`` (`Trace.episode_range`), the store history
    from ``past`` (the rows before the batch's end), what needs other episodes' lookups (a
    request's earlier ones) from ``trace``. ``known``: the partition's `lost.Routing`, the
    batch's `_chains`, its `_deferral_runs` and its `lost.promotions` (None: not tiered).
    ``others``: what the other partitions' instances offered (None: ``trace`` holds every
    instance, and is read for it)."""
    routing, chains, runs, promotions, crowd = known
    view = trace.episode_range(lo, hi)
    eps = _episodes(view, groups, chains, runs, sel, _store_limits(trace, view))
    if eps.height == 0:
        return _Batch({}, None, None)
    t_max = eps.get_column("t").max()
    before = _before(hi, t_max if isinstance(t_max, int) else None)
    past = _stores(trace, before)
    sf = eps.filter(pl.col("verdict") == "shortfall")
    explained = _explain_shortfalls(trace, view, past, groups, sf, crowd, others)
    judged = _with_explanations(eps, explained)
    del eps, sf  # the episode frame is held once from here (judged shares its columns)
    counts = dict(judged.group_by("verdict").len().iter_rows())
    per_engine = (
        judged.group_by(pl.coalesce("engine_id", "instance").alias("engine"), "verdict")
        .len()
        .iter_rows()
    )
    partial = _lost_tokens(judged, routing, promotions, options)
    reported = (
        judged
        if all_episodes
        else judged.filter(pl.col("verdict").is_in(plain([Verdict.EXPLAINED, *d.FINDINGS])))
    )
    by_gid = {g.gid: g for g in groups}
    stored = _stored_near(trace, before, reported, explained, by_gid) if explained.height else {}
    verdicts = episode_list(groups, reported, explained, stored)
    engine_counts: dict[str, dict[str, int]] = {}
    for engine, verdict, n in per_engine:
        engine_counts.setdefault(str(engine), {})[str(verdict)] = int(n)
    return _Batch(counts, partial, verdicts, engine_counts)


def _before(hi: int | None, t_max: int | None) -> pl.Expr | None:
    """The store rows a batch of episodes can need: an episode ``(inst, s, t)`` reads its
    own instance's rows before ``s`` and other instances' rows before ``t`` (`history`),
    so no row from ``hi`` on that is also after the batch's last wall clock. The bound
    reaches the Parquet reader (parts are written in sequence order): an early batch reads
    only the store's early parts. None: every row (the last batch)."""
    if hi is None or t_max is None:
        return None
    return (pl.col("seq") < hi) | (pl.col("ts") <= t_max)


def _stores(trace: Trace, before: pl.Expr | None, at: pl.DataFrame | None = None) -> pl.LazyFrame:
    """`frames.stores` within ``before`` (`_before`)."""
    stores = frames.stores(trace, at=at)
    return stores if before is None else stores.filter(before)


def _selection(request: str | None, engine: str | None, rank: int | None) -> pl.Expr:
    sel = pl.lit(True)
    if request is not None:
        sel &= d.is_request(pl.col("req_id"), request)
    if engine is not None:
        sel &= (pl.col("engine_id") == engine) | (pl.col("instance") == engine)
    if rank is not None:
        sel &= pl.col("dp_rank") == rank
    return sel


def _episode_ranges(trace: Trace, size: int) -> list[tuple[int | None, int | None, int]]:
    """``(lo, hi, n)``: consecutive ranges of episode sequence numbers ``[lo, hi)`` holding
    about ``size`` episodes each (``n``); the first and last are open-ended. Episodes of
    several recorder instances share a range by sequence number."""
    s = frames.collect(frames.episodes(trace).select("s")).get_column("s").sort()
    k = max(1, -(-len(s) // max(1, size)))
    cuts = sorted({int(s[i * len(s) // k]) for i in range(1, k)})
    bounds: list[int | None] = [None, *cuts, None]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        n = len(s)
        if lo is not None:
            n -= int(s.search_sorted(lo, side="left"))
        if hi is not None:
            n -= len(s) - int(s.search_sorted(hi, side="left"))
        out.append((lo, hi, n))
    return out


def _with_explanations(eps: pl.DataFrame, explained: pl.DataFrame) -> pl.DataFrame:
    """``eps`` with the shortfall columns and the final verdict. The explanation is joined to
    the key columns alone and set beside ``eps``'s own columns, which are shared, not copied:
    a join of the whole frame copied every column of every episode, held until the end."""
    extra = eps.select(KEY).join(
        explained.select(*KEY, "verdict2", "decisive", "term_result", "bind_gid"),
        on=KEY,
        how="left",
        maintain_order="left",
    )
    # a shortfall kept from the tier by the request's own tier filter is `limited`: named
    # by the limit of its decisive cause, and E (which ignores the filter) is E without it
    now_limited = pl.col("verdict2") == Verdict.LIMITED.value
    return eps.hstack(extra.drop(KEY)).with_columns(
        pl.coalesce("verdict2", "verdict").alias("verdict"),
        pl.when(now_limited)
        .then(pl.coalesce(pl.col("limit"), d.limit_of_causes(pl.col("decisive"))))
        .otherwise(pl.col("limit"))
        .alias("limit"),
        pl.when(now_limited)
        .then(pl.coalesce("E_free", "E"))
        .otherwise(pl.col("E_free"))
        .alias("E_free"),
    )


def _lost_tokens(
    judged: pl.DataFrame,
    routing: lost.Routing,
    promotions: pl.DataFrame | None,
    options: _Options | None = None,
) -> lost.Partial:
    """The per-engine account of every prompt token (`keytrace.analysis.lost`), folded
    over these episodes (``promotions``: `lost.promotions` of a tiered trace)."""
    first_cause = d.shortfall_cause(pl.col("decisive"), pl.col("term_result"))
    j = judged.with_columns(
        pl.coalesce("engine_id", "instance").alias("engine"),
        pl.when(pl.col("verdict").is_in(plain(d.SHORTFALLS))).then(first_cause).alias("cause"),
    )
    # the columns each part reads, selected before any filter copies rows: a filter of the
    # whole frame copies every column of the rows it keeps
    cold = j.select(*KEY, "req_id", "t", "S", "L", "verdict").filter(
        eq(pl.col("verdict"), Verdict.COLD)
    )
    boundaries = lost.routing_boundaries(cold, routing)
    split: frozenset[int] = frozenset()
    if options is not None:
        split = options.split
        on_shared = lost.shared_boundaries(cold, routing, options.writes, options.shared)
        if on_shared.height:
            boundaries = boundaries.join(on_shared, on=KEY, how="full", coalesce=True)
    counted = j.select("engine", "N", "verdict").filter(
        ~pl.col("verdict").is_in(plain(d.ASKED_AGAIN))
    )
    per_episode = j.select(
        *KEY,
        "req_id",
        "engine",
        "verdict",
        "S",
        "N",
        "X",
        "A",
        "E",
        "cause",
        "bind_gid",
        "L",
        "E_free",
        "limit",
    )
    return lost.fold(
        lost.account(per_episode, boundaries, promotions, split), counted.drop("verdict")
    )


# ------------------------------------------------------------------ episodes
def _groups(trace: Trace) -> list[Group]:
    groups = groups_from_header(trace.header)
    if not groups:
        raise TraceError("trace header lists no offloaded KV-cache group; cannot diff")
    if trace.parts_of("lookup") and not has_episodes(trace):
        raise TraceError(
            "this schema-1 trace has lookup rows but no episode rows, so episodes cannot be "
            "told apart: pass its episode.parquet too (keytrace diff store.parquet "
            "lookup.parquet episode.parquet); traces of schema 2 carry episodes in lookup.parquet"
        )
    if not trace.parts_of("lookup"):
        sample = sample_of(trace.header)
        if sample is not None:
            raise TraceError(
                f"this sampled trace (KEYTRACE_SAMPLE={sample:g}) holds no sampled prefix "
                "chain yet: none of the requests so far was in the sample; nothing to diff"
            )
        raise TraceError("trace holds no lookup episodes (only store-side rows); nothing to diff")
    return groups


def _chains(
    trace: Trace,
    groups: list[Group],
    offers: pl.DataFrame,
    writes: pl.DataFrame | None = None,
    shared: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """`boundaries.chain` of the episodes of ``trace`` (one row per episode with any); with
    ``writes`` (`boundaries.shared_writes`), the boundaries other engines wrote through to
    a tier this one shares join each episode's ``boundaries`` (`shared_boundaries`)."""
    lookups = frames.lookup_keys(trace, anchor(groups).gid)
    own = frames.collect(chain(lookups, offers))
    if partial_tails.enabled(trace.header):
        own = partial_tails.with_chains(own, trace, trace.header)
    if writes is None or shared is None or writes.height == 0:
        return own
    extra = frames.collect(shared_boundaries(lookups, frames.episodes(trace), writes, shared))
    if extra.height == 0:
        return own
    return (
        own.join(extra, on=KEY, how="full", coalesce=True)
        .with_columns(
            pl.concat_list(
                pl.col("boundaries").fill_null(pl.lit([], pl.List(pl.Int64))),
                pl.col("shared_b").fill_null(pl.lit([], pl.List(pl.Int64))),
            )
            .list.unique()
            .alias("boundaries")
        )
        .drop("shared_b")
    )


def _episodes(
    trace: Trace,
    groups: list[Group],
    chains: pl.DataFrame,
    runs: pl.DataFrame,
    sel: pl.Expr,
    limits: pl.DataFrame,
) -> pl.DataFrame:
    """Every episode of ``trace`` that ``sel`` selects, with L, F, its intended boundaries
    (``chains``: `_chains`), E, E without the request's load cap (``E_free``, where it
    asked for one), its deferral run (``runs``: `_deferral_runs`), the limit that kept a key
    it missed from the tier (``limits``: `_store_limits`) and the base verdict."""
    eps = frames.episodes(trace)
    summaries = frames.scans(trace)
    # each piece is collected on its own (small: one row per episode): composed in one lazy
    # plan with the joins below, a whole pass ran under _expected_boundary's reuse of `out`
    # (measured at 150M rows: +64 MB peak, and slower)
    leads = _tiered_leads(trace, groups) if frames.is_tiered(trace) else None
    F = frames.collect(scans.resident_prefix(summaries, eps, groups, leads)).lazy()
    B = chains.lazy()
    top = as_expr(d.match_ceiling(pl.col("L"), pl.col("F")))  # F null: no full-attention constraint
    trim = trim_first_of(trace.header)
    N, S, max_new = pl.col("N"), pl.col("S"), pl.col("max_new")
    base = frames.collect(
        eps.with_columns(
            lookup_cap(
                groups, N, S, max_new, load_cap(pl.col("max_load"), pl.col("skip")), trim
            ).alias("L"),
            lookup_cap(groups, N, S, max_new, None, trim).alias("L_free"),
        )
    ).lazy()
    out = (
        base.join(F, on=KEY, how="left").join(B, on=KEY, how="left").with_columns(top.alias("top"))
    )
    # E had the request not capped its load: only for the episodes that asked for a cap
    free = out.filter(
        pl.col("max_load").is_not_null() | pl.col("skip").fill_null(False)
    ).with_columns(as_expr(d.free_ceiling(pl.col("L"), pl.col("F"), pl.col("L_free"))).alias("top"))
    E_free = _expected_boundary(free, groups, trace.header).rename({"E": "E_free"})
    out = out.join(_expected_boundary(out, groups, trace.header), on=KEY, how="left").join(
        E_free, on=KEY, how="left"
    )
    if partial_tails.enabled(trace.header):
        out = partial_tails.with_expected(out, trace.header)
    out = out.join(runs.lazy(), on=KEY, how="left").join(limits.lazy(), on=KEY, how="left")
    return (
        out.with_columns(base_verdict().alias("verdict"))
        .with_columns(
            pl.when(pl.col("verdict") == Verdict.LIMITED.value)
            .then(d.limit_of(pl.col("E"), pl.col("E_free"), pl.col("stored_limit"), pl.col("skip")))
            .when(
                (pl.col("verdict") == Verdict.SHORTFALL.value)
                & d.load_capped(pl.col("E"), pl.col("E_free"))
            )
            .then(d.limit_of(pl.col("E"), pl.col("E_free"), None, pl.col("skip")))
            .alias("limit")
        )
        .filter(sel)
        .sort("s", "inst")  # the report's order (`merge_episode_lists`)
        .pipe(frames.collect)
    )


def _store_limits(trace: Trace, view: Trace) -> pl.DataFrame:
    """(inst, s, stored_limit) of the episodes of ``view`` whose scans ended at a key a
    limit kept from the tier: the first scan (in order) whose terminal key's last store
    event on the instance before the episode was a limit's (`keytrace.judge.definitions.
    store_limit`: withheld by its request's ``max_offload_tokens``, filtered by
    ``store_threshold``). Only keys with a limit event are read (none: no join at all)."""
    empty = pl.DataFrame(schema={"inst": pl.Int64, "s": pl.Int64, "stored_limit": pl.String})
    if trace.version < 4:
        return empty
    stores = frames.stores(trace)
    limited = frames.collect(
        stores.filter(pl.col("event").cast(pl.String).is_in(plain(LIMIT_EVENTS)))
        .select("inst", "key")
        .unique()
    )
    if limited.height == 0:
        return empty
    terms = frames.collect(
        frames.scans(view)
        .select("inst", "s", "scan", "term_key")
        .drop_nulls("term_key")
        .join(limited.lazy(), left_on=["inst", "term_key"], right_on=["inst", "key"])
    )
    if terms.height == 0:
        return empty
    history = stores.select("inst", "key", "seq", "event").join(limited.lazy(), on=["inst", "key"])
    return frames.collect(
        terms.lazy()
        .join(history, left_on=["inst", "term_key"], right_on=["inst", "key"])
        .filter(pl.col("seq") < pl.col("s"))
        .sort("seq")
        .group_by("inst", "s", "scan")
        .agg(pl.col("event").last())
        .with_columns(d.store_limit(pl.col("event")).alias("stored_limit"))
        .drop_nulls("stored_limit")
        .sort("scan")
        .group_by(KEY)
        .agg(pl.col("stored_limit").first())
    )


def _tiered_leads(trace: Trace, groups: list[Group]) -> pl.LazyFrame:
    """`scans.tiered_leads` of the episodes of ``trace`` (a tiered trace)."""
    fa = {g.gid: g.tpc for g in groups if g.full_attention}
    calls = frames.collect(
        frames.lookups(trace, gids=list(fa)).select(
            "inst", "s", "scan", "gid", "chunk", "key", "result"
        )
    )
    listed = frames.collect(
        frames.unqueried(trace)
        .filter(pl.col("gid").is_in(list(fa)))
        .select("inst", "s", "gid", "chunk", "key")
    )
    cells = scans.tiered_cells(calls, listed)
    starts = frames.collect(
        frames.episodes(trace)
        .select("inst", "s", "S")
        .join(pl.LazyFrame({"gid": list(fa)}, schema={"gid": pl.Int32}), how="cross")
        .with_columns(
            (pl.col("S") // pl.col("gid").replace_strict(fa, return_dtype=pl.Int64)).alias("first")
        )
        .select("inst", "s", "gid", "first")
    )
    held = durable(cells.select("inst", "s", "key"), frames.tiers(trace))
    return scans.tiered_leads(cells, held, starts).lazy()


def _deferral_runs(trace: Trace) -> pl.DataFrame:
    """(inst, s, deferrals, waited) of every deferred episode: how many of its request's
    lookups in a row on its instance were deferred, this one included, and the nanoseconds
    since the first of them (`keytrace.judge.definitions.stalled`). Of the whole trace:
    a run of deferrals crosses batches."""
    eps = frames.collect(frames.episodes(trace).select("inst", "req_id", "s", "t", "X"))
    deferred = pl.col("X").is_null()
    return (
        eps.sort("inst", "req_id", "s")
        .with_columns((~deferred).cum_sum().over("inst", "req_id").alias("run"))
        .filter(deferred)
        .with_columns(
            pl.col("s").cum_count().over("inst", "req_id", "run").alias("deferrals"),
            (pl.col("t") - pl.col("t").first().over("inst", "req_id", "run")).alias("waited"),
        )
        .select(*KEY, pl.col("deferrals").cast(pl.Int64), "waited")
    )


def _expected_boundary(
    eps: pl.LazyFrame, groups: list[Group], header: dict[str, Any]
) -> pl.LazyFrame:
    """E (`keytrace.judge.definitions.expected_boundary`): the largest intended boundary
    in (S, top], top = min(L, F)."""
    S, top = pl.col("S"), pl.col("top")
    chained = (
        eps.select(*KEY, "S", "top", pl.col("boundaries").alias("b"))
        .explode("b")
        .filter(d.in_reach(pl.col("b"), S, top))
        .group_by(KEY)
        .agg(pl.col("b").max().alias("E_chain"))
    )
    standing = d.standing_boundaries(top, groups, retention_of(header))
    E = as_expr(d.expected_boundary(S, pl.col("E_chain"), standing, groups))
    return (
        eps.select(*KEY, "S", "top")
        .join(chained, on=KEY, how="left")
        .select(*KEY, E.cast(pl.Int64).alias("E"))
    )


# ---------------------------------------------------------------- shortfalls
def _explain_shortfalls(
    trace: Trace,
    view: Trace,
    past: pl.LazyFrame,
    groups: list[Group],
    sf: pl.DataFrame,
    crowd: pl.DataFrame | None = None,
    others: partition.FirstOffers | None = None,
) -> pl.DataFrame:
    """Per shortfall episode: the binding scan, needed chunks with causes, the verdict.
    The episodes' own lookup rows are read from ``view``, the store history from ``past``
    (`_judge`), a request's other lookups from ``trace``; ``crowd``: the trace's
    `keytrace.analysis.history.crowding` (a tiered trace; computed here when None);
    ``others``: `_judge`."""
    empty = pl.DataFrame(
        schema={
            "inst": pl.Int64,
            "s": pl.Int64,
            "verdict2": pl.String,
            "decisive": pl.List(pl.String),
            "term_result": pl.String,
            "bind_gid": pl.Int32,
            "needed": pl.List(pl.Struct({"group_id": pl.Int32, "chunk": pl.Int64})),
        }
    )
    if sf.height == 0:
        return empty
    keys = sf.select(KEY)
    bind = scans.binding(frames.scans(view).join(keys.lazy(), on=KEY, how="semi")).pipe(
        frames.collect
    )
    tph = int(trace.header.get("tokens_per_hash") or 1)
    unqueried, proofs = _recorded(view, keys)
    needed = _needed(sf, groups, tph, proofs, frames.is_tiered(trace))
    partial = partial_tails.enabled(trace.header)
    if partial:  # a partial E: the probe at E binds, and needs the groups' keys at E
        bind = partial_tails.binding(view, sf, bind, trace.header)
        needed = partial_tails.complete_needed(needed, sf, groups, trace.header)
    needed = needed.join(bind.select(*KEY, "bind_gid"), on=KEY, how="left")
    ranges = needed.group_by(*KEY, "gid").agg(
        pl.col("chunk").min().alias("lo"), (pl.col("chunk").max() + 1).alias("hi")
    )
    seen = (
        frames.lookups_in(view, ranges.lazy())
        .group_by(*KEY, "gid", "chunk")
        .agg(pl.col("key", "result", "seq").sort_by("seq").last())
        .pipe(frames.collect)
    )
    needed = needed.join(seen, on=[*KEY, "gid", "chunk"], how="left").with_columns(
        (pl.col("gid") == pl.col("bind_gid")).fill_null(False).alias("binding")
    )
    if partial:
        needed = partial_tails.with_keys(view, needed, sf, groups, trace.header)
    bind = _terminal_within_needed(bind, needed)
    needed = _with_unqueried(needed, unqueried)
    fleet = others.fleet if others is not None else None
    needed = unknown.derive_keys(trace, needed, sf, fleet)
    needed = unknown.settle_offers(trace, needed, sf, fleet)
    needed = needed.join(proofs, on=[*KEY, "gid", "chunk"], how="left")
    tiers = frames.tiers(trace) if frames.is_tiered(trace) else None
    with_cause = _with_causes(trace.header, past, needed, bind, sf, groups, tiers, crowd, others)
    terminals = sf.select(KEY).join(bind, on=KEY, how="left")
    # decisive causes in (group, chunk) order: the first one names an episode's shortfall
    # tokens in the account, so it must not depend on the order joins left the rows in
    verdicts = shortfall_verdicts(with_cause["needed"].sort(*KEY, "gid", "chunk"), terminals)
    out = verdicts.rename({"verdict": "verdict2"}).join(
        bind.select(*KEY, "bind_gid", "term_seq", "term_chunk", "term_key"), on=KEY, how="left"
    )
    out = out.join(with_cause["terminal"], on=KEY, how="left")
    # what `NeededChunk` holds but its tokens (the group's tpc gives them) with the key as
    # bytes, sorted; made into objects (key in hex) only when read (`_ShortfallDetail`):
    # the shortfalls' details are held until the report is written, half the size so
    needed_lists = (
        with_cause["needed"]
        .sort(*KEY, "gid", "chunk")
        .group_by(KEY, maintain_order=True)
        .agg(
            pl.struct(
                pl.col("gid").alias("group_id"),
                "chunk",
                "key",
                pl.col("result").alias("lookup_result"),
                "cause",
                # a key at a partial tail is the chunk of h tokens ending at it
                *(["tpc"] if partial else []),
            ).alias("needed")
        )
    )
    return out.join(needed_lists, on=KEY, how="left")


def _proof_if_better() -> list[pl.Expr]:
    """``key`` and ``cause`` of a needed chunk, from its proof where the proof's cause is
    better (`keytrace.judge.definitions.proof_is_better`): a chunk the lookup may find
    under its own key or its proof is as available as the better of the two, and the
    evidence names the key that decided."""
    better = d.proof_is_better(pl.col("cause"), pl.col("proof_cause"))
    return [
        pl.when(better).then(pl.col("proof")).otherwise(pl.col("key")).alias("key"),
        pl.when(better).then(pl.col("proof_cause")).otherwise(pl.col("cause")).alias("cause"),
    ]


def _terminal_within_needed(bind: pl.DataFrame, needed: pl.DataFrame) -> pl.DataFrame:
    """The terminal key is the first key *E needed* that the binding scan did not find.

    vLLM starts a window scan at its own candidate end, which can lie right of E's window
    (e.g. where an evicted later boundary used to be); the scan's first MISS there says
    nothing about E. So among the binding group's needed chunks the scan looked up and did
    not HIT, the first MISS or RETRY in call order (else the first non-HIT) is terminal;
    only when there is none does the scan's own first MISS stand.
    """
    res = pl.col("result")
    inside = (
        needed.filter(d.terminal_candidate(pl.col("binding"), res))
        .sort(d.terminal_rank(res, pl.col("seq")))
        .group_by(KEY, maintain_order=True)
        .agg(
            pl.col("seq").first().alias("n_seq"),
            pl.col("chunk").first().alias("n_chunk"),
            pl.col("key").first().alias("n_key"),
            res.first().alias("n_result"),
        )
    )
    return (
        bind.join(inside, on=KEY, how="left")
        .with_columns(
            pl.coalesce("n_seq", "term_seq").alias("term_seq"),
            pl.coalesce("n_chunk", "term_chunk").alias("term_chunk"),
            pl.coalesce("n_key", "term_key").alias("term_key"),
            pl.coalesce("n_result", "term_result").alias("term_result"),
        )
        .drop("n_seq", "n_chunk", "n_key", "n_result")
    )


def _recorded(trace: Trace, keys: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The keys the recorder listed for the episodes ``keys`` (trace format v2), in one
    pass: (unqueried, proofs), each KEY, gid, chunk and its key (``ukey``, ``proof``).
    Unqueried: needed keys taken from vLLM's own key lists for groups it never scanned,
    exact. Proofs: under the candidate fix ``eagle_proof_key`` only, the proof key of
    each needed peek (`keytrace.judge.definitions.better_cause`)."""
    got = (
        frames.listed(trace)
        .join(keys.lazy(), on=KEY, how="semi")
        .group_by(*KEY, "scan", "gid", "chunk")
        .agg(pl.col("key").first())
        .pipe(frames.collect)
    )
    unqueried = got.filter(pl.col("scan") == SCAN_UNQUERIED).drop("scan")
    proofs = got.filter(pl.col("scan") == SCAN_PROOF).drop("scan")
    return unqueried.rename({"key": "ukey"}), proofs.rename({"key": "proof"})


def _with_unqueried(needed: pl.DataFrame, unqueried: pl.DataFrame) -> pl.DataFrame:
    """``needed`` with the recorder's unqueried keys where no lookup gave one."""
    if unqueried.height == 0:
        return needed
    return (
        needed.join(unqueried, on=[*KEY, "gid", "chunk"], how="left")
        .with_columns(pl.coalesce("key", "ukey").alias("key"))
        .drop("ukey")
    )


def _needed(
    sf: pl.DataFrame,
    groups: list[Group],
    tph: int,
    proofs: pl.DataFrame | None = None,
    tiered: bool = False,
) -> pl.DataFrame:
    """One row per (episode, group, needed chunk) of the groups
    `keytrace.judge.definitions.lists_needed` names (`~.needed_range` over
    `~.keyed_chunks`). ``proofs`` (`_recorded`): a proof of the chunk just past a group's
    keyed ones was in the lookup's key list too."""
    parts = []
    for g in groups:
        if not d.lists_needed(g, tiered):
            continue
        frame = sf.with_columns(pl.lit(False).alias("tail_proof"))
        if g.drop and proofs is not None and proofs.height:
            plain_keyed = d.keyed_chunks(g, pl.col("H"), tph)
            tail = (
                proofs.filter(pl.col("gid") == g.gid)
                .join(sf.select(*KEY, "H"), on=KEY)
                .filter(pl.col("chunk") == plain_keyed)
                .select(*KEY, pl.lit(True).alias("tail_proof"))
                .unique(KEY)
            )
            frame = sf.join(tail, on=KEY, how="left")
        keyed = d.keyed_chunks(g, pl.col("H"), tph, pl.col("tail_proof").fill_null(False))
        lo, hi = needed_range(g, pl.col("S"), pl.col("E"), keyed)
        parts.append(
            frame.select(
                *KEY,
                pl.lit(g.gid, dtype=pl.Int32).alias("gid"),
                pl.int_ranges(lo, hi).alias("chunk"),
                pl.lit(g.tpc).alias("tpc"),
            )
        )
    if not parts:
        return pl.DataFrame(
            schema={
                "inst": pl.Int64,
                "s": pl.Int64,
                "gid": pl.Int32,
                "chunk": pl.Int64,
                "tpc": pl.Int64,
            }
        )
    return (
        pl.concat(parts)
        .explode("chunk")
        .drop_nulls("chunk")
        .with_columns(pl.col("chunk").cast(pl.Int64))
    )


def _excluded_tiers(eps: pl.DataFrame, header: Mapping[str, Any]) -> pl.DataFrame | None:
    """(inst, s, tier) of the secondary tiers each episode's ``kv_load_tiers`` kept its
    lookup from (`keytrace.judge.rules.excluded_tiers`, evaluated once per distinct filter);
    None where no episode asked for a filter that excludes any."""
    if "load_tiers" not in eps.columns:
        return None
    asked = eps.select(*KEY, "load_tiers").drop_nulls("load_tiers")
    tiers = header.get("secondary_tiers") or []
    table = [
        (f, t) for f in asked["load_tiers"].unique().to_list() for t in excluded_tiers(f, tiers)
    ]
    if not table:
        return None
    by_filter = pl.DataFrame(
        table, schema={"load_tiers": pl.String, "tier": pl.Int32}, orient="row"
    )
    return asked.join(by_filter, on="load_tiers").select(*KEY, "tier")


def _with_causes(
    header: dict[str, Any],
    stores: pl.LazyFrame,
    needed: pl.DataFrame,
    bind: pl.DataFrame,
    sf: pl.DataFrame,
    groups: list[Group],
    tiers: pl.LazyFrame | None = None,
    crowd: pl.DataFrame | None = None,
    others: partition.FirstOffers | None = None,
) -> dict[str, pl.DataFrame]:
    """Causes for the needed chunks (HIT: resident; never looked up: not_looked_up) and for
    each episode's terminal key, from one pass over ``stores`` for just those keys' rows.
    ``tiers``: a tiered trace's tier rows; the probes then carry their episode's request
    and whether its chunks fit the primary (`_fits`)."""
    tpc = {g.gid: g.tpc for g in groups}
    ep = sf.select(*KEY, "t", pl.col("chain_P").alias("keyable_end"))
    # a needed chunk that did not hit is probed under its key and, under a candidate fix
    # that accepts one, its proof key
    missed = needed.filter((pl.col("result") != "HIT").fill_null(True)).join(ep, on=KEY)
    probe_needed, probe_proof = (
        missed.filter(pl.col(col).is_not_null()).select(
            *KEY,
            "t",
            pl.col(col).alias("key"),
            "gid",
            ((pl.col("chunk") + 1) * pl.col("tpc")).alias("token_end"),
            "keyable_end",
            pl.col("result").cast(pl.String),
        )
        for col in ("key", "proof")
    )
    probe_term = (
        bind.filter(pl.col("term_key").is_not_null())
        .join(ep, on=KEY)
        .select(
            *KEY,
            "t",
            pl.col("term_key").alias("key"),
            pl.col("bind_gid").alias("gid"),
            (
                (pl.col("term_chunk") + 1)
                * pl.col("bind_gid").replace_strict(tpc, return_dtype=pl.Int64)
            ).alias("token_end"),
            "keyable_end",
            pl.col("term_result").cast(pl.String).alias("result"),
        )
    )
    probes = (
        pl.concat([probe_needed, probe_proof, probe_term])
        .unique()
        .with_row_index("pid")
        .with_columns(pl.col("pid").cast(pl.Int64))
    )
    if tiers is not None:
        per_episode = sf.select(*KEY, "req_id").join(
            _fits(
                needed,
                sf,
                groups,
                header.get("cpu_num_chunks"),
                crowding(tiers) if crowd is None else crowd,
            ),
            on=KEY,
            how="left",
        )
        probes = probes.join(per_episode, on=KEY, how="left")
    group_ids = [g["group_id"] for g in header["groups"]]
    recurrent = [g.gid for g in groups if g.recurrent]
    excluded = _excluded_tiers(sf, header) if tiers is not None else None
    judged = (
        causes(probes, stores, group_ids, tiers, others, recurrent, excluded)
        .select(*KEY, "key", "gid", "cause")
        .unique([*KEY, "key", "gid"])
    )
    keyable = d.chunk_keyable(pl.col("chunk"), pl.col("tpc"), pl.col("keyable_end"))
    cause = as_expr(
        d.chunk_cause(
            pl.col("result"),
            pl.col("key").is_not_null(),
            pl.col("unoffered"),
            keyable,
            pl.col("cause"),
            gid_in(recurrent),
        )
    )
    needed = (
        needed.join(judged, on=[*KEY, "key", "gid"], how="left")
        .join(ep.select(*KEY, "keyable_end"), on=KEY, how="left")
        .with_columns(cause.alias("cause"))
        .drop("keyable_end")
        .join(
            judged.rename({"key": "proof", "cause": "proof_cause"}),
            on=[*KEY, "proof", "gid"],
            how="left",
        )
        .with_columns(_proof_if_better())
        .drop("proof", "proof_cause")
    )
    terminal = (
        bind.select(*KEY, pl.col("term_key").alias("key"), pl.col("bind_gid").alias("gid"))
        .join(judged, on=[*KEY, "key", "gid"], how="left")
        .select(*KEY, pl.col("cause").alias("term_cause"))
        .unique(KEY)
    )
    return {"needed": needed, "terminal": terminal}


def _fits(
    needed: pl.DataFrame,
    sf: pl.DataFrame,
    groups: list[Group],
    capacity: int | None,
    crowd: pl.DataFrame,
) -> pl.DataFrame:
    """(inst, s, fits, crowded) of a tiered trace's shortfall episodes:
    `keytrace.judge.definitions.fits_primary` of their needed chunks (`~.needed_total`:
    ``needed`` lists every group's on a tiered manager) and `~.crowded` beside the slots
    other work held (``crowd``: `keytrace.analysis.history.crowding`)."""
    counted = needed.group_by(KEY).agg(pl.len().cast(pl.Int64).alias("w"))
    total = d.needed_total(pl.col("w").fill_null(0), pl.col("S"), pl.col("E"), groups, True)
    return (
        sf.select(*KEY, "S", "E")
        .join(counted, on=KEY, how="left")
        .join(crowd, on=KEY, how="left")
        .select(
            *KEY,
            lit(d.fits_primary(total, capacity)).alias("fits"),
            lit(d.crowded(total, capacity, pl.col("held").fill_null(0))).alias("crowded"),
        )
    )


# ------------------------------------------------------------------ results
def _stored_near(
    trace: Trace,
    before: pl.Expr | None,
    reported: pl.DataFrame,
    explained: pl.DataFrame,
    by_gid: dict[int, Group],
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """One query for all reported shortfalls: which binding-group chunks the chain's
    requests had completed near the needed chunks, before the episode."""
    if explained.height == 0:
        return {}
    wanted = (
        reported.select(*KEY, "chain")
        .join(explained.select(*KEY, "bind_gid", "needed"), on=KEY)
        .filter(pl.col("bind_gid").is_not_null())
    )
    if wanted.height == 0:
        return {}
    # around the binding group's needed chunks (or chunk 0), a margin of a few windows,
    # for each request on the episode's chain
    margin = {g.gid: 4 * (g.window or 1) + 2 for g in by_gid.values()}
    mine = (
        wanted.select(*KEY, "bind_gid", "needed")
        .explode("needed")
        .unnest("needed")
        .filter(pl.col("group_id") == pl.col("bind_gid"))
        .group_by(KEY)
        .agg(pl.col("chunk").min().alias("c_lo"), pl.col("chunk").max().alias("c_hi"))
    )
    m = pl.col("gid").replace_strict(margin, return_dtype=pl.Int64)
    span_df = (
        wanted.select(*KEY, pl.col("bind_gid").alias("gid"), pl.col("chain").alias("req_id"))
        .join(mine, on=KEY, how="left")
        .explode("req_id")
        .drop_nulls("req_id")
        .select(
            *KEY,
            "gid",
            "req_id",
            (pl.col("c_lo").fill_null(0) - m).alias("lo"),
            (pl.col("c_hi").fill_null(0) + m).alias("hi"),
        )
    )
    if span_df.height == 0:
        return {}
    # the reader keeps just these requests' chunks before decoding the rest of a row
    at = span_df.select(
        "req_id", pl.int_ranges(pl.max_horizontal("lo", 0), pl.col("hi") + 1).alias("chunk")
    ).explode("chunk")
    got = (
        _stores(trace, before, at=at)
        .filter(pl.col("event") == "completed")
        .join(span_df.lazy(), on=["inst", "gid", "req_id"])
        .filter(pl.col("chunk").is_between("lo", "hi") & (pl.col("seq") < pl.col("s")))
        .group_by(KEY)
        .agg(pl.col("chunk").unique().sort())
        .pipe(frames.collect)
    )
    return {(i, s): chunk_ranges(chunks) for i, s, chunks in got.iter_rows()}
