"""`keytrace diff`: the first terminal store/lookup mismatch, per group and key."""

from __future__ import annotations

import os
import sys

import click

from keytrace.analysis.chunkmap import DEFAULT_LIMIT
from keytrace.analysis.diff import diff
from keytrace.analysis.fleet import by_engine
from keytrace.analysis.results import NO_VERDICT
from keytrace.analysis.runners import LocalRunner, RayRunner, Runner
from keytrace.cli._common import (
    OutputPath,
    allow_incomplete_option,
    check_complete,
    echo_trace_warnings,
    echo_warnings,
    json_option,
    progress_option,
    refuse_incomplete,
    subcommand,
)
from keytrace.cli._progress import progress_printer
from keytrace.errors import (
    EXIT_MISMATCH,
    EXIT_OK,
    RulesDisputedError,
    RulesUncoveredError,
    UsageError,
)
from keytrace.format.reader import open_trace
from keytrace.judge.trust import agree_refused, no_verdict_error
from keytrace.report.jsonout import write_json
from keytrace.report.text import render_diff, render_fleet


@subcommand("diff")
@click.argument("paths", nargs=-1, required=False, metavar="TRACE...")
@click.option(
    "--request",
    default=None,
    help="Only episodes of this request: vLLM's id, or the id the API returned (cmpl-...: every choice of it).",
)
@click.option("--engine", default=None, help="Only this engine id (or recorder instance).")
@click.option("--rank", type=int, default=None, help="Only this data-parallel rank.")
@click.option(
    "--all",
    "all_episodes",
    is_flag=True,
    help="Report every episode (hit, cold, deferred, explained, mismatch).",
)
@json_option
@click.option(
    "--html",
    "html_path",
    type=OutputPath(),
    default=None,
    help="Also write a self-contained HTML page: the verdict, the lost-token table and a "
    "chunk map of each shortfall episode (per group: stored, needed, looked up, terminal key).",
)
@click.option(
    "--html-limit",
    type=click.IntRange(min=1),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="Episodes drawn in the HTML page at most (mismatches first).",
)
@click.option(
    "--by",
    "by",
    type=click.Choice(["engine"]),
    default=None,
    help="One row per engine (engine id, else recorder instance), worst first: verdict "
    "counts, the first mismatch (or stalled request), and the tokens it lost for RULE "
    "causes (store and lookup paths disagree: rejected, no_checkpoint, other_group, "
    "never_offered, "
    "not_keyable and the tiered ones; docs/diff.md, Causes). With --json: the fleet report.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Judge the engines of a fleet trace in this many local processes (2 sets of "
    "engines each). On a few cores one process is fastest: polars already uses them all. "
    "The report is the same bytes for any value.",
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ADDRESS]",
    help="Judge the engines as Ray tasks on a cluster: ADDRESS as ray.init takes it "
    "(ray://host:10001, host:6379, auto); without one, the cluster RAY_ADDRESS names, else "
    "one running here, else a new local one (a path right after --ray is a TRACE, not an "
    "address). Needs keytrace[ray] on every node, and the trace at the same path there (a "
    "shared filesystem). Same report as without.",
)
@allow_incomplete_option
@progress_option
def command(
    paths: tuple[str, ...],
    request: str | None,
    engine: str | None,
    rank: int | None,
    all_episodes: bool,
    as_json: bool,
    html_path: str | None,
    html_limit: int,
    by: str | None,
    jobs: int,
    ray_address: str | None,
    allow_incomplete: bool,
    progress: bool | None,
) -> int:
    """Find where lookup needed a key the store path never wrote.

    TRACE is any mix of part files (store.parquet lookup.parquet, in any order), trace
    directories, quoted globs and object-store URIs (s3://bucket/prefix: read through a
    local cache); each part's kind comes from its metadata.

    For every lookup episode keytrace computes the expected boundary E (the largest
    boundary an earlier request on the same chain stored for, whose full-attention prefix
    is resident) and compares it with the external tokens vLLM returned. A shortfall is
    explained (pending, evicted, other engine) or a mismatch: then the binding group, its
    terminal key and the cause of every chunk it needed are printed. docs/diff.md has the
    definitions.

    A trace known to be incomplete (every part names the flush that wrote it and what
    that flush wrote, so a kill between two parts is detected) gets no verdict unless
    --allow-incomplete.

    \b
    Exit status: 0 no mismatch, 1 mismatch found, 2 could not decide (bad or incomplete
    input, rules the oracle disputed, or NO VERDICT: a trace the rules do not describe).
    """
    if by is not None and (all_episodes or html_path is not None):
        raise UsageError("--by engine is a table of engines: use it without --all and --html")
    paths, ray_address = _trace_after_ray(paths, ray_address)
    if not paths:
        raise UsageError("missing TRACE: a trace directory, part files or an s3:// URI")
    if ray_address is not None and jobs != 1:
        raise UsageError("--ray and --jobs choose who judges the engines: give one of them")
    trace = open_trace(list(paths))
    echo_trace_warnings(trace, allow_incomplete=allow_incomplete)
    check_complete(trace, allow_incomplete, unlooked=False)  # the report finds those
    show = progress if progress is not None else (sys.stderr.isatty() and not as_json)
    report = diff(
        trace,
        request=request,
        engine=engine,
        rank=rank,
        all_episodes=all_episodes,
        progress=progress_printer() if show else None,
        maps=html_limit if html_path is not None else 0,
        runner=_runner(jobs, ray_address),
    )
    found = report.warnings[len(trace.warnings) :]  # found while judging
    if report.evidence_incomplete and not allow_incomplete:
        echo_warnings(found[1:])  # the first is the error's own line
        refuse_incomplete(found)
    echo_warnings(found)
    if by == "engine":
        fleet = by_engine(report)
        if as_json:
            write_json(fleet, sys.stdout)
        else:
            render_fleet(fleet, sys.stdout)
    elif as_json:
        write_json(report, sys.stdout)
    else:
        render_diff(report, sys.stdout)
    if html_path is not None:
        from keytrace.report.html import write_page  # Jinja2: only when a page is asked for

        write_page(html_path, report)
        if not as_json:
            click.echo(f"chunk map: {html_path}")
    if report.verdict == NO_VERDICT and not report.identity:
        assert report.rules is not None
        raise RulesUncoveredError(no_verdict_error(report.rules))
    if report.verdict == NO_VERDICT:  # engines that hash differently: judged before keys
        return EXIT_MISMATCH
    if report.verdict != "mismatch" and agree_refused(report.rules):
        assert report.rules is not None
        raise RulesDisputedError(
            f"no AGREE: the oracle disagreed with keytrace's rules on the vLLM code that "
            f"recorded this trace (rules digest {report.rules.digest}); see docs/diff.md, "
            "Rules verified by the oracle"
        )
    # a mismatched episode, engines that share a tier and hash differently, or tokens a
    # shared tier held that an engine did not read (`DiffReport.verdict`)
    return EXIT_MISMATCH if report.verdict == "mismatch" else EXIT_OK


def _runner(jobs: int, ray_address: str | None) -> Runner:
    if ray_address is None:
        return LocalRunner(jobs)
    return RayRunner(ray_address or None)


def _trace_after_ray(
    paths: tuple[str, ...], ray_address: str | None
) -> tuple[tuple[str, ...], str | None]:
    """``--ray`` takes an optional ADDRESS, so ``--ray TRACE`` hands the trace to it: a
    value that exists here, or has a slash and is not a ``ray://`` address, is a trace
    (Ray's addresses are ``auto``, ``local``, ``host:port`` or ``ray://host:port``)."""
    if not ray_address or ray_address.startswith("ray://"):
        return paths, ray_address
    if "/" in ray_address or os.path.exists(ray_address):
        return (ray_address, *paths), ""
    return paths, ray_address
