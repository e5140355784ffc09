"""`keytrace header`: print the geometry/config header a trace was recorded with."""

from __future__ import annotations

import sys

from keytrace.cli._common import echo_trace_warnings, json_option, subcommand, trace_paths
from keytrace.format.reader import open_trace
from keytrace.report.jsonout import write_json
from keytrace.report.text import render_header


@subcommand("header")
@trace_paths
@json_option
def command(paths: tuple[str, ...], as_json: bool) -> int:
    """Print the header: per-group geometry, chunking, CPU tier and scheduler settings."""
    trace = open_trace(list(paths))
    echo_trace_warnings(trace)
    if as_json:
        write_json(trace.header, sys.stdout)
    else:
        render_header(trace.header, sys.stdout)
    return 0
