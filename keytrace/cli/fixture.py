"""`keytrace fixture`: turn a recorded episode into a deterministic pytest regression."""

from __future__ import annotations

import os

import click

from keytrace.analysis.plan import plan_from_trace
from keytrace.cli._common import echo_trace_warnings, output_refusal, subcommand, trace_paths
from keytrace.errors import UsageError
from keytrace.format.reader import open_trace
from keytrace.judge.definitions import FINDINGS
from keytrace.report.fixture import file_name, render_fixture


def _is_folder(out: str) -> bool:
    return os.path.isdir(out) or out.endswith("/")


def _checked_out(ctx: click.Context, param: click.Parameter, out: str) -> str:
    """``-o``: a folder (new, in an existing folder) or a new ``.py`` file in an existing
    folder; anything else is refused before the trace is read."""
    refused = output_refusal(out, folder=_is_folder(out))
    if refused is None and not _is_folder(out) and not out.endswith(".py"):
        refused = f"{out} is not a .py file: pytest would not collect it"
    if refused:
        raise click.BadParameter(refused, ctx, param)
    return out


def _collected(name: str) -> bool:
    """pytest's default ``python_files``: ``test_*.py`` and ``*_test.py``."""
    return name.startswith("test_") or name.endswith("_test.py")


@subcommand("fixture")
@trace_paths
@click.option(
    "-o",
    "--out",
    "out",
    required=True,
    callback=_checked_out,
    help="A .py file (test_*.py or *_test.py for pytest to collect it), or a folder for a "
    "content-named file.",
)
@click.option(
    "--request", default=None, help="This request's last episode [default: the first mismatch]."
)
@click.option(
    "--xfail",
    "xfail_reason",
    default=None,
    help="Mark it xfail(strict=True) with this reason (a known upstream bug).",
)
@click.option("--note", default="", help="Evidence to add to the test's docstring.")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def command(
    paths: tuple[str, ...],
    out: str,
    request: str | None,
    xfail_reason: str | None,
    note: str,
    force: bool,
) -> int:
    """Write a pytest file that replays the episode on the real vLLM scheduler (CPU) and
    asserts the offload hit reaches the recorded expected boundary E with no mismatch.

    The file holds literal geometry, prompt lengths and step budget: no hashes, no token
    ids, no pointer to the trace. It is red while the bug is there and green once fixed;
    its failure message names the binding group, terminal chunk and cause. The store and
    lookup rows are enough (`keytrace fixture store.parquet lookup.parquet`); step rows are
    not needed.
    """
    trace = open_trace(list(paths))
    echo_trace_warnings(trace)
    plan = plan_from_trace(trace, request=request)
    try:
        text = render_fixture(plan, xfail_reason=xfail_reason, docstring_extra=note)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    path = os.path.join(out, file_name(plan, text)) if _is_folder(out) else out
    if os.path.exists(path) and not force:
        raise UsageError(f"{path}: already exists; pass --force to overwrite")
    if plan.recorded_verdict not in FINDINGS:
        click.echo(
            f"keytrace: note: the test is for request {plan.request}'s {plan.recorded_verdict} "
            "episode, not a mismatch: green today, red if vLLM stops reaching E",
            err=True,
        )
    if not _collected(os.path.basename(path)):
        click.echo(
            f"keytrace: warning: pytest collects test_*.py and *_test.py by default, not "
            f"{os.path.basename(path)}: rename it or list it in python_files",
            err=True,
        )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
    click.echo(path)
    return 0
