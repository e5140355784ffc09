"""`keytrace demo`: the whole loop on the real vLLM scheduler, on a CPU, in about a minute."""

from __future__ import annotations

import os
import sys
import tempfile

import click

from keytrace.cli._common import OutputPath, subcommand
from keytrace.judge.rules import groups_from_header
from keytrace.report.text import render_diff


@subcommand("demo")
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    default=None,
    help="A new folder for everything [default: a temporary folder].",
)
def command(out_dir: str | None) -> int:
    """Record, diff, regress and sweep on a DeepSeek-V4-like geometry with an MTP group,
    through the installed vLLM's real scheduler, OffloadingConnector and
    CPUOffloadingManager (no GPU, no model download):

    \b
    1. 18,877 tokens with the store rule vLLM PR #48911 replaced (injected), and stock:
       keytrace names the injected bug and agrees on stock.
    2. 17,975 tokens on stock vLLM: the upstream case that still misses.
    3. A pytest regression for the injected case (red with the bug, green without).
    4. A sweep of stock vLLM around 17,975, as a table and a plot.
    """
    from keytrace.vllm.lab.demo import run_demo

    out = out_dir or tempfile.mkdtemp(prefix="keytrace-demo-")
    res = run_demo(out, log=lambda s: click.echo(f"keytrace: {s}", err=True))
    for run in res.runs:
        click.echo(
            f"\n== {run.label}: {run.num_tokens:,} tokens -> {run.external_tokens:,} external tokens"
        )
        render_diff(run.report, sys.stdout)
    bad = [r for r in res.sweep if r.verdict == "mismatch"]
    labels = {g.gid: f"{g.gid} ({g.label})" for g in groups_from_header(res.runs[-1].report.header)}
    where = ", ".join(
        labels[g] for g in sorted({r.binding_group for r in bad if r.binding_group is not None})
    )
    causes = ", ".join(sorted({r.cause or "?" for r in bad}))
    click.echo(
        f"\n== sweep of stock vLLM: {len(bad)} of {len(res.sweep)} lengths mismatch"
        + (f", binding group {where}, cause {causes}" if bad else "")
    )
    click.echo(f"\nwritten in {res.seconds:.0f}s under {out}:")
    for run in res.runs:
        click.echo(
            f"  trace       {os.path.relpath(run.trace_dir, out)}/   ({run.label}, {run.num_tokens:,} tokens)"
        )
    injected = next((r.inject for r in res.runs if r.inject), None)
    click.echo(
        f"  regression  {os.path.relpath(res.fixture or '', out)}   (green on stock vLLM; "
        f"red with the bug: KEYTRACE_INJECT={injected} python -m pytest {res.fixture})"
    )
    if res.html:
        click.echo(f"  chunk map   {os.path.relpath(res.html, out)}   (open it in a browser)")
    click.echo(f"  sweep       {os.path.relpath(res.sweep_table or '', out)}")
    for p in res.plots:
        click.echo(f"  plot        {os.path.relpath(p, out)}")
    click.echo(f"\nnext: keytrace diff {res.runs[2].trace_dir} --all")
    click.echo(
        f"      keytrace report {res.runs[2].trace_dir} -o report --fix eagle_proof_key"
        "   (an upstream-ready report, with a candidate fix measured)"
    )
    return 0
