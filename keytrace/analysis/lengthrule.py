"""The failing-length rule of a sweep: which residues of the prompt length modulo the
alignment A mismatch, as ranges, and whether that rule explains every swept length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from keytrace.analysis.sweep import SweepRow


@dataclass(frozen=True)
class LengthRule:
    alignment: int
    residues: list[tuple[int, int]]  # inclusive ranges of P mod A that mismatched
    lengths: int
    mismatches: int
    violations: list[int]  # lengths whose residue is in a range but did not mismatch
    unswept: list[tuple[int, int]] = field(default_factory=list)
    """Inclusive ranges of residues next to a mismatching range that no swept length had: a
    sweep with a step samples the residues, so a range's true ends may lie in them."""

    @property
    def holds(self) -> bool:
        return self.mismatches > 0 and not self.violations

    def text(self) -> str:
        if not self.mismatches:
            return f"no swept length mismatched ({self.lengths} lengths)"
        rule = f"mismatch iff P mod {self.alignment} in {{{_ranges(self.residues)}}}"
        if self.unswept:
            rule += (
                f" as sampled (residues {_ranges(self.unswept, ' and ')} were not swept: "
                "a range may reach into them)"
            )
        verdict = (
            f"holds for all {self.lengths} swept lengths"
            if self.holds
            else f"violated by {len(self.violations)} length(s), e.g. {self.violations[:3]}"
        )
        return f"{rule}: {verdict}"


def _ranges(ranges: Sequence[tuple[int, int]], sep: str = ", ") -> str:
    return sep.join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


def length_rule(rows: Sequence[SweepRow], alignment: int) -> LengthRule:
    """Residue ranges of the mismatching lengths, checked against every swept length.

    Residues are taken in sorted order over what was swept: consecutive mismatching ones
    form a range (a sweep with a step samples the residues, so a range is "from the first to
    the last mismatching residue seen, with no passing residue seen in between"). A residue
    that both mismatched and passed at different lengths is a violation: the outcome then
    is not a function of ``P mod A``.
    """
    seen: dict[int, set[bool]] = {}
    for r in rows:
        seen.setdefault(r.length % alignment, set()).add(r.verdict == "mismatch")
    ranges: list[tuple[int, int]] = []
    previous_bad = False
    for res in sorted(seen):
        bad = True in seen[res]
        if bad and previous_bad:
            ranges[-1] = (ranges[-1][0], res)
        elif bad:
            ranges.append((res, res))
        previous_bad = bad
    swept = sorted(seen)
    unswept: list[tuple[int, int]] = []
    for a, b in ranges:
        before = max((r for r in swept if r < a), default=-1)
        after = min((r for r in swept if r > b), default=alignment)
        for lo, hi in ((before + 1, a - 1), (b + 1, after - 1)):
            if lo <= hi and (lo, hi) not in unswept:
                unswept.append((lo, hi))
    mixed = {res for res, v in seen.items() if len(v) == 2}
    violations = sorted(
        r.length for r in rows if r.length % alignment in mixed and r.verdict != "mismatch"
    )
    return LengthRule(
        alignment=alignment,
        residues=ranges,
        lengths=len(rows),
        mismatches=sum(r.verdict == "mismatch" for r in rows),
        violations=violations,
        unswept=unswept,
    )
