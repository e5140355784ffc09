"""`keytrace minimize`: shrink a recorded mismatch while its binding group and cause persist."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import click

from keytrace.cli._common import (
    OutputPath,
    allow_incomplete_option,
    check_complete,
    echo_trace_warnings,
    json_option,
    progress_option,
    subcommand,
    trace_paths,
)
from keytrace.cli._progress import progress_printer
from keytrace.errors import EXIT_MISMATCH


@subcommand("minimize")
@trace_paths
@click.option("--request", default=None, help="The mismatching request [default: the first].")
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    default="keytrace-minimal",
    show_default=True,
    help="Folder for the minimal case's trace (minimal-trace/) and minimal.json.",
)
@json_option
@allow_incomplete_option
@progress_option
def command(
    paths: tuple[str, ...],
    request: str | None,
    out_dir: str,
    as_json: bool,
    allow_incomplete: bool,
    progress: bool | None,
) -> int:
    """Shrink a recorded mismatch to the smallest geometry and prompt lengths that keep it.

    The trace's first mismatch (or --request's) is replayed on the installed vLLM's real
    scheduler and shrunk step by step (drop sliding-window groups, shorten the prompts by
    whole alignment units keeping P mod A, halve blocks and windows, halve the step budget)
    as long as the replay is still a mismatch with a binding group of the same kind and
    EAGLE/MTP flag and the same cause. The minimal case's trace is written under OUT.

    \b
    Exit status: 1 (the mismatch, minimal case printed), 2 trouble (not a mismatch, ...).
    """
    from keytrace.analysis.plan import plan_from_trace
    from keytrace.format.reader import open_trace
    from keytrace.vllm.lab.minimize import check_minimizable, minimize

    trace = open_trace(list(paths))
    echo_trace_warnings(trace, allow_incomplete=allow_incomplete)
    check_complete(trace, allow_incomplete)
    plan = plan_from_trace(trace, request=request)  # no vLLM yet: `minimize` loads it
    check_minimizable(plan)
    show = progress if progress is not None else (sys.stderr.isatty() and not as_json)
    os.makedirs(out_dir, exist_ok=True)
    res = minimize(
        plan,
        trace_dir=os.path.join(out_dir, "minimal-trace"),
        progress=progress_printer() if show else None,
    )
    doc = {
        "start": res.start.describe(),
        "minimal": res.result.describe(),
        "geometry": dataclasses.asdict(res.result.geometry),
        "primes": list(res.result.primes),
        "episode": res.result.episode,
        "signature": {
            "kind": res.signature[0],
            "eagle": res.signature[1],
            "cause": res.signature[2],
        },
        "verdict": res.verdict,
        "steps": res.steps,
        "replays": res.replays,
        "trace": os.path.join(out_dir, "minimal-trace"),
    }
    with open(os.path.join(out_dir, "minimal.json"), "w") as fh:
        json.dump(doc, fh, indent=2)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return EXIT_MISMATCH
    v = res.verdict
    click.echo(f"from:    {doc['start']}")
    click.echo(f"minimal: {doc['minimal']}")
    click.echo(
        f"  E={v['E']:,}, external {v['external_tokens']:,}; binding group {v['binding_group']}, "
        f"terminal chunk {v['terminal_chunk']}: {v['cause']}"
    )
    click.echo(f"  {len(res.steps)} steps in {res.replays} replays: {'; '.join(res.steps) or '-'}")
    click.echo(f"  trace: {doc['trace']}   (next: keytrace fixture {doc['trace']})")
    return EXIT_MISMATCH
