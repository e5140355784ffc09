"""A sweep's result rows and the prompt-length grammar (vLLM-free).

`keytrace.vllm.lab.sweep` produces the rows on the real scheduler; reporters write and plot them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SweepRow:
    length: int
    budget: int
    blocks_per_chunk: int
    E: int | None
    external: int
    verdict: str
    binding_group: int | None
    terminal_chunk: int | None
    cause: str | None
    seconds: float
    rules_note: str | None = None
    """The length's diff line on unverified rules (not a column of the written table)."""


SWEEP_SCHEMA = {
    "length": "Int64",
    "budget": "Int64",
    "blocks_per_chunk": "Int64",
    "E": "Int64",
    "external": "Int64",
    "verdict": "String",
    "binding_group": "Int64",
    "terminal_chunk": "Int64",
    "cause": "String",
    "seconds": "Float64",
}


def parse_lengths(spec: str) -> list[int]:
    """``17000:19000:1`` (start:stop:step, stop inclusive), ``a,b,c``, or a mix of both."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip().replace("_", "")
        if not part:
            continue
        m = re.fullmatch(r"(\d+):(\d+)(?::(\d+))?", part)
        if m:
            lo, hi, step = int(m[1]), int(m[2]), int(m[3] or 1)
            if step <= 0 or hi < lo:
                raise ValueError(f"bad range {part!r}: need start <= stop and step > 0")
            out.extend(range(lo, hi + 1, step))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ValueError(f"bad length {part!r}: use N, N,M or START:STOP[:STEP]")
    if not out:
        raise ValueError("no lengths given")
    if min(out) < 1:
        raise ValueError("bad length 0: a prompt has at least 1 token")
    return out


@dataclass(frozen=True)
class FixComparison:
    """The same lengths swept on stock vLLM and with a candidate fix: what the fix closes
    and what it breaks. ``closed`` are failing lengths that hit with the fix; ``reach_E``
    those whose external tokens equal the stock sweep's E (a fix may also hit short of it
    by moving E); ``new`` lengths that did not mismatch on stock and do with the fix."""

    fix: str
    lengths: int
    failing: list[int]
    closed: list[int]
    reach_E: list[int]
    new: list[int]

    @property
    def closes_all(self) -> bool:
        return bool(self.failing) and len(self.closed) == len(self.failing) and not self.new

    def text(self) -> str:
        new = (
            "no new mismatch"
            if not self.new
            else f"{len(self.new)} new mismatch(es), e.g. {self.new[:3]}"
        )
        return (
            f"with fix {self.fix}: {len(self.closed)} of {len(self.failing)} failing lengths "
            f"hit ({len(self.reach_E)} reach E), {new} among {self.lengths} lengths"
        )


def compare_fix(stock: list[SweepRow], fixed: list[SweepRow], fix: str) -> FixComparison:
    """Pair the two sweeps by length (both must cover the same lengths)."""
    by_len = {r.length: r for r in fixed}
    if sorted(by_len) != sorted(r.length for r in stock):
        raise ValueError("the stock and fixed sweeps cover different lengths")
    failing = [r.length for r in stock if r.verdict == "mismatch"]
    closed = [n for n in failing if by_len[n].verdict == "hit"]
    stock_E = {r.length: r.E for r in stock}
    reach = [n for n in closed if by_len[n].external == stock_E[n]]
    new = [
        r.length
        for r in stock
        if r.verdict != "mismatch" and by_len[r.length].verdict == "mismatch"
    ]
    return FixComparison(fix, len(stock), failing, closed, reach, new)
