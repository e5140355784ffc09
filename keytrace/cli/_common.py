"""Options and helpers shared by several commands."""

from __future__ import annotations

import click

from keytrace.format.reader import Trace

trace_paths = click.argument("paths", nargs=-1, required=True, metavar="TRACE...")
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout."
)


def echo_trace_warnings(trace: Trace) -> None:
    """Warnings and notes from reading go to stderr, one line each."""
    for w in trace.warnings:
        click.echo(f"keytrace: warning: {w}", err=True)
    for n in trace.notes:
        click.echo(f"keytrace: note: {n}", err=True)
