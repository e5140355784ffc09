"""`keytrace demo`: record a built-in scenario through the real vLLM scheduler and diff it."""

from __future__ import annotations

import sys
import tempfile

import click

from keytrace.render import render_diff, render_summary


@click.command("demo")
@click.option(
    "--out",
    "out_dir",
    default=None,
    help="Folder for the traces [default: a new temporary folder].",
)
@click.option("--geometry", default="dsv4", show_default=True, type=click.Choice(["dsv4", "small"]))
@click.option(
    "--tokens",
    "num_tokens",
    default=17_975,
    show_default=True,
    help="Prompt length to prime and resend.",
)
def command(out_dir: str | None, geometry: str, num_tokens: int) -> int:
    """Record prime -> GPU-only reset -> identical resend on the real vLLM scheduler (CPU, no
    GPU, no model download), then summarise and diff the trace.

    The default, 17,975 tokens on a DeepSeek-V4-like geometry with an MTP group, is the
    upstream case that missed after a fix; on vLLM 0.33.0 it still misses.
    """
    from keytrace.demo import run_demo

    out = out_dir or tempfile.mkdtemp(prefix="keytrace-demo-")
    runs = run_demo(
        out, geometry=geometry, num_tokens=num_tokens, log=lambda s: click.echo(s, err=True)
    )
    for run in runs:
        click.echo(
            f"== {run.label}: {run.num_tokens:,} tokens -> {run.external_tokens:,} external tokens "
            f"({run.seconds:.1f}s); trace in {run.trace_dir}"
        )
        render_summary(run.summary, sys.stdout)
        click.echo("")
        render_diff(run.report, sys.stdout)
        click.echo(f"\nnext: keytrace diff {run.trace_dir} --all")
    return 0
