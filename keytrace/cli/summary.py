"""`keytrace summary`: what a trace holds, per KV-cache group."""

from __future__ import annotations

import sys

import click

from keytrace.analysis.summary import summarize
from keytrace.cli._common import echo_trace_warnings, json_option, subcommand, trace_paths
from keytrace.format.reader import open_trace
from keytrace.report.jsonout import write_json
from keytrace.report.text import render_summary


@subcommand("summary")
@trace_paths
@json_option
@click.option(
    "--episodes",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="How many episodes to list.",
)
def command(paths: tuple[str, ...], as_json: bool, episodes: int) -> int:
    """Count stored, offered and looked-up keys per group, and list the first episodes.

    TRACE is any mix of part files, trace directories and quoted globs.
    """
    trace = open_trace(list(paths))
    echo_trace_warnings(trace)
    s = summarize(trace, max_episodes=episodes)
    if as_json:
        write_json(s, sys.stdout)
    else:
        render_summary(s, sys.stdout)
    return 0
