"""`keytrace replay`: rerun a recorded episode on the real vLLM scheduler (CPU)."""

from __future__ import annotations

import sys

import click

from keytrace.cli._common import (
    OutputPath,
    allow_incomplete_option,
    check_complete,
    echo_trace_warnings,
    exit_for_verdicts,
    json_option,
    subcommand,
    trace_paths,
)
from keytrace.format.reader import open_trace
from keytrace.report.jsonout import write_json


@subcommand("replay")
@trace_paths
@click.option(
    "--request",
    default=None,
    help="Replay this request's last episode [default: the first mismatch].",
)
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    default=None,
    help="Keep the replay's own trace here [default: a temporary folder].",
)
@json_option
@allow_incomplete_option
def command(
    paths: tuple[str, ...],
    request: str | None,
    out_dir: str | None,
    as_json: bool,
    allow_incomplete: bool,
) -> int:
    """Rebuild the geometry from the trace header and replay one episode on the installed
    vLLM's real scheduler: the requests that stored its chain (cold, stores acknowledged),
    a GPU-prefix-cache-only reset, then the episode's request at identical lengths with
    synthetic token ids. The replay is recorded and diffed; its step schedule is compared
    with the recorded one when the trace has step rows (`keytrace compact` writes them to
    step.parquet: pass it with store.parquet and lookup.parquet to compare schedules).

    \b
    Exit status: 0 the replay agrees (no mismatch), 1 the mismatch reproduces, 2 trouble
    (header lacks what replay needs, vLLM missing or a different version, or no verdict:
    a geometry the rules do not describe).
    """
    trace = open_trace(list(paths))
    echo_trace_warnings(trace, allow_incomplete=allow_incomplete)
    check_complete(trace, allow_incomplete)
    from keytrace.vllm.lab.replay import replay_trace

    out = replay_trace(trace, request=request, out_dir=out_dir)
    for note in out.notes:
        click.echo(f"keytrace: note: {note}", err=True)
    plan, result = out.plan, out.result
    if as_json:
        write_json({"plan": plan, "replay": result, "steps_match": out.steps_match}, sys.stdout)
    else:
        click.echo(
            f"replaying request {plan.request}: primes {plan.prime_lengths or 'none'} then "
            f"{plan.episode_length:,} tokens, budget {plan.geometry['max_num_batched_tokens']:,} "
            f"tokens/step"
        )
        rec = "deferred" if plan.recorded_external is None else f"{plan.recorded_external:,}"
        click.echo(f"recorded: external {rec}, verdict {plan.recorded_verdict}")
        click.echo(f"replayed: {result.explain()}")
        if out.steps_match is None:
            click.echo("step schedule: not compared (no step rows in the trace)")
        elif out.steps_match:
            click.echo("step schedule: identical to the recorded one")
        else:
            click.echo(
                f"step schedule DIFFERS: recorded {plan.recorded_steps}, replayed {result.steps}"
            )
    return exit_for_verdicts([result.verdict], "the replayed geometry")
