"""The fleet view of a verdict: one row per engine (``keytrace diff --by engine``). Pure:
returns data, never prints.

An operator with offload on many engines asks which engines show write-only mismatches,
in which groups, and what they cost. Each engine's row has its verdict counts, its first
mismatch, and the rows of the lost-token table whose cause is a RULE (the store and lookup
paths disagree: `keytrace.judge.definitions.RULE_CAUSES`), worst engines first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keytrace.analysis.lost import LostRow
from keytrace.analysis.results import DiffReport, EpisodeVerdict
from keytrace.judge import definitions as d
from keytrace.judge.identity import IdentityFinding
from keytrace.judge.trust import RulesStatus


@dataclass(frozen=True)
class EngineVerdict:
    """One engine of the fleet (engine id, else the recorder instance)."""

    engine: str
    counts: dict[str, int]
    """Verdict -> episodes."""
    mismatches: int
    """Episodes whose verdict is a finding (`keytrace.judge.definitions.FINDINGS`)."""
    rule_tokens: int
    """Prompt tokens its lookups fell short of E for RULE causes."""
    first_mismatch: EpisodeVerdict | None = None
    rule_rows: list[LostRow] = field(default_factory=list)


@dataclass(frozen=True)
class FleetReport:
    """`by_engine` of a `DiffReport`: the verdict over the whole trace, then each engine."""

    verdict: str
    evidence_incomplete: bool
    sample: float | None
    engines: list[EngineVerdict]
    warnings: list[str] = field(default_factory=list)
    identity: list[IdentityFinding] = field(default_factory=list)
    """Engines that share a tier and hash differently (`DiffReport.identity`)."""
    rules: RulesStatus | None = None
    """`DiffReport.rules`: what the oracle found on the recording's code, and what the
    rules do not describe (the text's first line says it as `keytrace diff` does)."""


def engine_of(v: EpisodeVerdict) -> str:
    """The engine an episode belongs to, as the lost-token table names it."""
    return v.engine_id if v.engine_id is not None else v.instance


def by_engine(report: DiffReport) -> FleetReport:
    """Per engine: counts, first mismatch, RULE rows of the lost-token table; sorted worst
    first (most mismatches, then most RULE tokens lost, then by name)."""
    first: dict[str, EpisodeVerdict] = {}
    for v in report.episodes:  # in sequence order: the first one seen is the first
        if v.verdict in d.FINDINGS:
            first.setdefault(engine_of(v), v)
    rules: dict[str, list[LostRow]] = {}
    for row in report.lost.rows if report.lost is not None else []:
        if row.engine != "all" and row.category == "short" and row.cause in d.RULE_CAUSES:
            rules.setdefault(row.engine, []).append(row)
    engines = [
        EngineVerdict(
            engine=e,
            counts=dict(c),
            mismatches=sum(n for k, n in c.items() if k in d.FINDINGS),
            rule_tokens=sum(r.tokens for r in rules.get(e, [])),
            first_mismatch=first.get(e),
            rule_rows=sorted(rules.get(e, []), key=_row_order),
        )
        for e, c in report.engine_counts.items()
    ]
    engines.sort(key=lambda x: (-x.mismatches, -x.rule_tokens, x.engine))
    return FleetReport(
        verdict=report.verdict,
        evidence_incomplete=report.evidence_incomplete,
        sample=report.sample,
        engines=engines,
        warnings=list(report.warnings),
        identity=list(report.identity),
        rules=report.rules,
    )


def _row_order(r: LostRow) -> tuple[Any, ...]:
    return (-r.tokens, str(r.cause), -1 if r.group is None else r.group)
