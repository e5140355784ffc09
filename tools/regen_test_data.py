"""Regenerate tests/data/v<SCHEMA_VERSION>/ from the real recorder on the real scheduler.

Run once per schema version (the committed trace of an older version is never rewritten):

    python tools/regen_test_data.py

Every version's trace is the `small` geometry at 1,030 prompt tokens, whose resend is a
stock vLLM 0.33.0 miss (the MTP group's peek chunk is not keyable), compacted to one file
per row kind. From v3 (tiered offloading) it is recorded on vLLM's tiering manager: a CPU
primary of 24 chunks over the in-memory ``example`` tier (deterministic), a second prompt
overflows the primary between the first and its resend, so the resend's keys come back by
promotion (the ``tier`` rows: write-through, tier lookups, promotions and the evictions they
cause). From v4 (per-request limits) the prompt is sent a fourth time asking
``kv_transfer_params={"max_load_tokens": 0}``: its episode row carries the cap, and the
differ calls it ``limited`` (by request), never cold. From v5 (deferred releases) it is
recorded on vLLM 0.34.0's code (its sdist: ``PYTHONPATH=<vllm-0.34.0 source>``), and the
resend's promotion fails the way a p2p tier's late transfer does: ``JobResult(success=False,
deferred_release=event)``, the event set two steps later (the in-memory tier has no I/O
that could still write, so the failure is handed in; vLLM's tiering manager does the rest).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from keytrace.analysis.geometry import SMALL
from keytrace.format.compact import compact
from keytrace.format.schema import SCHEMA_VERSION

LENGTH = 1030


def record_tiered(raw: str) -> None:
    """The v3 scenario (module docstring) recorded into ``raw``."""
    from keytrace.vllm.hook.patches import recording
    from keytrace.vllm.lab.config import tiered
    from keytrace.vllm.lab.harness import Harness

    with recording(raw):
        h = Harness(tiered(SMALL.with_(cpu_chunks=24), ("example",)), max_prompt_tokens=LENGTH)
        for chain in (0, 1):
            h.submit(LENGTH, chain=chain)
            h.run_until_idle()
        h.reset_gpu_prefix_cache()
        release = fail_first_promotion(h) if SCHEMA_VERSION >= 5 else None
        h.submit(LENGTH, chain=0)
        if release is not None:
            for _ in range(2):
                h.step()
            release()
        h.run_until_idle()
        if SCHEMA_VERSION >= 4:
            h.reset_gpu_prefix_cache()
            h.submit(LENGTH, chain=0, kv_transfer_params={"max_load_tokens": 0})
            h.run_until_idle()


def fail_first_promotion(h: Any) -> Callable[[], None]:
    """The next promotion from the harness's one secondary tier fails with a deferred
    release (vLLM 0.34.0's ``JobResult.deferred_release``); returns what sets its event."""
    import inspect
    import threading

    from vllm.v1.kv_offload.tiering.base import JobResult

    if "deferred_release" not in inspect.signature(JobResult).parameters:
        raise SystemExit("v5's trace needs vLLM 0.34.0's tiering manager (deferred releases)")
    [tier] = h.secondary_tiers
    real, event = tier.submit_load, threading.Event()

    def fail_once(job: Any) -> None:
        tier.submit_load = real  # every later promotion is the tier's own
        tier.completed_jobs.append(
            JobResult(job_id=job.job_id, success=False, deferred_release=event)
        )

    tier.submit_load = fail_once
    return event.set


def main() -> int:
    # no options: a parser so that --help explains and exits, never regenerates
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    out = os.path.join(os.path.dirname(__file__), "..", "tests", "data", f"v{SCHEMA_VERSION}")
    out = os.path.normpath(out)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw")
        record_tiered(raw)
        shutil.rmtree(out, ignore_errors=True)
        result = compact([raw], out)
    for kind, rows in result.rows.items():
        print(f"{kind:8} {rows:6} rows -> {result.files[kind]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
