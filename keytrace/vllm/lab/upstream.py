"""`keytrace report`: everything a vLLM developer sends upstream about one mismatch, in one
folder: the Markdown report (geometry, episode, evidence, failing-length rule with its
plot, minimal case), the chunk-map page, the sweep table and a regression test."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from keytrace.analysis.lengthrule import LengthRule, length_rule
from keytrace.analysis.sweep import FixComparison, SweepRow, compare_fix
from keytrace.judge.trust import no_verdict_error, verdict_withheld
from keytrace.report.standalone import is_recurrent_plan, unsupported

ProgressFn = Callable[[str, int, int], None]


@dataclass
class ReportFiles:
    out_dir: str
    markdown: str
    fixture: str
    standalone: str | None
    """The vLLM-only test (None: `keytrace.report.standalone.unsupported` says why)."""
    html: str
    sweep_csv: str
    rule: LengthRule | None
    """The failing-length rule; None for a stalled request (its sweep is over CPU tier
    sizes, `capacity`)."""
    plots: list[str] = field(default_factory=list)
    minimal_trace: str | None = None
    fix: FixComparison | None = None
    capacity: list[Any] = field(default_factory=list)
    """For a stalled request: `keytrace.report.markdown.CapacityRow` per CPU tier size."""


def write_report(
    paths: Sequence[str],
    out_dir: str,
    *,
    request: str | None = None,
    sweep_points: int = 64,
    minimize_case: bool = True,
    fix: str | None = None,
    log: Callable[[str], None] = lambda s: None,
    progress: ProgressFn | None = None,
) -> ReportFiles:
    """Write the report for the trace's first mismatch (or ``request``'s) into ``out_dir``.
    With ``fix`` (a candidate fix's name) the same lengths are swept again with it, and the
    report says how many failing lengths it closes and whether it adds a mismatch."""
    from keytrace import __version__
    from keytrace.analysis.chunkmap import DEFAULT_LIMIT
    from keytrace.analysis.diff import diff
    from keytrace.analysis.geometry import geometry_from_header
    from keytrace.analysis.plan import plan_for
    from keytrace.errors import RulesUncoveredError, UsageError
    from keytrace.format.reader import open_trace
    from keytrace.report.markdown import ReportPage, render_report
    from keytrace.report.table import write_rows
    from keytrace.vllm import require_vllm
    from keytrace.vllm.lab.minimize import minimize
    from keytrace.vllm.lab.sweep import run_sweep
    from keytrace.vllm.mods.catalog import FIXES, fix_names

    trace = open_trace(list(paths))
    report = diff(trace, request=request, maps=DEFAULT_LIMIT)
    if verdict_withheld(report.rules):
        assert report.rules is not None
        raise RulesUncoveredError(no_verdict_error(report.rules, ": nothing to report"))
    v = report.first_mismatch
    if v is None or v.E is None:
        raise UsageError("no mismatch in this trace: nothing to report (keytrace diff says why)")
    require_vllm()  # after the diff, which needs no vLLM: loading it takes seconds
    os.makedirs(out_dir, exist_ok=True)
    header = trace.header
    plan = plan_for(trace, v)
    if v.verdict == "stalled":
        return _write_stalled_report(report, plan, list(paths), out_dir, fix=fix, log=log)

    fixture, standalone, html, evidence = _write_tests_and_map(report, plan, out_dir)

    geo = geometry_from_header(header)
    A = int(header.get("alignment_tokens") or geo.groups[0].block_size * geo.blocks_per_chunk)
    P = v.num_prompt_tokens
    # two alignment periods around the case: every residue twice, at 2A/points spacing
    step = max(1, 2 * A // max(sweep_points, 1))
    lengths = [n for n in range(P - A, P + A, step) if n > A]
    geo = geo.with_(num_gpu_blocks=None, max_model_len=max(geo.max_model_len, P + 4 * A + 1024))
    log(f"sweeping {len(lengths)} lengths {lengths[0]:,}..{lengths[-1]:,} ...")
    rows = run_sweep(geo, lengths, progress=progress)
    sweep_csv = os.path.join(out_dir, "sweep.csv")
    write_rows(rows, csv_path=sweep_csv)
    rule = length_rule(rows, A)
    fixed = None
    fixed_rows = None
    if fix is not None:
        log(f"sweeping them again with candidate fix {fix} ...")
        fixed_rows = run_sweep(geo, lengths, fix=fix, progress=progress)
        write_rows(fixed_rows, csv_path=os.path.join(out_dir, "sweep-fix.csv"))
        fixed = compare_fix(rows, fixed_rows, fix)
    plots: list[str] = []
    try:
        from keytrace.report.plot import plot_sweep

        plots = plot_sweep(
            rows,
            [os.path.join(out_dir, "sweep.png")],
            title=f"{rule.mismatches} of {rule.lengths} lengths mismatch"
            + _with_fix(fixed_rows, fix),
            fixed=(fix, fixed_rows) if fix is not None and fixed_rows is not None else None,
        )
    except Exception as exc:  # the plot is optional (matplotlib is an extra)
        log(f"no plot: {exc}")

    minimal = None
    minimal_trace = None
    if minimize_case:
        log("minimizing ...")
        minimal_trace = os.path.join(out_dir, "minimal-trace")
        minimal = minimize(plan, trace_dir=minimal_trace)

    md = render_report(
        ReportPage(
            v=v,
            header=header,
            keytrace_version=__version__,
            prime_lengths=plan.prime_lengths,
            episode_length=plan.episode_length,
            evidence=evidence,
            rule=rule,
            step=step,
            fixture=os.path.basename(fixture),
            standalone=os.path.basename(standalone) if standalone else None,
            no_standalone=unsupported(plan) or "",
            standalone_recurrent=is_recurrent_plan(plan),
            trace=" ".join(paths),
            html=os.path.basename(html),
            plot=os.path.basename(plots[0]) if plots else None,
            minimal=minimal,
            minimal_trace=os.path.relpath(minimal_trace, out_dir) if minimal_trace else None,
            fix=fixed,
            fix_text="; ".join(FIXES[n] for n in fix_names(fix)),
        )
    )
    return ReportFiles(
        out_dir=out_dir,
        markdown=_write_markdown(out_dir, md),
        fixture=fixture,
        standalone=standalone,
        html=html,
        sweep_csv=sweep_csv,
        rule=rule,
        plots=plots,
        minimal_trace=minimal_trace,
        fix=fixed,
    )


def _write_tests_and_map(report: Any, plan: Any, out_dir: str) -> tuple[str, str | None, str, str]:
    """The two regression tests for the report's first finding (keytrace's fixture, the
    standalone one for vLLM's tree, where one can be written) and its chunk map, written
    into ``out_dir``; their paths (None: no standalone test) and the differ's text for
    the episode (the standalone test quotes it)."""
    from keytrace.report.fixture import file_name, render_fixture
    from keytrace.report.html import write_page
    from keytrace.report.standalone import regression_name, render_vllm_regression
    from keytrace.report.text import render_episode

    evidence = io.StringIO()
    render_episode(report.first_mismatch, evidence, header=report.header)
    files = [render_fixture(plan)]
    if unsupported(plan) is None:
        files.append(render_vllm_regression(plan, evidence=evidence.getvalue()))
    paths = []
    for text, name in zip(
        files,
        (file_name(plan, files[0]), *(regression_name(plan, t) for t in files[1:])),
        strict=True,
    ):
        paths.append(os.path.join(out_dir, name))
        with open(paths[-1], "w") as fh:
            fh.write(text)
    html = os.path.join(out_dir, "chunkmap.html")
    write_page(html, report)
    return paths[0], paths[1] if len(paths) > 1 else None, html, evidence.getvalue()


def _write_markdown(out_dir: str, text: str) -> str:
    """``report.md`` in ``out_dir``; its path."""
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def _with_fix(rows: list[SweepRow] | None, fix: str | None) -> str:
    if rows is None or fix is None:
        return ""
    return f"; with fix {fix}: {sum(r.verdict == 'mismatch' for r in rows)}"


CAPACITY_BELOW, CAPACITY_ABOVE = 1, 2
"""CPU tier sizes a stalled case is replayed at: the recorded one, these many below and
above (one chunk more than the request needs at once is where vLLM serves it)."""


def _write_stalled_report(
    report: Any,
    plan: Any,
    paths: list[str],
    out_dir: str,
    *,
    fix: str | None,
    log: Callable[[str], None],
) -> ReportFiles:
    """`write_report` for a stalled request on a tiered manager: the two regression tests
    (the vLLM-only one at manager level), the chunk map, and a replay at each CPU tier size
    around the recorded one (with ``fix``, each again with the fix) instead of a length
    sweep and a minimal case, which are about store/lookup rules."""
    import csv
    import tempfile

    from keytrace import __version__
    from keytrace.analysis.geometry import Geometry
    from keytrace.report.markdown import CapacityRow, StalledPage, render_stalled_report
    from keytrace.vllm.lab.harness import ABORT_DEFERRALS
    from keytrace.vllm.lab.replay import replay
    from keytrace.vllm.mods.catalog import FIXES, fix_names

    v = report.first_mismatch
    fixture, standalone, html, evidence = _write_tests_and_map(report, plan, out_dir)
    geo = Geometry.from_dict(plan.geometry)
    sizes = range(max(1, geo.cpu_chunks - CAPACITY_BELOW), geo.cpu_chunks + CAPACITY_ABOVE + 1)
    rows: list[CapacityRow] = []

    def run(at: Geometry, fix: str | None) -> Any:
        with tempfile.TemporaryDirectory(prefix="keytrace-capacity-") as d:
            return replay(at, plan.prime_lengths, plan.episode_length, trace_dir=d, fix=fix)

    for n in sizes:
        log(f"replaying with a {n}-chunk CPU tier ...")
        at = geo.with_(cpu_chunks=n)
        stock = run(at, None)
        fixed = run(at, fix) if fix else None
        rows.append(
            CapacityRow(
                n,
                stock.verdict,
                stock.external_tokens or 0,
                fixed.verdict if fixed else None,
                (fixed.external_tokens or 0) if fixed else None,
            )
        )
    capacity_csv = os.path.join(out_dir, "capacity.csv")
    with open(capacity_csv, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["cpu_chunks", "verdict", "external", "fixed_verdict", "fixed_external"])
        for r in rows:
            out.writerow([r.cpu_chunks, r.verdict, r.external, r.fixed_verdict, r.fixed_external])
    md = render_stalled_report(
        StalledPage(
            v=v,
            header=report.header,
            keytrace_version=__version__,
            prime_lengths=plan.prime_lengths,
            episode_length=plan.episode_length,
            evidence=evidence,
            rows=rows,
            give_up=ABORT_DEFERRALS,
            fixture=os.path.basename(fixture),
            standalone=os.path.basename(standalone) if standalone else None,
            no_standalone=unsupported(plan) or "",
            trace=" ".join(paths),
            html=os.path.basename(html),
            fix=fix,
            fix_text="; ".join(FIXES[n] for n in fix_names(fix)),
        )
    )
    return ReportFiles(
        out_dir=out_dir,
        markdown=_write_markdown(out_dir, md),
        fixture=fixture,
        standalone=standalone,
        html=html,
        sweep_csv=capacity_csv,
        rule=None,
        capacity=rows,
    )
