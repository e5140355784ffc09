"""`keytrace report`: an upstream-ready folder for one mismatch."""

from __future__ import annotations

import os
import sys

import click

from keytrace.cli._common import (
    OutputPath,
    allow_incomplete_option,
    check_complete,
    echo_trace_warnings,
    fix_option,
    plain_progress_option,
    subcommand,
    trace_paths,
)
from keytrace.cli._progress import progress_printer
from keytrace.errors import EXIT_MISMATCH
from keytrace.format.reader import open_trace


@subcommand("report")
@trace_paths
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    required=True,
    help="Folder to write (new or empty).",
)
@click.option("--request", default=None, help="The mismatching request [default: the first].")
@click.option(
    "--sweep-points",
    type=click.IntRange(min=4),
    default=64,
    show_default=True,
    help="Prompt lengths swept around the case (over two alignment units) for the rule.",
)
@click.option("--no-minimize", is_flag=True, help="Skip the minimal case (faster).")
@fix_option("Also sweep the lengths with this candidate fix and report what it closes.")
@allow_incomplete_option
@plain_progress_option
def command(
    paths: tuple[str, ...],
    out_dir: str,
    request: str | None,
    sweep_points: int,
    no_minimize: bool,
    fix: str | None,
    allow_incomplete: bool,
    progress: bool | None,
) -> int:
    """Write an upstream-ready report of a trace's first mismatch into OUT.

    OUT/report.md: vLLM version and geometry table, the episode (S, L, E, external), the
    binding group and terminal key with evidence, the failing-length rule from a sweep
    around the case on the real scheduler (with sweep.png and sweep.csv), the minimal case
    (`keytrace minimize`, trace in OUT/minimal-trace), two regression tests (one that
    imports only vLLM, for vLLM's own test tree, and `keytrace fixture`'s) and the chunk
    map page (OUT/chunkmap.html).

    A stalled request on a tiered manager (deferred without end) gets the same tests (the
    vLLM-only one for tests/v1/kv_offload/tiering/) and, instead of the length sweep and
    the minimal case, a replay at each CPU tier size around the recorded one
    (OUT/capacity.csv; with --fix, each also with the fix).

    \b
    Exit status: 1 (a mismatch was reported), 2 trouble (no mismatch, no verdict, no
    vLLM, ...).
    """
    from keytrace.errors import UsageError
    from keytrace.vllm.lab.upstream import write_report

    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise UsageError(f"{out_dir} is not empty; pass a new --out folder")
    trace = open_trace(list(paths))  # an upstream report is a verdict: on whole evidence
    echo_trace_warnings(trace, allow_incomplete=allow_incomplete)
    check_complete(trace, allow_incomplete)
    show = progress if progress is not None else sys.stderr.isatty()
    files = write_report(
        list(paths),
        out_dir,
        request=request,
        sweep_points=sweep_points,
        minimize_case=not no_minimize,
        fix=fix,
        log=(lambda s: click.echo(s, err=True)) if show else (lambda s: None),
        progress=progress_printer() if show else None,
    )
    click.echo(f"report      {files.markdown}")
    if files.rule is not None:
        click.echo(f"  rule      {files.rule.text()}")
    for r in files.capacity:
        fixed = f"; with the fix {r.fixed_verdict}" if r.fixed_verdict else ""
        click.echo(f"  cpu {r.cpu_chunks:>5} {r.verdict}, {r.external:,} external{fixed}")
    if files.fix is not None:
        click.echo(f"  fix       {files.fix.text()}")
    if files.standalone:
        click.echo(f"  test      {files.standalone}   (vLLM only: drop into vLLM's tests)")
    click.echo(f"  test      {files.fixture}   (through keytrace)")
    click.echo(f"  chunk map {files.html}")
    for p in files.plots:
        click.echo(f"  plot      {p}")
    if files.minimal_trace:
        click.echo(f"  minimal   {files.minimal_trace}")
    return EXIT_MISMATCH
