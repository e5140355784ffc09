"""What `keytrace.analysis.diff.diff` returns: plain dataclasses, no behaviour beyond views."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import polars as pl

from keytrace.analysis.lost import LostTokens

VERDICTS = ("deferred", "cold", "hit", "explained", "mismatch")


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

    def evidence(self) -> tuple[int | None, int | None, str | None]:
        """(binding group, terminal chunk, cause) for a shortfall; all None otherwise."""
        if self.verdict not in ("mismatch", "explained"):
            return None, None, None
        t = self.terminal
        return self.binding_group, (t.chunk if t else None), (t.cause if t else None)


@dataclass(frozen=True)
class DiffReport:
    """The verdict over a trace: ``agree`` unless some episode is a ``mismatch``."""

    verdict: str  # "agree" | "mismatch"
    first_mismatch: EpisodeVerdict | None
    episodes: Sequence[EpisodeVerdict]
    counts: dict[str, int]
    evidence_incomplete: bool
    warnings: list[str]
    header: dict[str, Any]
    all_episodes: bool = False
    lost: LostTokens | None = None
    """Where every prompt token of the selected episodes came from (per engine, and all)."""


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
