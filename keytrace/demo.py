"""The built-in example: record a scenario through the real vLLM scheduler, then diff it.

Imports vLLM lazily (inside `run_demo`), so ``keytrace --help`` stays light.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from keytrace.diff import DiffReport, diff
from keytrace.errors import VllmUnavailableError
from keytrace.geometry import builtin
from keytrace.reader import open_trace
from keytrace.summary import Summary, summarize


@dataclass
class DemoRun:
    label: str
    trace_dir: str
    num_tokens: int
    external_tokens: int
    summary: Summary
    report: DiffReport
    seconds: float


def record_scenario(
    trace_dir: str,
    geometry_name: str,
    num_tokens: int,
    *,
    inject: str | None = None,
    **geo_changes: object,
) -> int:
    """Prime/reset/replay ``num_tokens`` on a fresh real-scheduler harness, recording to
    ``trace_dir``. Returns the replay's external tokens."""
    try:
        from keytrace.harness import Harness
    except ImportError as exc:
        raise VllmUnavailableError(
            f"this needs vLLM ({exc}); install it with: pip install 'keytrace[vllm]'"
        ) from exc
    from keytrace.hooks.patches import recording
    from keytrace.inject import injected

    geometry = builtin(geometry_name)
    if geo_changes:
        geometry = geometry.with_(**geo_changes)
    with injected(inject), recording(trace_dir):
        result = Harness(geometry).scenario(num_tokens)
    return result.external_tokens


def run_demo(
    out_dir: str,
    *,
    geometry: str = "dsv4",
    num_tokens: int = 17_975,
    log: Callable[[str], None] = lambda s: None,
) -> list[DemoRun]:
    """Record ``num_tokens`` on stock vLLM, diff it, and return what happened."""
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    label = "stock"
    trace_dir = os.path.join(out_dir, f"trace-{geometry}-{num_tokens}-{label}")
    if os.path.exists(trace_dir) and os.listdir(trace_dir):
        raise VllmUnavailableError(f"{trace_dir} already exists; pass a fresh --out folder")
    log(f"recording {geometry} {num_tokens:,} tokens ({label}) through the real vLLM scheduler ...")
    t = time.monotonic()
    external = record_scenario(trace_dir, geometry, num_tokens)
    trace = open_trace(trace_dir)
    runs.append(
        DemoRun(
            label,
            trace_dir,
            num_tokens,
            external,
            summarize(trace),
            diff(trace),
            time.monotonic() - t,
        )
    )
    return runs
