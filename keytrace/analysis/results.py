"""What `keytrace.analysis.diff.diff` returns: plain dataclasses, no behaviour beyond views."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keytrace.analysis.lost import LostTokens

VERDICTS = ("deferred", "cold", "hit", "explained", "mismatch")


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
    episodes: list[EpisodeVerdict]
    counts: dict[str, int]
    evidence_incomplete: bool
    warnings: list[str]
    header: dict[str, Any]
    all_episodes: bool = False
    lost: LostTokens | None = None
    """Where every prompt token of the selected episodes came from (per engine, and all)."""
