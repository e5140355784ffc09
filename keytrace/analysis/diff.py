"""Store-vs-lookup differ: per episode, the expected boundary E, the verdict, and for a
shortfall the binding group, the terminal key and the cause of every needed chunk.

Definitions (``docs/diff.md`` is the prose; this module is the source of truth):

- *Episode*: one ``get_num_new_matched_tokens`` call (an ``episode`` row) of a request on one
  recorder instance (one scheduler, one CPU tier); ``s`` is its sequence number, ``S`` its
  local (GPU prefix) tokens.
- *Resident at s*: a key whose store completed on that instance before ``s`` and was not
  evicted (or reset) between the completion and ``s``.
- *Lookup cap L*: vLLM's own limits: ``num_tokens - 1`` when any sliding-window group exists
  (else ``num_tokens``), within ``S + max_new_tokens`` when given, rounded down to a multiple
  of every offloaded group's chunk size.
- *Intended boundaries*: each earlier request on the same chain that stored keys, at its own
  end boundary (its own cap); multiples of the retention interval when it is > 0; every
  boundary when no sliding-window group exists.
- *E*: the largest intended boundary with ``S < E <= L`` such that every full-attention group
  has all its chunks in ``[S, E)`` resident at ``s``. None: a *cold* episode.
- *Verdict*: ``deferred`` (vLLM returned None), ``cold`` (no E), ``hit`` (external >= E - S),
  otherwise a shortfall: ``explained`` when every needed-but-absent chunk is pending,
  completed after the episode, evicted, or stored only on another engine (timing, capacity,
  routing); ``mismatch`` otherwise (the store path never wrote what lookup needs, or wrote it
  under another group, or every needed chunk was resident and lookup still fell short).

Everything scans lazily with polars; per-row Python runs only over the rows of shortfall
episodes, which the default mode stops at after the first mismatch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from keytrace.errors import TraceError
from keytrace.format.reader import Trace

RULE_CAUSES = ("never_offered", "offered_not_accepted", "other_group", "not_keyable")
TIMING_CAUSES = ("pending", "completed_after", "evicted", "other_engine")
CAUSE_TEXT = {
    "resident": "resident",
    "never_offered": "never offered by the store path",
    "offered_not_accepted": "offered but not accepted by prepare_store",
    "pending": "store pending (prepared, not completed) at the lookup",
    "completed_after": "store completed after the episode",
    "evicted": "evicted before the episode",
    "other_engine": "stored only on another engine",
    "other_group": "same hash stored under another group id",
    "not_keyable": "never complete in any stored request (not keyable)",
    "not_looked_up": "not looked up in this episode (key unknown)",
}

ProgressFn = Callable[[str, int, int], None]


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class NeededChunk:
    """One chunk a group needs for a hit at E, and why it is (not) there."""

    group_id: int
    chunk: int
    token_start: int
    token_end: int
    key: str | None
    lookup_result: str | None
    cause: str


@dataclass(frozen=True)
class TerminalKey:
    """The key that ended the binding group's scan (first MISS/RETRY in scan order)."""

    group_id: int
    chunk: int | None
    token_start: int | None
    token_end: int | None
    key: str
    result: str
    cause: str


@dataclass(frozen=True)
class EpisodeVerdict:
    verdict: str
    instance: str
    instance_id: int
    engine_id: str | None
    dp_rank: int | None
    req_id: str
    episode: int
    step: int
    num_prompt_tokens: int
    S: int
    L: int
    E: int | None
    external_tokens: int | None
    accepted_tokens: int | None
    binding_group: int | None = None
    binding_label: str | None = None
    terminal: TerminalKey | None = None
    needed: list[NeededChunk] = field(default_factory=list)
    stored_chunks: list[tuple[int, int]] = field(default_factory=list)
    reason: str = ""

    def evidence(self) -> tuple[int | None, int | None, str | None]:
        """(binding group, terminal chunk, cause) for a shortfall; all None otherwise."""
        if self.verdict not in ("mismatch", "explained"):
            return None, None, None
        t = self.terminal
        return self.binding_group, (t.chunk if t else None), (t.cause if t else None)


@dataclass(frozen=True)
class DiffReport:
    verdict: str  # "agree" | "mismatch"
    first_mismatch: EpisodeVerdict | None
    episodes: list[EpisodeVerdict]
    counts: dict[str, int]
    evidence_incomplete: bool
    warnings: list[str]
    header: dict[str, Any]
    all_episodes: bool = False


# ---------------------------------------------------------------- geometry
@dataclass(frozen=True)
class _Group:
    gid: int
    tpc: int
    window: int | None  # chunks; None = full attention
    sliding_window: int | None  # tokens
    extra: int
    eagle: bool
    kind: str
    label: str


def _groups(header: dict[str, Any]) -> list[_Group]:
    out = []
    for g in header.get("groups", []):
        if not g.get("offloaded"):
            continue
        kind = {"full_attention": "FA", "mla": "MLA", "sliding_window": "SWA"}.get(
            g["kind"], g["kind"]
        )
        label = f"{kind}, MTP" if g.get("is_eagle") else kind
        out.append(
            _Group(
                gid=int(g["group_id"]),
                tpc=int(g["tokens_per_chunk"]),
                window=g.get("window_chunks"),
                sliding_window=g.get("sliding_window"),
                extra=int(g.get("extra_retained_tokens") or 0),
                eagle=bool(g.get("is_eagle")),
                kind=g["kind"],
                label=label,
            )
        )
    if not out:
        raise TraceError("trace header lists no offloaded KV-cache group; cannot diff")
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def load_window(g: _Group, num_tokens: int) -> int:
    """``GroupOffloadConfig.load_window_size_in_chunks`` for a SlidingWindowSpec group."""
    assert g.window is not None
    if g.kind != "sliding_window" or g.sliding_window is None:
        return g.window
    pad = -num_tokens % g.tpc
    return max(g.window, _cdiv(g.sliding_window - 1 + g.extra + pad, g.tpc))


def needed_chunks(g: _Group, S: int, E: int, keyed_chunks: int) -> list[int]:
    """Chunks of group ``g`` that vLLM 0.33.0's lookup needs for a hit ending at ``E``.

    Full attention: every chunk in [S, E). Sliding window: the run the right-to-left scan
    must find, ending at the slice end; an unverified EAGLE group queries one extra "peek"
    chunk (when it is keyed), needs one more consecutive hit, then pops one chunk.
    """
    start = S // g.tpc
    if g.window is None:
        return list(range(start, E // g.tpc))
    if g.eagle:
        query_max = min(E + g.tpc, keyed_chunks * g.tpc)
        num_chunks = min(_cdiv(query_max, g.tpc), keyed_chunks)
        candidate_end = min(E, (num_chunks - 1) * g.tpc)
        initial = load_window(g, candidate_end) + 1
    else:
        num_chunks = min(_cdiv(E, g.tpc), keyed_chunks)
        candidate_end = min(E, num_chunks * g.tpc)
        initial = load_window(g, candidate_end)
    return list(range(max(start, num_chunks - initial), num_chunks))


def lookup_cap(groups: list[_Group], num_tokens: int, S: int, max_new: int | None) -> int:
    """L: vLLM's cap on the hit boundary, rounded to every group's chunk size."""
    cap = num_tokens
    if max_new is not None:
        cap = min(cap, S + max_new)
    if any(g.window is not None for g in groups):
        cap -= 1
    unit = math.lcm(*(g.tpc for g in groups))
    return max(0, cap // unit * unit)


# ------------------------------------------------------------------ the diff
def _s(col: str) -> pl.Expr:
    return pl.col(col).cast(pl.String)


def diff(
    trace: Trace,
    *,
    request: str | None = None,
    engine: str | None = None,
    rank: int | None = None,
    all_episodes: bool = False,
    progress: ProgressFn | None = None,
) -> DiffReport:
    """Evaluate episodes; see the module docstring. Returns data, never prints.

    ``all_episodes=False`` returns only the shortfall episodes (explained and mismatch), with
    ``first_mismatch`` the earliest mismatch in sequence order; ``True`` returns every
    episode (hit, cold and deferred too). Counts always cover every selected episode.
    """
    header = trace.header
    groups = _groups(header)
    by_gid = {g.gid: g for g in groups}
    fa = [g for g in groups if g.window is None]
    has_swa = len(fa) < len(groups)
    unit = math.lcm(*(g.tpc for g in groups))
    tph = int(header.get("tokens_per_hash") or 1)
    retention = header.get("retention_interval") or 0

    def tick(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    if not trace.parts_of("episode"):
        if trace.parts_of("lookup"):
            raise TraceError(
                "trace has lookup rows but no episode rows; cannot tell episodes apart"
            )
        raise TraceError("trace holds no lookup episodes (only store-side rows); nothing to diff")

    # Internally "instance" is the recorder's int64 instance_id: joins never hash strings.
    eps_all = (
        trace.frame("episode")
        .with_columns(
            _s("instance").alias("instance_name"),
            pl.col("instance_id").alias("instance"),
            _s("req_id").alias("req_id"),
            _s("engine_id").alias("engine_id"),
        )
        .drop("instance_id")
        .collect()
    )
    name_of = dict(eps_all.select("instance", "instance_name").unique().iter_rows())
    eps = eps_all
    if request is not None:
        eps = eps.filter(pl.col("req_id") == request)
    if engine is not None:
        eps = eps.filter((pl.col("engine_id") == engine) | (pl.col("instance_name") == engine))
    if rank is not None:
        eps = eps.filter(pl.col("dp_rank") == rank)
    if eps.height == 0:
        raise TraceError("no episode matches the given --request/--engine/--rank")
    eps = eps.sort("seq")
    tick("episodes", 0, eps.height)

    lk = trace.frame("lookup").drop("instance").rename({"instance_id": "instance"})
    # event and req_id stay categorical (string literals compare fine); only small results
    # are cast, so no query materialises strings for every store row.
    st = trace.frame("store").drop("instance").rename({"instance_id": "instance"})

    # L per episode.
    eps = eps.with_columns(
        pl.struct("num_tokens", "local_tokens", "max_new_tokens")
        .map_elements(
            lambda r: lookup_cap(groups, r["num_tokens"], r["local_tokens"], r["max_new_tokens"]),
            return_dtype=pl.Int64,
        )
        .alias("L")
    )
    ep_keys = eps.select("instance", "episode", "seq", "local_tokens").lazy()

    # Intended boundaries from earlier stored requests on the same chain (cheap: one key
    # per stored request is joined against the episodes' anchor-group lookups).
    B = _chain_boundaries(lk, st, eps_all, ep_keys, groups, has_swa, unit)
    tick("boundaries", 1, 3)
    eps = eps.join(B, on=["instance", "episode"], how="left")

    def candidates(r: dict[str, Any], top: int) -> list[int]:
        S = r["local_tokens"]
        cands = set(r.get("boundaries") or [])
        if retention and retention > 0:
            cands.update(range(retention, top + 1, retention))
        if not has_swa:
            cands.update(range(unit, top + 1, unit))
        return [b for b in cands if S < b <= top]

    # First pass without residency: deferred, cold, and hits that reach every candidate
    # (a real hit proves the full-attention prefix it loaded was resident). Only the rest
    # need the resident full-attention prefix F, an as-of join over store history.
    rows_all = list(eps.iter_rows(named=True))
    need_f = []
    for r in rows_all:
        if r["external_tokens"] is None:
            continue
        c = candidates(r, r["L"])
        if c and r["external_tokens"] < max(c) - r["local_tokens"]:
            need_f.append((r["instance"], r["episode"]))
    F = pl.DataFrame(schema={"instance": pl.Int64, "episode": pl.Int64, "F": pl.Int64})
    if need_f and fa:
        sub = pl.DataFrame(need_f, schema={"instance": pl.Int64, "episode": pl.Int64}, orient="row")
        F = _resident_fa_prefix(
            lk, st, ep_keys.join(sub.lazy(), on=["instance", "episode"], how="semi"), fa
        )
    f_by = {(a, b): f for a, b, f in F.iter_rows()}
    need_f_set = set(need_f)
    tick("resident prefix", 2, 3)

    verdicts: list[EpisodeVerdict] = []
    shortfalls: list[dict[str, Any]] = []
    for r in rows_all:
        S, L, X = r["local_tokens"], r["L"], r["external_tokens"]
        key = (r["instance"], r["episode"])
        if key in need_f_set:
            Fv = f_by.get(key)
            top = min(L, Fv if Fv is not None else S)
        else:
            top = L
        fit = candidates(r, top)
        E = max(fit) if fit else None
        base = dict(
            instance=name_of.get(r["instance"], str(r["instance"])),
            instance_id=r["instance"],
            engine_id=r["engine_id"],
            dp_rank=r["dp_rank"],
            req_id=r["req_id"],
            episode=r["episode"],
            step=r["step"],
            num_prompt_tokens=r["num_prompt_tokens"],
            S=S,
            L=L,
            E=E,
            external_tokens=X,
            accepted_tokens=r["accepted_tokens"],
        )
        if X is None:
            verdicts.append(
                EpisodeVerdict(
                    verdict="deferred", reason="vLLM deferred the lookup (returned None)", **base
                )
            )
        elif E is None:
            verdicts.append(
                EpisodeVerdict(
                    verdict="cold", reason="no intended boundary is resident: a cold lookup", **base
                )
            )
        elif X >= E - S:
            verdicts.append(
                EpisodeVerdict(verdict="hit", reason=f"external tokens reach E={E:,}", **base)
            )
        else:
            shortfalls.append(
                {**base, "base": base, "num_hashes": r["num_hashes"], "seq": r["seq"]}
            )
            verdicts.append(EpisodeVerdict(verdict="shortfall", **base))

    detailed = _explain(shortfalls, lk, st, eps_all, groups, by_gid, tph, all_episodes, tick)
    final = []
    for v in verdicts:
        d = detailed.get((v.instance_id, v.episode))
        if v.verdict == "shortfall":
            if d is None:
                continue  # not reached: default mode stopped at an earlier mismatch
            final.append(d)
        elif all_episodes:
            final.append(v)
    tick("episodes", eps.height, eps.height)
    counts: dict[str, int] = {}
    for v in verdicts:
        d = detailed.get((v.instance_id, v.episode))
        name = (
            d.verdict
            if d is not None
            else ("shortfall_unexamined" if v.verdict == "shortfall" else v.verdict)
        )
        counts[name] = counts.get(name, 0) + 1
    first = next((v for v in final if v.verdict == "mismatch"), None)
    return DiffReport(
        verdict="mismatch" if first else "agree",
        first_mismatch=first,
        episodes=final,
        counts=counts,
        evidence_incomplete=trace.incomplete,
        warnings=list(trace.warnings),
        header=header,
        all_episodes=all_episodes,
    )


def _resident_fa_prefix(
    lk: pl.LazyFrame, st: pl.LazyFrame, ep_keys: pl.LazyFrame, fa: list[_Group]
) -> pl.DataFrame:
    """Per episode, F = min over FA groups of S + tpc * (leading resident chunks)."""
    if not fa:
        return pl.DataFrame(schema={"instance": pl.Int64, "episode": pl.Int64, "F": pl.Int64})
    tpc = {g.gid: g.tpc for g in fa}
    rows = (
        lk.filter(pl.col("group_id").is_in(list(tpc)))
        .join(ep_keys.select("instance", "episode"), on=["instance", "episode"], how="semi")
        .select("instance", "episode", "seq", "scan", "group_id", "chunk_idx", "key", "result")
    )
    # The first scan of each FA group is the prefix scan over [S, cap).
    rows = rows.filter(
        pl.col("scan") == pl.col("scan").min().over("instance", "episode", "group_id")
    )
    rows = rows.collect().sort("seq")
    if rows.height == 0:
        return pl.DataFrame(schema={"instance": pl.Int64, "episode": pl.Int64, "F": pl.Int64})
    # A HIT in the episode is the manager's word that the key was resident and ready; only
    # the other rows need the store history (as-of joins), usually one MISS per scan.
    hit = rows.filter(pl.col("result") == "HIT").with_columns(pl.lit(True).alias("resident"))
    other = rows.filter(pl.col("result") != "HIT")
    checked = _residency(other, st).select(*hit.columns) if other.height else hit.clear()
    resident = pl.concat([hit, checked])
    per = (
        resident.sort("chunk_idx")
        .group_by("instance", "episode", "group_id", maintain_order=True)
        .agg(pl.col("resident").cast(pl.Int64).cum_prod().sum().alias("n"))
        .join(
            ep_keys.collect().select("instance", "episode", "local_tokens"),
            on=["instance", "episode"],
        )
        .with_columns(
            (
                (
                    pl.col("local_tokens")
                    // pl.col("group_id").replace_strict(tpc, return_dtype=pl.Int64)
                    + pl.col("n")
                )
                * pl.col("group_id").replace_strict(tpc, return_dtype=pl.Int64)
            ).alias("Fg")
        )
    )
    out = per.group_by("instance", "episode").agg(pl.col("Fg").min().alias("F"))
    # An FA group with no scan rows at all (cap below one chunk) has F = S.
    n_fa = per.group_by("instance", "episode").agg(pl.len().alias("k"))
    return (
        out.join(n_fa, on=["instance", "episode"])
        .with_columns(pl.when(pl.col("k") < len(fa)).then(None).otherwise(pl.col("F")).alias("F"))
        .drop("k")
    )


def _residency(rows: pl.DataFrame, st: pl.LazyFrame) -> pl.DataFrame:
    """Add ``resident``: completed on the row's instance before the row, not removed since."""
    keys = rows.select("key").unique()
    ev = (
        st.filter(pl.col("event").is_in(["completed", "evicted"]))
        .join(keys.lazy(), on="key", how="semi")
        .select("instance", "key", "seq", "event")
        .collect()
        .sort("seq")
    )
    comp = ev.filter(pl.col("event") == "completed").select(
        "instance", "key", pl.col("seq").alias("c_seq")
    )
    evic = ev.filter(pl.col("event") == "evicted").select(
        "instance", "key", pl.col("seq").alias("e_seq")
    )
    resets = (
        st.filter(pl.col("event") == "reset")
        .select("instance", pl.col("seq").alias("z_seq"))
        .collect()
        .sort("z_seq")
    )
    # For each row: the last completion, eviction and reset at or before it (as-of joins).
    out = rows.sort("seq")
    for right, col, by in (
        (comp, "c_seq", ["instance", "key"]),
        (evic, "e_seq", ["instance", "key"]),
        (resets, "z_seq", ["instance"]),
    ):
        out = out.join_asof(
            right.sort(col),
            left_on="seq",
            right_on=col,
            by=by,
            strategy="backward",
            check_sortedness=False,
        )
    removed = pl.max_horizontal(pl.col("e_seq").fill_null(-1), pl.col("z_seq").fill_null(-1))
    return out.with_columns(
        (pl.col("c_seq").is_not_null() & (pl.col("c_seq") > removed)).alias("resident")
    )


def _chain_boundaries(
    lk: pl.LazyFrame,
    st: pl.LazyFrame,
    eps_all: pl.DataFrame,
    ep_keys: pl.LazyFrame,
    groups: list[_Group],
    has_swa: bool,
    unit: int,
) -> pl.DataFrame:
    """Per episode, the end boundaries of earlier requests that share its prefix there.

    Every stored request r' has one end boundary b (its own cap). Keys are chained,
    content-addressed hashes, so r' shares an episode's prefix through b exactly when the
    episode looked up the same anchor-group key (full attention when there is one) for the
    chunk ending at b as r' offered for it. Only that one key per stored request is joined,
    so the cost is one pass over the anchor group's lookup rows.
    """
    anchor = next((g for g in groups if g.window is None), groups[0])
    empty = pl.DataFrame(
        schema={"instance": pl.Int64, "episode": pl.Int64, "boundaries": pl.List(pl.Int64)}
    )
    minus = 1 if has_swa else 0
    prompts = (
        eps_all.group_by("instance", "req_id")
        .agg(pl.col("num_prompt_tokens").max().alias("P"))
        .with_columns((((pl.col("P") - minus) // unit) * unit).alias("b"))
        .filter(pl.col("b") > 0)
        .with_columns((pl.col("b") // anchor.tpc - 1).alias("cb"))
    )
    bkeys = (
        st.filter(
            (pl.col("group_id") == anchor.gid)
            & pl.col("event").is_in(["prepared", "rejected", "completed", "failed"])
        )
        .select("instance", _s("req_id").alias("req_id"), "chunk_idx", "key", "seq")
        .join(prompts.lazy(), on=["instance", "req_id"])
        .filter(pl.col("chunk_idx") == pl.col("cb"))
        .group_by("key", "b")
        .agg(pl.col("seq").min().alias("st_seq"))
    )
    m = (
        lk.filter(pl.col("group_id") == anchor.gid)
        .select("instance", "episode", "key")
        .join(bkeys, on="key")
        .join(
            ep_keys.select("instance", "episode", pl.col("seq").alias("s")),
            on=["instance", "episode"],
        )
        .filter(pl.col("st_seq") < pl.col("s"))
        .collect()
    )
    if m.height == 0:
        return empty
    return m.group_by("instance", "episode").agg(pl.col("b").unique().alias("boundaries"))


# ------------------------------------------------------------- explanations
def _explain(
    shortfalls: list[dict[str, Any]],
    lk: pl.LazyFrame,
    st: pl.LazyFrame,
    eps_all: pl.DataFrame,
    groups: list[_Group],
    by_gid: dict[int, _Group],
    tph: int,
    all_episodes: bool,
    tick: Callable[[str, int, int], None],
) -> dict[tuple[str, int], EpisodeVerdict]:
    """Explain every shortfall episode with a fixed handful of lazy queries.

    Nothing proportional to the trace is collected: the queries return per-episode facts
    (binding scan, terminal row, the keys of the needed chunks, chain requests) and the
    store history of just those keys. Python then works per episode on dictionaries.
    """
    out: dict[tuple[str, int], EpisodeVerdict] = {}
    if not shortfalls:
        return out
    tick("shortfalls", 0, len(shortfalls))
    sel = pl.DataFrame(
        {
            "instance": [c["instance_id"] for c in shortfalls],
            "episode": [c["episode"] for c in shortfalls],
            "s": [c["seq"] for c in shortfalls],
        },
        schema={"instance": pl.Int64, "episode": pl.Int64, "s": pl.Int64},
    )
    # An int64 is_in filter only: episode ids may repeat across instances, so every query
    # below ends in an exact join on (instance, episode) with small per-episode tables.
    lk_sf = lk.filter(pl.col("episode").is_in(sel["episode"].unique().implode()))
    facts = _scan_facts(lk_sf, shortfalls, groups, tph)
    tick("shortfalls", len(shortfalls) // 3, len(shortfalls))

    # The keys whose store history decides a cause: needed chunks and terminal keys.
    # Only keys that need a cause: a needed chunk the episode itself saw as HIT is resident
    # by the manager's own word (see _explain_one), so its history is never consulted.
    wanted: set[bytes] = set()
    for f in facts.values():
        wanted.update(k for k, res in f.seen.values() if res != "HIT")
        if f.terminal is not None:
            wanted.add(f.terminal["key"])
    keys = pl.DataFrame({"key": sorted(wanted)}, schema={"key": pl.Binary})
    anchor = next((g for g in groups if g.window is None), groups[0])
    hashes = keys.select(pl.col("key").bin.slice(0, pl.col("key").bin.size() - 4).alias("h"))
    st_rows_q = st.join(keys.lazy(), on="key", how="semi").select(
        "instance", "req_id", "event", "key", "seq"
    )
    other_q = (
        st.filter(pl.col("event") == "completed")
        .with_columns(pl.col("key").bin.slice(0, pl.col("key").bin.size() - 4).alias("h"))
        .join(hashes.lazy(), on="h", how="semi")
        .select("instance", "group_id", "h")
        .unique()
    )
    # Requests on each episode's chain: they stored the episode's own anchor-group keys.
    chain_q = (
        lk_sf.filter(pl.col("group_id") == anchor.gid)
        .select("instance", "episode", "key")
        .join(
            st.filter(pl.col("group_id") == anchor.gid).select(
                "key", "req_id", pl.col("seq").alias("q")
            ),
            on="key",
        )
        .join(sel.lazy(), on=["instance", "episode"])
        .filter(pl.col("q") < pl.col("s"))
        .group_by("instance", "episode")
        .agg(pl.col("req_id").cast(pl.String).drop_nulls().unique())
    )
    first_q = (
        st.filter(pl.col("event") == "prepared")
        .group_by("instance", "group_id")
        .agg(pl.col("seq").min())
    )
    resets_q = st.filter(pl.col("event") == "reset").select("instance", "seq")
    st_rows, other, chains, first_df, resets_df = pl.collect_all(
        [st_rows_q, other_q, chain_q, first_q, resets_q]
    )
    tick("shortfalls", 2 * len(shortfalls) // 3, len(shortfalls))

    events: dict[bytes, list[tuple[int, str, str]]] = {}
    for inst, _rid, e, k, q in st_rows.sort("seq").iter_rows():
        events.setdefault(k, []).append((q, e, inst))  # in sequence order
    other_groups: dict[tuple[str, bytes], set[int]] = {}
    for inst, g, h in other.iter_rows():
        other_groups.setdefault((inst, h), set()).add(g)
    first_prepared = {(i, g): q for i, g, q in first_df.iter_rows()}
    resets: dict[str, list[int]] = {}
    for i, q in resets_df.iter_rows():
        resets.setdefault(i, []).append(q)
    prompts: dict[str, int] = {}
    for rid, p in eps_all.select("req_id", "num_prompt_tokens").iter_rows():
        if p is not None and p > prompts.get(rid, -1):
            prompts[rid] = p
    chain_of = {(a, b): sorted(c) for a, b, c in chains.iter_rows()}
    ctx = _Context(events, other_groups, first_prepared, resets, prompts)
    done = [
        _explain_one(
            c,
            facts.get((c["instance_id"], c["episode"]), _ScanFacts()),
            chain_of.get((c["instance_id"], c["episode"]), []),
            ctx,
            groups,
            by_gid,
            tph,
        )
        for c in shortfalls
    ]
    _fill_stored_chunks(done, st, out)
    tick("shortfalls", len(shortfalls), len(shortfalls))
    return out


@dataclass
class _ScanFacts:
    """What one episode's recorded lookup rows say, extracted for a whole batch at once."""

    seen: dict[tuple[int, int], tuple[bytes, str]] = field(default_factory=dict)  # needed chunks
    binding_gid: int | None = None
    terminal: dict[str, Any] | None = None  # the terminal lookup row


def _scan_facts(
    lk_sf: pl.LazyFrame, chunk: list[dict[str, Any]], groups: list[_Group], tph: int
) -> dict[tuple[str, int], _ScanFacts]:
    """Needed-chunk keys, binding scan and terminal key for every shortfall episode.

    Binding scan: the last scan (in call order) holding a non-HIT result; terminal key: its
    first MISS or RETRY in scan order (else its first non-HIT). With no non-HIT at all the
    binding group is the group of the episode's last lookup.
    """
    out: dict[tuple[str, int], _ScanFacts] = {
        (c["instance_id"], c["episode"]): _ScanFacts() for c in chunk
    }
    need = []
    for c in chunk:
        keyed = c["num_hashes"] * tph
        for g in groups:
            for ch in needed_chunks(g, c["S"], c["E"], keyed // g.tpc):
                need.append((c["instance_id"], c["episode"], g.gid, ch))
    need_df = pl.DataFrame(
        need,
        schema={
            "instance": pl.Int64,
            "episode": pl.Int64,
            "group_id": pl.Int32,
            "chunk_idx": pl.Int64,
        },
        orient="row",
    )
    seen_q = (
        lk_sf.select("instance", "episode", "group_id", "chunk_idx", "key", "result", "seq")
        .join(need_df.lazy(), on=["instance", "episode", "group_id", "chunk_idx"])
        .sort("seq")
        .unique(["instance", "episode", "group_id", "chunk_idx"], keep="last")
    )
    keys_df = pl.DataFrame(
        [k for k in out], schema={"instance": pl.Int64, "episode": pl.Int64}, orient="row"
    )
    per_ep_q = (
        lk_sf.filter(pl.col("result") != "HIT")
        .group_by("instance", "episode")
        .agg(pl.col("scan").max().alias("last_scan"))
        .join(keys_df.lazy(), on=["instance", "episode"])
    )
    seen, per_ep = pl.collect_all([seen_q, per_ep_q])
    for inst, ep, gid, ch, k, res, _q in seen.iter_rows():
        out[(inst, ep)].seen[(gid, ch)] = (k, str(res))
    # Episodes whose lookups were all HIT (rare): the binding group is their last lookup's.
    all_hit = keys_df.join(per_ep, on=["instance", "episode"], how="anti")
    if all_hit.height:
        last = (
            lk_sf.join(all_hit.lazy(), on=["instance", "episode"])
            .sort("seq")
            .group_by("instance", "episode")
            .agg(pl.col("group_id").last())
            .collect()
        )
        for inst, ep, gid in last.iter_rows():
            out[(inst, ep)].binding_gid = int(gid)
    last_scan = per_ep.filter(pl.col("last_scan").is_not_null()).select(
        "instance", "episode", "last_scan"
    )
    if last_scan.height:
        bad = pl.col("result").is_in(["MISS", "RETRY"])
        # The terminal row's seq: the first MISS/RETRY of the last non-HIT scan, else its
        # first non-HIT; then fetch just those rows by seq (an int is_in, no wide join).
        term_seq = (
            lk_sf.join(last_scan.lazy(), on=["instance", "episode"])
            .filter(pl.col("scan") == pl.col("last_scan"))
            .group_by("instance", "episode")
            .agg(
                pl.coalesce(
                    pl.col("seq").filter(bad).min(),
                    pl.col("seq").filter(pl.col("result") != "HIT").min(),
                ).alias("seq")
            )
            .collect()
        )
        term = (
            lk_sf.filter(pl.col("seq").is_in(term_seq["seq"].implode()))
            .join(term_seq.lazy(), on=["instance", "episode", "seq"])
            .collect()
        )
        for t in term.iter_rows(named=True):
            f = out[(t["instance"], t["episode"])]
            f.binding_gid = int(t["group_id"])
            f.terminal = t
    return out


@dataclass
class _Context:
    events: dict[bytes, list[tuple[int, str, int]]]  # key -> (seq, event, instance id)
    other_groups: dict[tuple[int, bytes], set[int]]  # (instance id, block hash) -> group ids
    first_prepared: dict[tuple[int, int], int]  # (instance id, group) -> first prepared seq
    resets: dict[int, list[int]]  # instance id -> reset seqs
    prompts: dict[str, int]  # req_id -> prompt tokens


def _fill_stored_chunks(
    done: list[tuple[EpisodeVerdict, list[str], tuple[int, int] | None]],
    st: pl.LazyFrame,
    out: dict[tuple[str, int], EpisodeVerdict],
) -> None:
    """One query for the whole batch: which binding-group chunks the chain stored near E."""
    wanted = [
        (v, chain, span)
        for v, chain, span in done
        if span is not None and v.binding_group is not None
    ]
    got = pl.DataFrame()
    if wanted:
        lo = min(span[0] for _, _, span in wanted)
        hi = max(span[1] for _, _, span in wanted)
        got = (
            st.filter(
                (pl.col("event") == "completed")
                & pl.col("instance").is_in(list({v.instance_id for v, _, _ in wanted}))
                & pl.col("group_id").is_in(list({v.binding_group for v, _, _ in wanted}))
                & pl.col("chunk_idx").is_between(lo, hi)
            )
            .select("instance", "group_id", "chunk_idx", "req_id", "seq")
            .collect()
        )
    by_req: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for inst, gid, ch, rid, q in got.iter_rows() if got.height else ():
        by_req.setdefault((inst, gid, rid), []).append((ch, q))
    for v, chain, span in done:
        stored: list[tuple[int, int]] = []
        if span is not None and v.binding_group is not None:
            stored = _ranges(
                sorted(
                    {
                        ch
                        for rid in chain
                        for ch, q in by_req.get((v.instance_id, v.binding_group, rid), ())
                        if q < v.episode and span[0] <= ch <= span[1]
                    }
                )
            )
        out[(v.instance_id, v.episode)] = dataclasses.replace(v, stored_chunks=stored)


def _hex(k: bytes | None) -> str | None:
    return None if k is None else bytes(k).hex()


def _explain_one(
    c: dict[str, Any],
    facts: _ScanFacts,
    chain_reqs: list[str],
    ctx: _Context,
    groups: list[_Group],
    by_gid: dict[int, _Group],
    tph: int,
) -> tuple[EpisodeVerdict, list[str], tuple[int, int] | None]:
    inst, s, S, E = c["instance_id"], c["seq"], c["S"], c["E"]
    keyed_tokens = c["num_hashes"] * tph
    need_by_group = {g.gid: needed_chunks(g, S, E, keyed_tokens // g.tpc) for g in groups}
    seen = facts.seen
    max_keyable_tokens = max((ctx.prompts.get(r, 0) for r in chain_reqs), default=0)
    resets = [q for q in ctx.resets.get(inst, []) if q < s]

    def cause_of(key: bytes | None, gid: int, token_end: int) -> str:
        if key is None:
            return "not_looked_up"
        evs = ctx.events.get(bytes(key), ())
        here = [(q, e) for q, e, i in evs if i == inst]
        before = [(q, e) for q, e in here if q < s]
        last_c = max((q for q, e in before if e == "completed"), default=None)
        last_rm = max([q for q, e in before if e == "evicted"] + resets, default=-1)
        if last_c is not None and last_c > last_rm:
            return "resident"
        if last_c is not None:
            return "evicted"
        last_p = max((q for q, e in before if e == "prepared"), default=None)
        if last_p is not None and not any(
            q > last_p and e in ("completed", "failed") for q, e in before
        ):
            return "pending"
        if any(e == "completed" and q > s for q, e in here):
            return "completed_after"
        if any(e == "completed" for q, e, i in evs if i != inst):
            return "other_engine"
        if any(e in ("rejected", "failed") for q, e in before):
            return "offered_not_accepted"
        first = ctx.first_prepared.get((inst, gid))
        gid_stored = first is not None and first < s
        if not gid_stored and ctx.other_groups.get((inst, bytes(key)[:-4]), set()) - {gid}:
            return "other_group"
        if token_end <= max_keyable_tokens:
            return "never_offered"
        return "not_keyable"

    binding_gid = facts.binding_gid
    terminal: TerminalKey | None = None
    if facts.terminal is not None and binding_gid is not None:
        t = facts.terminal
        g = by_gid[binding_gid]
        ch = t["chunk_idx"]
        terminal = TerminalKey(
            group_id=binding_gid,
            chunk=ch,
            token_start=None if ch is None else ch * g.tpc,
            token_end=None if ch is None else (ch + 1) * g.tpc,
            key=_hex(t["key"]) or "",
            result=str(t["result"]),
            cause=cause_of(t["key"], binding_gid, t["end_token"] or 0),
        )

    # A HIT recorded in this very episode is the manager's own word that the key was
    # resident and ready: no history look-up needed. Full-attention chunks that were
    # resident are not listed (they are the long prefix E rests on); everything else is.
    needed: list[NeededChunk] = []
    for g in groups:
        for ch in need_by_group[g.gid]:
            key, res = seen.get((g.gid, ch), (None, None))
            cause = "resident" if res == "HIT" else cause_of(key, g.gid, (ch + 1) * g.tpc)
            if g.window is None and cause == "resident":
                continue
            needed.append(
                NeededChunk(g.gid, ch, ch * g.tpc, (ch + 1) * g.tpc, _hex(key), res, cause)
            )

    absent = [n for n in needed if n.cause not in ("resident", "not_looked_up")]
    binding_needed = [n for n in needed if n.group_id == binding_gid]
    decisive = [n for n in binding_needed if n.cause not in ("resident", "not_looked_up")] or absent
    if terminal is not None and terminal.result in ("HIT_PENDING", "RETRY"):
        verdict = "explained"
        reason = f"lookup saw {terminal.result} at the binding key: the store had not finished"
    elif decisive and all(n.cause in TIMING_CAUSES for n in decisive):
        verdict = "explained"
        causes = sorted({CAUSE_TEXT[n.cause] for n in decisive})
        reason = "shortfall explained by timing/capacity/routing: " + "; ".join(causes)
    elif decisive:
        verdict = "mismatch"
        rule = {CAUSE_TEXT[n.cause] for n in decisive if n.cause in RULE_CAUSES}
        causes = sorted(rule or {CAUSE_TEXT[n.cause] for n in decisive})
        reason = "lookup needed chunks the store path did not keep: " + "; ".join(causes)
    else:
        verdict = "mismatch"
        reason = "every chunk vLLM's rule needs for a hit at E was resident, yet lookup fell short"

    span: tuple[int, int] | None = None
    if binding_gid is not None:
        g = by_gid[binding_gid]
        need_b = [n.chunk for n in binding_needed] or [E // g.tpc]
        margin = 4 * (g.window or 1) + 2
        span = (min(need_b) - margin, max(need_b) + margin)

    v = EpisodeVerdict(
        **c["base"],
        verdict=verdict,
        binding_group=binding_gid,
        binding_label=by_gid[binding_gid].label if binding_gid is not None else None,
        terminal=terminal,
        needed=needed,
        stored_chunks=[],
        reason=reason,
    )
    return v, chain_reqs, span


def _ranges(xs: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out
