"""What `keytrace.analysis.diff.diff` returns: plain dataclasses, no behaviour beyond views,
and the builders that turn the differ's frames into them (`episode_list`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import polars as pl

from keytrace.analysis.lost import LostTokens
from keytrace.analysis.verdict import reason
from keytrace.judge import definitions as d
from keytrace.judge.definitions import SHORTFALLS, Verdict
from keytrace.judge.identity import IdentityFinding
from keytrace.judge.rules import Group
from keytrace.judge.trust import RulesStatus

KEY = ["inst", "s"]

VERDICTS = (
    Verdict.STALLED,
    Verdict.DEFERRED,
    Verdict.COLD,
    Verdict.HIT,
    Verdict.EXPLAINED,
    Verdict.MISMATCH,
)
"""Every verdict an episode of a trace can get, in the order reports count them."""


def hex_key(k: bytes | None) -> str | None:
    """A key as the results show it (hex), None kept."""
    return None if k is None else bytes(k).hex()


@dataclass(frozen=True, slots=True)
class NeededChunk:
    """One chunk a group needs for a hit at E, and why it is (not) there."""

    group_id: int
    chunk: int
    token_start: int
    token_end: int
    key: str | None
    lookup_result: str | None
    cause: str


@dataclass(frozen=True, slots=True)
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
    """One lookup episode judged: its numbers, its verdict and, for a shortfall, why."""

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
    chain: list[str] = field(default_factory=list)
    """The earlier requests whose intended boundaries this episode shares, oldest first."""
    F: int | None = None
    """How far every full-attention group's chunks were resident from S (None: no
    full-attention group). E never exceeds it."""
    limit: str | None = None
    """What asked that tokens not be loaded (`keytrace.judge.definitions.Limit`): set for a
    ``limited`` episode, and for a shortfall below a ``max_load_tokens`` cap."""
    E_free: int | None = None
    """E had the request not capped its load (None: no cap, or nothing past it)."""

    def evidence(self) -> tuple[int | None, int | None, str | None]:
        """(binding group, terminal chunk, cause) for a shortfall; all None otherwise."""
        if self.verdict not in SHORTFALLS:
            return None, None, None
        t = self.terminal
        return self.binding_group, (t.chunk if t else None), (t.cause if t else None)


@dataclass(frozen=True)
class MapChunk:
    """One chunk of a chunk map lane (`keytrace.analysis.chunkmap`)."""

    chunk: int
    token_start: int
    token_end: int
    key: str | None
    stored: str | None
    """Its key's state on the episode's engine at the episode: ``resident``, ``in_flight``,
    ``evicted``, ``failed``, ``rejected``, or None (never there)."""
    lookup: str | None
    needed: bool
    cause: str | None
    terminal: bool


@dataclass(frozen=True)
class MapLane:
    """One group's chunks on a chunk map's token window."""

    group_id: int
    label: str
    kind: str
    tokens_per_chunk: int
    sliding_window: int | None
    eagle: bool
    """The group queries an EAGLE/MTP peek chunk past E (`keytrace.judge.rules.Group.drop`)."""
    chunks: list[MapChunk] = field(default_factory=list)


@dataclass(frozen=True)
class EpisodeMap:
    """The chunk map of one reported shortfall: a lane per group on ``[token_lo, token_hi)``."""

    episode: EpisodeVerdict
    token_lo: int
    token_hi: int
    lanes: list[MapLane]


NOT_IN_JSON = {"json": False}
"""Field metadata: a view for another reporter (the HTML page), left out of ``--json``."""


NO_VERDICT = "no_verdict"
"""`DiffReport.verdict` of a trace keytrace's rules do not describe
(`keytrace.judge.trust.verdict_withheld`): its facts are reported, nothing is judged."""


@dataclass(frozen=True)
class DiffReport:
    """The verdict over a trace: ``agree`` unless some episode is a ``mismatch``
    (`NO_VERDICT` where the rules do not describe the trace)."""

    verdict: str  # "agree" | "mismatch" | "no_verdict"
    first_mismatch: EpisodeVerdict | None
    episodes: Sequence[EpisodeVerdict]
    counts: dict[str, int]
    evidence_incomplete: bool
    warnings: list[str]
    header: dict[str, Any]
    all_episodes: bool = False
    lost: LostTokens | None = None
    """Where every prompt token of the selected episodes came from (per engine, and all)."""
    sample: float | None = None
    """The fraction of prefix chains a sampled trace holds (``KEYTRACE_SAMPLE``), None for a
    full trace: the verdicts and token counts are exact for those chains and say nothing
    of the rest."""
    rules: RulesStatus | None = None
    """What the oracle found on the vLLM code that recorded the trace
    (`keytrace.judge.trust.trace_rules`; None for a trace built by hand)."""
    engine_counts: dict[str, dict[str, int]] = field(default_factory=dict, metadata=NOT_IN_JSON)
    """Engine (engine id, else recorder instance) -> verdict -> episodes: what
    `keytrace.analysis.fleet.by_engine` reads (``keytrace diff --by engine``)."""
    maps: list[EpisodeMap] = field(default_factory=list, metadata=NOT_IN_JSON)
    """Chunk maps of the first reported shortfalls (``diff(..., maps=N)``; the HTML page)."""
    identity: list[IdentityFinding] = field(default_factory=list)
    """Engines that share a tier and hash differently (`keytrace.judge.identity`): each a
    finding, judged before any key (their keys are never judged against each other)."""


PLAIN_FIELDS = (
    "verdict",
    "instance",
    "instance_id",
    "engine_id",
    "dp_rank",
    "req_id",
    "episode",
    "step",
    "num_prompt_tokens",
    "S",
    "L",
    "E",
    "external_tokens",
    "accepted_tokens",
    "reason",
    "chain",
    "F",
    "limit",
    "E_free",
)
"""The `EpisodeVerdict` fields every episode has; the rest describe a shortfall."""


class EpisodeList(Sequence[EpisodeVerdict]):
    """Reported episodes in sequence order, kept as columns.

    ``rows`` holds `PLAIN_FIELDS` for every episode; ``detailed`` maps a position to the
    full verdict of a shortfall episode. Any other position becomes an `EpisodeVerdict`
    only when read. With ``--all`` a fleet trace reports every episode (150k at 150M rows):
    as objects they were most of the differ's memory and a third of its time; as columns
    they stay small, and `keytrace.report.jsonout` encodes them without building them.
    """

    def __init__(self, rows: pl.DataFrame, detailed: Mapping[int, EpisodeVerdict]) -> None:
        self.rows = rows
        self.detailed = detailed

    def __len__(self) -> int:
        return self.rows.height

    @overload
    def __getitem__(self, i: int) -> EpisodeVerdict: ...
    @overload
    def __getitem__(self, i: slice) -> list[EpisodeVerdict]: ...
    def __getitem__(self, i: int | slice) -> EpisodeVerdict | list[EpisodeVerdict]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        found = self.detailed.get(i)
        return found if found is not None else verdict_from_row(self.rows.row(i, named=True))

    def __iter__(self) -> Iterator[EpisodeVerdict]:
        for i, r in enumerate(self.rows.iter_rows(named=True)):
            found = self.detailed.get(i)
            yield found if found is not None else verdict_from_row(r)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EpisodeList({len(self)} episodes, {len(self.detailed)} detailed)"


def verdict_from_row(row: dict[str, Any]) -> EpisodeVerdict:
    """An `EpisodeVerdict` from a row of `PLAIN_FIELDS` (its list columns as lists)."""
    row["chain"] = list(row["chain"] or [])
    return EpisodeVerdict(**row)


# ------------------------------------------------------------ building them
def episode_list(
    groups: list[Group],
    reported: pl.DataFrame,
    explained: pl.DataFrame,
    stored: dict[tuple[int, int], list[tuple[int, int]]],
) -> EpisodeList:
    """The reported episodes (the differ's frame of them, and its ``explained`` frame of
    their shortfalls; ``stored``: per shortfall, the binding group's chunk ranges the
    chain had stored near there): columns for all; a shortfall's full verdict (the only
    per-episode Python) is built when it is read (`_ShortfallDetail`)."""
    by_gid = {g.gid: g for g in groups}
    # text columns categorical: the rows are held until the report is written, and a
    # fleet's episodes repeat a few verdicts, engines and reasons (150M trace rows: 23 MB
    # of rows as strings, 12 MB so); they read back as str
    text = pl.Categorical
    rows = reported.select(
        pl.col("verdict").cast(text),
        pl.col("instance").cast(text),
        pl.col("inst").alias("instance_id"),
        pl.col("engine_id").cast(text),
        "dp_rank",
        pl.col("req_id").cast(text),
        pl.col("s").alias("episode"),
        "step",
        pl.col("P").alias("num_prompt_tokens"),
        "S",
        "L",
        "E",
        pl.col("X").alias("external_tokens"),
        pl.col("A").alias("accepted_tokens"),
        _plain_reason(reported).cast(text).alias("reason"),
        pl.col("chain").fill_null([]).cast(pl.List(text)),
        "F",
        pl.col("limit").cast(text),
        "E_free",
    )
    if explained.height == 0:
        return EpisodeList(rows, {})
    positions = dict(
        reported.select(KEY)
        .with_row_index("i")
        .join(explained.select(KEY).with_row_index("j"), on=KEY)
        .select(pl.col("i").cast(pl.Int64), pl.col("j").cast(pl.Int64))
        .iter_rows()
    )
    return EpisodeList(rows, _ShortfallDetail(rows, explained, positions, stored, by_gid))


def merge_episode_lists(lists: list[EpisodeList]) -> EpisodeList:
    """Reported episodes of any number of batches (of any instances) as one list, in the
    report's order: sequence number, then recorder instance (seqs are per process, so two
    instances' episodes can share one; each batch is in that order already). The same
    order whatever order the batches came in: a report judged in any partitions, anywhere,
    is the same bytes. Batches that follow one another (one partition's, cut by sequence
    number) are joined end to end."""
    if len(lists) == 1:
        return lists[0]
    ends = [(_first(e), _last(e)) for e in lists if len(e)]
    if all(a[1] < b[0] for a, b in itertools.pairwise(ends)):
        kept = [e for e in lists if len(e)]
        rows = pl.concat([e.rows for e in lists], how="vertical_relaxed", rechunk=False)
        where = [(b, j) for b, e in enumerate(kept) for j in range(len(e))]
        return EpisodeList(rows, _Placed(where, [e.detailed for e in kept]))
    tagged = [
        e.rows.with_columns(
            pl.lit(b, dtype=pl.Int64).alias("_batch"),
            pl.int_range(e.rows.height, dtype=pl.Int64).alias("_pos"),
        )
        for b, e in enumerate(lists)
    ]
    rows = pl.concat(tagged, how="vertical_relaxed").sort(
        "episode", "instance_id", "_batch", "_pos", maintain_order=True
    )
    where = list(zip(rows["_batch"].to_list(), rows["_pos"].to_list(), strict=True))
    return EpisodeList(rows.drop("_batch", "_pos"), _Placed(where, [e.detailed for e in lists]))


def _first(e: EpisodeList) -> tuple[int, int]:
    return (int(e.rows["episode"][0]), int(e.rows["instance_id"][0]))


def _last(e: EpisodeList) -> tuple[int, int]:
    return (int(e.rows["episode"][-1]), int(e.rows["instance_id"][-1]))


class _Placed(Mapping[int, EpisodeVerdict]):
    """Batches' detail mappings seen through a merged order: position ``i`` of the merged
    list is position ``where[i][1]`` of batch ``where[i][0]``. Lookups are direct; only
    iterating (which positions are detailed) walks the batches, once."""

    def __init__(
        self, where: list[tuple[int, int]], pieces: list[Mapping[int, EpisodeVerdict]]
    ) -> None:
        self._where, self._pieces = where, pieces
        self._detailed: list[int] | None = None

    def __getitem__(self, i: int) -> EpisodeVerdict:
        b, j = self._where[i]
        return self._pieces[b][j]

    def get(self, i: int, default: Any = None) -> Any:
        if not 0 <= i < len(self._where):
            return default
        b, j = self._where[i]
        return self._pieces[b].get(j, default)

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and self.get(i) is not None

    def _positions(self) -> list[int]:
        if self._detailed is None:
            at = {w: i for i, w in enumerate(self._where)}
            self._detailed = sorted(at[(b, j)] for b, p in enumerate(self._pieces) for j in p)
        return self._detailed

    def __iter__(self) -> Iterator[int]:
        return iter(self._positions())

    def __len__(self) -> int:
        return len(self._positions())


class _ShortfallDetail(Mapping[int, EpisodeVerdict]):
    """The full verdict of each reported shortfall (by its position in the report), built
    when read. Built up front they were the differ's largest Python transient: 81 MB of
    objects at 150M rows (7,513 shortfalls, 172,799 needed chunks); the JSON writer reads
    each once and lets it go, so only the columns stay."""

    def __init__(
        self,
        rows: pl.DataFrame,
        explained: pl.DataFrame,
        positions: dict[int, int],
        stored: dict[tuple[int, int], list[tuple[int, int]]],
        by_gid: dict[int, Group],
    ) -> None:
        self._rows, self._explained, self._positions = rows, explained, positions
        self._stored, self._by_gid = stored, by_gid

    def __getitem__(self, i: int) -> EpisodeVerdict:
        d = self._explained.row(self._positions[i], named=True)
        base = verdict_from_row(self._rows.row(i, named=True))
        g = self._by_gid[d["bind_gid"]] if d["bind_gid"] is not None else None
        needed = [self._needed_chunk(c) for c in d["needed"] or []]
        # a partial tail's key is listed as the chunk of h tokens ending at it
        tails = {
            n.chunk: n.token_end - n.token_start for n in needed if n.group_id == d["bind_gid"]
        }
        return dataclasses.replace(
            base,
            binding_group=d["bind_gid"],
            binding_label=g.label if g else None,
            terminal=_terminal(d, g, tails.get(d["term_chunk"])),
            needed=needed,
            stored_chunks=self._stored.get((d["inst"], d["s"]), []),
            reason=reason(base.verdict, d["decisive"] or [], d["term_result"]),
        )

    def _needed_chunk(self, c: dict[str, Any]) -> NeededChunk:
        tpc = c.get("tpc") or self._by_gid[c["group_id"]].tpc
        return NeededChunk(
            group_id=c["group_id"],
            chunk=c["chunk"],
            token_start=c["chunk"] * tpc,
            token_end=(c["chunk"] + 1) * tpc,
            key=hex_key(c["key"]),
            lookup_result=c["lookup_result"],
            cause=c["cause"],
        )

    def get(self, i: int, default: Any = None) -> Any:
        # EpisodeList asks for every position: most are plain, and a KeyError each is slow
        return self[i] if i in self._positions else default

    def __contains__(self, i: object) -> bool:
        return i in self._positions

    def __iter__(self) -> Iterator[int]:
        return iter(self._positions)

    def __len__(self) -> int:
        return len(self._positions)


def _plain_reason(reported: pl.DataFrame) -> pl.Expr:
    """The reason of an episode with no shortfall detail, as an expression over ``reported``."""
    e_text = {e: f"{e:,}" for e in reported["E"].drop_nulls().unique().to_list()}
    free_text = {e: f"{e:,}" for e in reported["E_free"].drop_nulls().unique().to_list()}
    labels = {str(k): v for k, v in d.LIMIT_LABELS.items()}
    label = pl.col("limit").cast(pl.String).replace_strict(labels, default=pl.col("limit"))
    v = pl.col("verdict")
    return (
        pl.when(v == "stalled")
        .then(
            pl.lit("vLLM deferred the lookup ")
            + pl.col("deferrals").cast(pl.String)
            + pl.lit(" times in a row and served nothing: the request is stalled")
        )
        .when(v == "deferred")
        .then(pl.lit("vLLM deferred the lookup (returned None)"))
        .when(v == "cold")
        .then(pl.lit("no intended boundary is resident: a cold lookup"))
        .when((v == "limited") & pl.col("E_free").is_not_null())
        .then(
            label
            + pl.lit(": the cap kept E=")
            + pl.col("E_free").replace_strict(free_text, default=None, return_dtype=pl.String)
            + pl.lit(" out of reach; served what it allowed")
        )
        .when(v == "limited")
        .then(label + pl.lit(": the key the lookup missed was kept from the tier on purpose"))
        .otherwise(
            pl.lit("external tokens reach E=")
            + pl.col("E").replace_strict(e_text, default=None, return_dtype=pl.String)
        )
    )


def _terminal(d: dict[str, Any], g: Group | None, tpc: int | None = None) -> TerminalKey | None:
    """The terminal key of a shortfall's detail row; ``tpc``: its chunk's tokens where its
    needed chunk says (a partial tail's key: the hash unit), else the group's."""
    if d["term_key"] is None or g is None:
        return None
    ch = d["term_chunk"]
    tpc = tpc or g.tpc
    return TerminalKey(
        group_id=g.gid,
        chunk=ch,
        token_start=None if ch is None else ch * tpc,
        token_end=None if ch is None else (ch + 1) * tpc,
        key=hex_key(d["term_key"]) or "",
        result=str(d["term_result"]),
        cause=d["term_cause"] or "not_looked_up",
    )


def chunk_ranges(xs: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted chunk indices as runs ``(first, last)``."""
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out
