"""Sweep prompt lengths through the real scheduler: one recorded, diffed scenario per length.

Each length runs on a fresh harness (prime, GPU-only reset, identical resend) with the
recorder on, then `keytrace.analysis.diff.diff` judges the resend episode. Imports vLLM lazily.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import Geometry
from keytrace.analysis.sweep import SweepRow
from keytrace.format.reader import open_trace
from keytrace.vllm import require_vllm


def run_one(
    geometry: Geometry, length: int, *, inject: str | None = None, keep_dir: str | None = None
) -> SweepRow:
    """One recorded scenario at ``length``; the verdict is the resend episode's."""
    from keytrace.vllm.harness import Harness
    from keytrace.vllm.patches import injected, recording

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
    require_vllm()
    todo: Sequence[int] = list(lengths)
    rows = []
    for i, n in enumerate(todo):
        rows.append(run_one(geometry, n, inject=inject))
        if progress is not None:
            progress("lengths", i + 1, len(todo))
    return rows
