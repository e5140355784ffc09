"""The built-in example, end to end, through the real vLLM scheduler on a CPU.

1. Record 18,877 tokens on the `dsv4` geometry with the pre-#48911 store rule injected,
   and the same on stock vLLM 0.33.0: keytrace names the injected bug, and agrees on stock.
2. Record 17,975 tokens on stock vLLM 0.33.0: the upstream case that still misses.
3. Write a pytest regression for the injected case (red with the bug, green without).
4. Sweep stock vLLM around 17,975 and plot which lengths miss.

Imports vLLM lazily (inside the functions), so ``keytrace --help`` stays light.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from keytrace.analysis.chunkmap import DEFAULT_LIMIT as DRAWN
from keytrace.analysis.diff import DiffReport, diff
from keytrace.analysis.geometry import builtin
from keytrace.analysis.sweep import SweepRow
from keytrace.errors import UsageError
from keytrace.format.reader import open_trace
from keytrace.report.table import write_rows
from keytrace.vllm import require_vllm
from keytrace.vllm.lab.replay import replay


@dataclass
class DemoRun:
    label: str
    trace_dir: str
    num_tokens: int
    inject: str | None
    external_tokens: int
    report: DiffReport


@dataclass
class DemoResult:
    out_dir: str
    runs: list[DemoRun] = field(default_factory=list)
    fixture: str | None = None
    html: str | None = None
    sweep: list[SweepRow] = field(default_factory=list)
    sweep_table: str | None = None
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_demo(
    out_dir: str, *, log: Callable[[str], None] = lambda s: None, sweep_step: int = 8
) -> DemoResult:
    """Run the whole loop into ``out_dir`` (must be new or empty)."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise UsageError(f"{out_dir} is not empty; pass a new --out folder")
    require_vllm()  # after what needs no vLLM to refuse: loading it takes seconds
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()
    res = DemoResult(out_dir=out_dir)
    for label, n, inject in (
        ("injected pre48911", 18_877, "pre48911"),
        ("stock", 18_877, None),
        ("stock", 17_975, None),
    ):
        d = os.path.join(out_dir, f"trace-dsv4-{n}-{inject or 'stock'}")
        log(f"recording dsv4, {n:,} tokens, {label} ...")
        external = replay(builtin("dsv4"), [n], n, trace_dir=d, inject=inject).external_tokens
        res.runs.append(DemoRun(label, d, n, inject, external, diff(open_trace(d), maps=DRAWN)))

    # the picture of the stock miss: 17,975 tokens, group 2's chunk 277 never offered
    from keytrace.report.html import write_page

    last = res.runs[-1]
    res.html = os.path.join(out_dir, f"chunkmap-dsv4-{last.num_tokens}-stock.html")
    write_page(res.html, last.report)

    from keytrace.analysis.plan import plan_from_trace
    from keytrace.report.fixture import file_name, render_fixture

    plan = plan_from_trace(open_trace(res.runs[0].trace_dir))
    text = render_fixture(plan)
    res.fixture = os.path.join(out_dir, file_name(plan, text))
    with open(res.fixture, "w") as fh:
        fh.write(text)

    from keytrace.vllm.lab.sweep import run_sweep

    lengths = list(range(17_975 - 31 * sweep_step, 17_975 + 32 * sweep_step, sweep_step))
    log(f"sweeping {len(lengths)} lengths {lengths[0]:,}..{lengths[-1]:,} on stock vLLM ...")
    res.sweep = run_sweep(builtin("dsv4"), lengths)
    res.sweep_table = os.path.join(out_dir, "sweep.csv")
    write_rows(res.sweep, csv_path=res.sweep_table)
    try:
        from keytrace.report.plot import plot_sweep

        bad = sum(r.verdict == "mismatch" for r in res.sweep)
        res.plots = plot_sweep(
            res.sweep,
            [os.path.join(out_dir, "sweep.png"), os.path.join(out_dir, "sweep.svg")],
            title=f"stock vLLM {_installed()}, dsv4: {bad} of {len(res.sweep)} lengths mismatch",
        )
    except Exception as exc:  # the plot is optional (matplotlib is an extra)
        log(f"no plot: {exc}")
    res.seconds = time.monotonic() - t0
    return res


def _installed() -> str:
    """The installed vLLM's version (the demo runs on whatever is installed; the plot's
    title says which)."""
    import vllm

    return str(vllm.__version__)
