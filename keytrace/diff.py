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

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from keytrace.errors import TraceError
from keytrace.reader import Trace

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


@dataclass(frozen=True)
class DiffReport:
    verdict: str  # "agree" | "mismatch"
    first_mismatch: EpisodeVerdict | None
    episodes: list[EpisodeVerdict]
    counts: dict[str, int]
    evidence_incomplete: bool
    warnings: list[str]
    header: dict[str, Any]


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

    ``all_episodes=False`` stops detailed work at the first mismatch (in sequence order) and
    reports only shortfall episodes; ``True`` evaluates and returns every episode.
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

    eps_all = (
        trace.frame("episode")
        .with_columns(
            _s("instance").alias("instance"),
            _s("req_id").alias("req_id"),
            _s("engine_id").alias("engine_id"),
        )
        .collect()
    )
    eps = eps_all
    if request is not None:
        eps = eps.filter(pl.col("req_id") == request)
    if engine is not None:
        eps = eps.filter((pl.col("engine_id") == engine) | (pl.col("instance") == engine))
    if rank is not None:
        eps = eps.filter(pl.col("dp_rank") == rank)
    if eps.height == 0:
        raise TraceError("no episode matches the given --request/--engine/--rank")
    eps = eps.sort("seq")
    tick("episodes", 0, eps.height)

    lk = trace.frame("lookup").with_columns(_s("instance").alias("instance"))
    st = trace.frame("store").with_columns(
        _s("instance").alias("instance"), _s("req_id").alias("req_id"), _s("event").alias("event")
    )

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

    # F: end of the resident full-attention prefix at s, per episode (min over FA groups).
    F = _resident_fa_prefix(lk, st, ep_keys, fa)
    tick("resident prefix", 1, 4)
    # Intended boundaries from earlier stored requests on the same chain.
    B = _chain_boundaries(lk, st, eps_all, ep_keys, groups, has_swa, unit)
    tick("boundaries", 2, 4)

    eps = eps.join(F, on=["instance", "episode"], how="left").join(
        B, on=["instance", "episode"], how="left"
    )
    verdicts: list[EpisodeVerdict] = []
    shortfalls: list[dict[str, Any]] = []
    for r in eps.iter_rows(named=True):
        S, L, X = r["local_tokens"], r["L"], r["external_tokens"]
        Fv = r.get("F")
        top = L if not fa else min(L, Fv if Fv is not None else S)
        cands = set(r.get("boundaries") or [])
        if retention and retention > 0:
            cands.update(range(retention, top + 1, retention))
        if not has_swa:
            cands.update(range(unit, top + 1, unit))
        fit = [b for b in cands if S < b <= top]
        E = max(fit) if fit else None
        base = dict(
            instance=r["instance"],
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
            shortfalls.append({**base, "num_hashes": r["num_hashes"], "seq": r["seq"]})
            verdicts.append(EpisodeVerdict(verdict="shortfall", **base))

    detailed = _explain(shortfalls, lk, st, eps_all, groups, by_gid, tph, all_episodes, tick)
    final = []
    for v in verdicts:
        d = detailed.get((v.instance, v.episode))
        if v.verdict == "shortfall":
            if d is None:
                continue  # not reached: default mode stopped at an earlier mismatch
            final.append(d)
        elif all_episodes:
            final.append(v)
    tick("episodes", eps.height, eps.height)
    counts: dict[str, int] = {}
    for v in verdicts:
        d = detailed.get((v.instance, v.episode))
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
    )


def _resident_fa_prefix(
    lk: pl.LazyFrame, st: pl.LazyFrame, ep_keys: pl.LazyFrame, fa: list[_Group]
) -> pl.DataFrame:
    """Per episode, F = min over FA groups of S + tpc * (leading resident chunks)."""
    if not fa:
        return pl.DataFrame(schema={"instance": pl.String, "episode": pl.Int64, "F": pl.Int64})
    tpc = {g.gid: g.tpc for g in fa}
    rows = (
        lk.filter(pl.col("group_id").is_in(list(tpc)))
        .join(ep_keys.select("instance", "episode"), on=["instance", "episode"], how="semi")
        .select("instance", "episode", "seq", "scan", "group_id", "chunk_idx", "key")
    )
    # The first scan of each FA group is the prefix scan over [S, cap).
    rows = rows.filter(
        pl.col("scan") == pl.col("scan").min().over("instance", "episode", "group_id")
    )
    rows = rows.collect().sort("seq")
    if rows.height == 0:
        return pl.DataFrame(schema={"instance": pl.String, "episode": pl.Int64, "F": pl.Int64})
    resident = _residency(rows, st)
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
    out = rows.sort("seq")
    out = out.join_asof(
        comp.sort("c_seq"),
        left_on="seq",
        right_on="c_seq",
        by=["instance", "key"],
        strategy="backward",
        check_sortedness=False,
    )
    out = out.join_asof(
        evic.sort("e_seq"),
        left_on="seq",
        right_on="e_seq",
        by=["instance", "key"],
        strategy="backward",
        check_sortedness=False,
    )
    out = out.join_asof(
        resets,
        left_on="seq",
        right_on="z_seq",
        by="instance",
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

    A request r' is on the episode's chain through chunk c of the anchor group (the first
    group in lookup order, full attention when there is one) when r' has a store row for the
    episode's own key at c (keys are content-addressed, chained hashes). r' contributes its
    own end boundary b = its cap, if r' shares the prefix through b and stored before s.
    """
    anchor = groups[0]
    for g in groups:
        if g.window is None:
            anchor = g
            break
    empty = pl.DataFrame(
        schema={"instance": pl.String, "episode": pl.Int64, "boundaries": pl.List(pl.Int64)}
    )
    ep_rows = (
        lk.filter(pl.col("group_id") == anchor.gid)
        .join(
            ep_keys.select("instance", "episode", pl.col("seq").alias("s")),
            on=["instance", "episode"],
        )
        .select("instance", "episode", "s", "key", "chunk_idx")
        .unique(["instance", "episode", "key"])
    )
    stores = st.filter(
        (pl.col("group_id") == anchor.gid)
        & pl.col("event").is_in(["prepared", "rejected", "completed", "failed"])
    ).select(
        pl.col("req_id").alias("other"),
        pl.col("instance").alias("other_instance"),
        "key",
        pl.col("seq").alias("st_seq"),
    )
    m = ep_rows.join(stores, on="key").filter(pl.col("st_seq") < pl.col("s")).collect()
    if m.height == 0:
        return empty
    shared = m.group_by("instance", "episode", "other", "other_instance").agg(
        ((pl.col("chunk_idx").max() + 1) * anchor.tpc).alias("shared_end")
    )
    prompts = eps_all.group_by("instance", "req_id").agg(
        pl.col("num_prompt_tokens").max().alias("P")
    )
    shared = shared.join(
        prompts.rename({"instance": "other_instance", "req_id": "other"}),
        on=["other_instance", "other"],
        how="left",
    )
    minus = 1 if has_swa else 0
    shared = shared.with_columns((((pl.col("P") - minus) // unit) * unit).alias("b")).filter(
        pl.col("b").is_not_null() & (pl.col("b") > 0) & (pl.col("b") <= pl.col("shared_end"))
    )
    return shared.group_by("instance", "episode").agg(pl.col("b").unique().alias("boundaries"))


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
    out: dict[tuple[str, int], EpisodeVerdict] = {}
    batch = 1 if not all_episodes else 256
    for i in range(0, len(shortfalls), batch):
        chunk = shortfalls[i : i + batch]
        sel = pl.DataFrame(
            {"instance": [c["instance"] for c in chunk], "episode": [c["episode"] for c in chunk]},
            schema={"instance": pl.String, "episode": pl.Int64},
        )
        rows = lk.join(sel.lazy(), on=["instance", "episode"], how="semi").collect().sort("seq")
        keys = rows.select("key").unique()
        st_rows = (
            st.join(keys.lazy(), on="key", how="semi")
            .select("instance", "req_id", "event", "group_id", "chunk_idx", "key", "seq")
            .collect()
        )
        hashes = keys.with_columns(
            pl.col("key").bin.slice(0, pl.col("key").bin.size() - 4).alias("h")
        )
        st_by_hash = (
            st.filter(pl.col("event") == "completed")
            .with_columns(pl.col("key").bin.slice(0, pl.col("key").bin.size() - 4).alias("h"))
            .join(hashes.select("h").lazy(), on="h", how="semi")
            .select("instance", "group_id", "h", "seq")
            .collect()
        )
        for c in chunk:
            ep_rows = rows.filter(
                (pl.col("instance") == c["instance"]) & (pl.col("episode") == c["episode"])
            )
            v = _explain_one(c, ep_rows, st_rows, st_by_hash, st, eps_all, groups, by_gid, tph)
            out[(c["instance"], c["episode"])] = v
            tick("shortfalls", len(out), len(shortfalls))
            if v.verdict == "mismatch" and not all_episodes:
                return out
    return out


def _hex(k: bytes | None) -> str | None:
    return None if k is None else bytes(k).hex()


def _explain_one(
    c: dict[str, Any],
    rows: pl.DataFrame,
    st_rows: pl.DataFrame,
    st_by_hash: pl.DataFrame,
    st: pl.LazyFrame,
    eps_all: pl.DataFrame,
    groups: list[_Group],
    by_gid: dict[int, _Group],
    tph: int,
) -> EpisodeVerdict:
    inst, s, S, E = c["instance"], c["seq"], c["S"], c["E"]
    seen: dict[tuple[int, int], tuple[bytes, str]] = {}
    for r in rows.iter_rows(named=True):
        if r["chunk_idx"] is not None:
            seen[(r["group_id"], r["chunk_idx"])] = (r["key"], str(r["result"]))

    # Requests on this episode's chain: they have store rows for the episode's own keys.
    chain_reqs = set(st_rows.filter(pl.col("seq") < s)["req_id"].drop_nulls().to_list())
    chain_P = [
        p
        for p in eps_all.filter(pl.col("req_id").is_in(list(chain_reqs)))[
            "num_prompt_tokens"
        ].to_list()
        if p is not None
    ]
    max_keyable_tokens = max(chain_P, default=0)

    events: dict[bytes, list[tuple[int, str, str]]] = {}
    for r in st_rows.iter_rows(named=True):
        events.setdefault(bytes(r["key"]), []).append((r["seq"], r["event"], r["instance"]))
    other_groups: dict[bytes, set[int]] = {}
    for r in st_by_hash.filter(pl.col("instance") == inst).iter_rows(named=True):
        other_groups.setdefault(bytes(r["h"]), set()).add(r["group_id"])
    # Group ids the store path wrote on this instance before s: a hash stored only under
    # other ids, for a group that never appears here, points at a group-id skew.
    stored_gids = set(
        st.filter(
            (pl.col("instance") == inst) & (pl.col("seq") < s) & (pl.col("event") == "prepared")
        )
        .select("group_id")
        .unique()
        .collect()["group_id"]
        .drop_nulls()
        .to_list()
    )
    resets = sorted(
        st.filter((pl.col("event") == "reset") & (pl.col("instance") == inst))
        .select("seq")
        .collect()["seq"]
        .to_list()
    )

    def cause_of(key: bytes | None, gid: int, token_end: int) -> str:
        if key is None:
            return "not_looked_up"
        evs = sorted(events.get(bytes(key), []))
        here = [(q, e) for q, e, i in evs if i == inst]
        before = [(q, e) for q, e in here if q < s]
        last_c = max((q for q, e in before if e == "completed"), default=None)
        last_rm = max(
            [q for q, e in before if e == "evicted"] + [q for q in resets if q < s], default=-1
        )
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
        h = bytes(key)[:-4]
        if gid not in stored_gids and other_groups.get(h, set()) - {gid}:
            return "other_group"
        if token_end <= max_keyable_tokens:
            return "never_offered"
        return "not_keyable"

    # Binding scan: the last scan holding a non-HIT result; terminal key: its first MISS/RETRY.
    binding_gid: int | None = None
    terminal: TerminalKey | None = None
    if rows.height:
        nonhit = rows.filter(pl.col("result").cast(pl.String) != "HIT")
        if nonhit.height:
            last_scan = nonhit["scan"].max()
            scan_rows = rows.filter(pl.col("scan") == last_scan)
            binding_gid = int(scan_rows["group_id"][0])
            bad = scan_rows.filter(pl.col("result").cast(pl.String).is_in(["MISS", "RETRY"]))
            if bad.height == 0:
                bad = scan_rows.filter(pl.col("result").cast(pl.String) != "HIT")
            t = bad.row(0, named=True)
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
        else:
            binding_gid = int(rows["group_id"][-1])

    keyed_tokens = c["num_hashes"] * tph
    needed: list[NeededChunk] = []
    for g in groups:
        for ch in needed_chunks(g, S, E, keyed_tokens // g.tpc):
            key, res = seen.get((g.gid, ch), (None, None))
            cause = cause_of(key, g.gid, (ch + 1) * g.tpc)
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
        causes = sorted(
            {CAUSE_TEXT[n.cause] for n in decisive if n.cause in RULE_CAUSES}
            or {CAUSE_TEXT[n.cause] for n in decisive}
        )
        reason = "lookup needed chunks the store path did not keep: " + "; ".join(causes)
    else:
        verdict = "mismatch"
        reason = "every chunk vLLM's rule needs for a hit at E was resident, yet lookup fell short"

    stored: list[tuple[int, int]] = []
    if binding_gid is not None:
        g = by_gid[binding_gid]
        need_b = [n.chunk for n in binding_needed] or [E // g.tpc]
        lo, hi = min(need_b) - 4 * (g.window or 1) - 2, max(need_b) + 4 * (g.window or 1) + 2
        chain = list(
            {r for r in st_rows.filter(pl.col("seq") < s)["req_id"].drop_nulls().to_list()}
        )
        got = (
            st.filter(
                (pl.col("instance") == inst)
                & (pl.col("group_id") == binding_gid)
                & (pl.col("event") == "completed")
                & (pl.col("seq") < s)
                & pl.col("req_id").is_in(chain)
                & pl.col("chunk_idx").is_between(lo, hi)
            )
            .select("chunk_idx")
            .unique()
            .collect()["chunk_idx"]
            .to_list()
        )
        stored = _ranges(sorted(got))

    return EpisodeVerdict(
        verdict=verdict,
        instance=inst,
        engine_id=c["engine_id"],
        dp_rank=c["dp_rank"],
        req_id=c["req_id"],
        episode=c["episode"],
        step=c["step"],
        num_prompt_tokens=c["num_prompt_tokens"],
        S=S,
        L=c["L"],
        E=E,
        external_tokens=c["external_tokens"],
        accepted_tokens=c["accepted_tokens"],
        binding_group=binding_gid,
        binding_label=by_gid[binding_gid].label if binding_gid is not None else None,
        terminal=terminal,
        needed=needed,
        stored_chunks=stored,
        reason=reason,
    )


def _ranges(xs: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out
