"""A sweep's result rows and the prompt-length grammar (vLLM-free).

`keytrace.vllm.sweep` produces the rows on the real scheduler; reporters write and plot them.
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
    return out
