"""Sweep prompt lengths through the real scheduler: one recorded, diffed scenario per length.

Each length is one `keytrace.vllm.lab.replay.replay` on a fresh harness (prime, GPU-only reset,
identical resend; or a prime of another length sharing the prefix), recorded and diffed. Imports vLLM lazily.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

from keytrace.analysis.geometry import Geometry
from keytrace.analysis.sweep import SweepRow


def run_one(
    geometry: Geometry,
    length: int,
    *,
    inject: str | None = None,
    fix: str | None = None,
    keep_dir: str | None = None,
    prime_length: int | None = None,
) -> SweepRow:
    """One recorded scenario at ``length`` (prime, GPU-only reset, identical resend); the
    verdict is the resend episode's. ``prime_length``: the prime is that long instead,
    sharing the resend's prefix (longer: the resend is a prefix of the prime)."""
    from keytrace.vllm.lab.replay import replay

    t = time.monotonic()
    d = keep_dir or tempfile.mkdtemp(prefix="keytrace-sweep-")
    try:
        r = replay(geometry, [prime_length or length], length, trace_dir=d, inject=inject, fix=fix)
    finally:
        if keep_dir is None:
            shutil.rmtree(d, ignore_errors=True)
    return SweepRow(
        length=length,
        budget=geometry.max_num_batched_tokens,
        blocks_per_chunk=geometry.blocks_per_chunk,
        E=r.expected_E,
        external=r.external_tokens,
        verdict=r.verdict,
        binding_group=r.binding_group,
        terminal_chunk=r.terminal_chunk,
        cause=r.cause,
        seconds=time.monotonic() - t,
        rules_note=r.rules_note,
    )


def run_sweep(
    geometry: Geometry,
    lengths: Iterable[int],
    *,
    inject: str | None = None,
    fix: str | None = None,
    prime_length: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SweepRow]:
    """Run `run_one` for every length (each on a fresh harness, trace discarded), primed
    by a prompt of ``prime_length`` tokens when given."""
    from keytrace.vllm import require_vllm
    from keytrace.vllm.hook.patches import fixed, injected

    require_vllm()  # one clear line before any patch is tried
    todo: Sequence[int] = list(lengths)
    rows = []
    # applied once for the whole sweep (one warning), not once per length
    with fixed(fix), injected(inject):
        for i, n in enumerate(todo):
            rows.append(run_one(geometry, n, prime_length=prime_length))
            if progress is not None:
                progress("lengths", i + 1, len(todo))
    return rows
