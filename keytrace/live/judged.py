"""One episode's live verdict (`keytrace.live.judge` gives it, the alarm counts, keeps and
reports it)."""

from __future__ import annotations

from dataclasses import dataclass

from keytrace.format.schema import LookupResult
from keytrace.judge.definitions import Cause, Verdict


@dataclass(frozen=True)
class Judged:
    """One episode's online verdict, with what a warning names."""

    verdict: Verdict
    instance: str
    req_id: str
    episode: int
    S: int
    E: int | None
    external: int | None
    binding_group: int | None = None
    cause: Cause | None = None
    """The first decisive cause (or in_flight / all_resident: `shortfall_cause`)."""
    term_chunk: int | None = None
    term_key: bytes | None = None
    term_result: LookupResult | None = None
    term_cause: Cause | None = None
    decisive: tuple[Cause, ...] = ()
    limit: str | None = None
    """A ``limited`` episode's `keytrace.judge.definitions.Limit`."""
