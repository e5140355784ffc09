"""`keytrace compact`: one Parquet file per row kind, header kept."""

from __future__ import annotations

import os

import click

from keytrace.cli._common import OutputPath, subcommand


@subcommand("compact")
@click.argument("trace_dir", type=str)
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    default=None,
    help="Output folder [default: TRACE_DIR-compact].",
)
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
def command(trace_dir: str, out_dir: str | None, force: bool) -> int:
    """Merge TRACE_DIR's parts into OUT/store.parquet, OUT/lookup.parquet, ...

    The output sits beside the trace by default, so re-reading TRACE_DIR never counts a
    row twice. `keytrace diff OUT/store.parquet OUT/lookup.parquet` then works as usual.
    """
    from keytrace.format.compact import compact  # the writer stack: not on every command's path

    out = out_dir or (trace_dir.rstrip("/") + "-compact")
    result = compact([trace_dir], out, force=force)
    for w in result.warnings:  # unreadable parts, gaps, a last flush set aside
        click.echo(f"keytrace: warning: {w}", err=True)
    for kind, path in result.files.items():
        click.echo(f"{kind:8} {result.rows[kind]:>12,} rows -> {os.path.relpath(path)}")
    return 0
