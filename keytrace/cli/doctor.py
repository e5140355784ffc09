"""`keytrace doctor`: what works with the vLLM installed here, and why not."""

from __future__ import annotations

import sys

import click

from keytrace.cli._common import json_option, subcommand
from keytrace.errors import EXIT_OK, EXIT_TROUBLE
from keytrace.report.jsonout import write_json
from keytrace.report.text import render_doctor


@subcommand("doctor")
@json_option
@click.option("--checks", is_flag=True, help="List every check behind each capability.")
def command(as_json: bool, checks: bool) -> int:
    """Check this environment: the installed vLLM (version, path, source build or release),
    each hook point keytrace needs, and what works: recording, the live alarm, metrics,
    the CPU lab (demo, replay, sweep, ...) and each injection and candidate fix, with the
    failed check for what does not. Also the Python, torch, pyarrow and polars versions.

    keytrace decides by the installed code, not the version string: a source build of
    main records when its offloading code passes every check. vLLM is only inspected,
    never patched.

    Exit 0 when recording would work, 2 otherwise.
    """
    from keytrace.vllm.lab.doctor import diagnose

    found = diagnose().as_json()
    if as_json:
        write_json(found, sys.stdout)
    else:
        render_doctor(found, sys.stdout, checks=checks)
    return EXIT_OK if found["can_record"] else EXIT_TROUBLE
