"""Sweep prompt lengths through the real scheduler: one recorded, diffed scenario per length.

Each length runs on a fresh harness (prime, GPU-only reset, identical resend) with the
recorder on, then `keytrace.diff.diff` judges the resend episode. Imports vLLM lazily.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from keytrace.diff import diff
from keytrace.geometry import Geometry
from keytrace.reader import open_trace


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


def write_rows(
    rows: Sequence[SweepRow], *, csv_path: str | None = None, parquet_path: str | None = None
) -> None:
    """Write a sweep table as CSV and/or Parquet, with an explicit schema (a column may be
    null in every leading row, which inference would get wrong)."""
    import csv

    import polars as pl

    names = list(SWEEP_SCHEMA)
    if csv_path:
        with open(csv_path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(names)
            w.writerows([getattr(r, n) for n in names] for r in rows)
    if parquet_path:
        schema = {n: getattr(pl, t) for n, t in SWEEP_SCHEMA.items()}
        pl.DataFrame(
            [[getattr(r, n) for n in names] for r in rows], schema=schema, orient="row"
        ).write_parquet(parquet_path)


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


def run_one(
    geometry: Geometry, length: int, *, inject: str | None = None, keep_dir: str | None = None
) -> SweepRow:
    """One recorded scenario at ``length``; the verdict is the resend episode's."""
    from keytrace.harness import Harness
    from keytrace.hooks.patches import recording
    from keytrace.inject import injected

    t = time.monotonic()
    d = keep_dir or tempfile.mkdtemp(prefix="keytrace-sweep-")
    try:
        with injected(inject), recording(d):
            h = Harness(geometry, max_prompt_tokens=length)
            res = h.scenario(length)
        report = diff(open_trace(d), request=res.replay.req_id, all_episodes=True)
    finally:
        if keep_dir is None:
            shutil.rmtree(d, ignore_errors=True)
    v = report.episodes[-1]
    group, chunk, cause = v.evidence()
    return SweepRow(
        length=length,
        budget=geometry.max_num_batched_tokens,
        blocks_per_chunk=geometry.blocks_per_chunk,
        E=v.E,
        external=res.external_tokens,
        verdict=v.verdict,
        binding_group=group,
        terminal_chunk=chunk,
        cause=cause,
        seconds=time.monotonic() - t,
    )


def run_sweep(
    geometry: Geometry,
    lengths: Iterable[int],
    *,
    inject: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SweepRow]:
    """Run `run_one` for every length (each on a fresh harness, trace discarded)."""
    todo: Sequence[int] = list(lengths)
    rows = []
    for i, n in enumerate(todo):
        rows.append(run_one(geometry, n, inject=inject))
        if progress is not None:
            progress("lengths", i + 1, len(todo))
    return rows
