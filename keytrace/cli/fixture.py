"""`keytrace fixture`: turn a recorded episode into a deterministic pytest regression."""

from __future__ import annotations

import os

import click

from keytrace.analysis.plan import plan_from_trace
from keytrace.cli._common import echo_trace_warnings, subcommand, trace_paths
from keytrace.errors import UsageError
from keytrace.format.reader import open_trace
from keytrace.report.fixture import file_name, render_fixture


@subcommand("fixture")
@trace_paths
@click.option(
    "-o", "--out", "out", required=True, help="A .py file, or a folder for a content-named file."
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
    path = (
        os.path.join(out, file_name(plan, text)) if os.path.isdir(out) or out.endswith("/") else out
    )
    if os.path.exists(path) and not force:
        raise UsageError(f"{path}: already exists; pass --force to overwrite")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
    click.echo(path)
    return 0
