"""`keytrace sweep`: which prompt lengths miss, through the real vLLM scheduler on a CPU."""

from __future__ import annotations

import sys

import click

from keytrace.analysis.geometry import (
    BUILTIN,
    builtin,
    dcp_refusal,
    geometry_from_header,
    parse_drafter,
    parse_retention,
    retention_text,
)
from keytrace.analysis.sweep import SweepRow, compare_fix, parse_lengths
from keytrace.cli._common import (
    OutputPath,
    dcp_option,
    drafter_option,
    exit_for_verdicts,
    fix_option,
    inject_option,
    plain_progress_option,
    retention_option,
    subcommand,
)
from keytrace.cli._progress import progress_printer
from keytrace.errors import UsageError
from keytrace.report.table import write_rows
from keytrace.report.text import sweep_line


def _table(rows: list[SweepRow], stock: list[SweepRow] | None = None) -> None:
    """The sweep's table; with ``stock`` (a --compare run) stock vLLM's outcome as a column."""
    extra = f" {'stock':>16}" if stock is not None else ""
    click.echo(
        f"{'length':>8} {'budget':>7} {'bpc':>3} {'E':>8} {'external':>9} {'verdict':<10}"
        f"{extra} {'group':>5} {'chunk':>7}  cause"
    )
    before = {r.length: r for r in stock or ()}
    for r in rows:
        e = "-" if r.E is None else f"{r.E:,}"
        g = "" if r.binding_group is None else str(r.binding_group)
        c = "" if r.terminal_chunk is None else f"{r.terminal_chunk:,}"
        was = before.get(r.length)
        col = f" {f'{was.external:,} {was.verdict}':>16}" if was is not None else extra
        click.echo(
            f"{r.length:>8,} {r.budget:>7,} {r.blocks_per_chunk:>3} {e:>8} {r.external:>9,} "
            f"{r.verdict:<10}{col} {g:>5} {c:>7}  {r.cause or ''}"
        )


@subcommand("sweep")
@click.option(
    "--lengths", required=True, help="START:STOP[:STEP] (stop inclusive), a comma list, or both."
)
@click.option(
    "--geometry",
    "geometry_name",
    default="dsv4",
    show_default=True,
    type=click.Choice(sorted(BUILTIN)),
    help="Built-in geometry: dsv4 (DeepSeek-V4-like, MTP), small, hybrid (no MTP group), "
    "recurrent (Qwen3-Next-like: recurrent state groups and full attention), recurrent_mtp "
    "(the same with its MTP drafter: judged on vLLM 0.34.0, not on 0.33.0), nemotron_h "
    "(Nemotron-H-like: Mamba2 groups whose prompt's last state is exported from inside a "
    "prefill chunk, and full attention), dsv3 "
    "(DeepSeek-V3-like: MLA and its MTP group, no sliding window: for --dcp), dsv3_mla "
    "(the same served without MTP: one MLA group).",
)
@click.option(
    "--from", "from_trace", default=None, help="Take the geometry from this trace's header instead."
)
@click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=None,
    help="max_num_batched_tokens (tokens per step).",
)
@click.option(
    "--prefix-match-unit",
    type=click.IntRange(min=1),
    default=None,
    help="vLLM's --prefix-match-unit: hash every N tokens (finer than a recurrent group's "
    "block: partial tails on).",
)
@retention_option("vLLM's prefix_cache_retention_interval [default: the geometry's, 0].")
@click.option(
    "--prime-length",
    type=click.IntRange(min=1),
    default=None,
    help="Prime every length with a prompt of this many tokens that shares its prefix "
    "[default: the length itself, an identical resend]. Longer than a length, the resend "
    "is a prefix of the prime: it can hit only where the prime's store kept tails below its "
    "own boundary (a retention interval's).",
)
@click.option(
    "--blocks-per-chunk",
    type=click.IntRange(min=1),
    default=None,
    help="Offload chunk size in blocks.",
)
@drafter_option("Run a speculative drafter ('none': drop the one a --from trace names).")
@dcp_option("Decode context parallel size (default: the geometry's, 1).")
@inject_option("Reintroduce a historical store-side bug (testing keytrace itself).")
@fix_option(
    "Apply a candidate fix to vLLM's offload path first (does it close every failing "
    "length without a new mismatch?)."
)
@click.option(
    "--compare",
    is_flag=True,
    help="With --fix: also sweep stock vLLM and say how many failing lengths the fix closes "
    "and whether it adds a mismatch (twice the time).",
)
@click.option("--csv", "csv_path", type=OutputPath(), help="Also write the table as CSV.")
@click.option(
    "--parquet", "parquet_path", type=OutputPath(), help="Also write the table as Parquet."
)
@click.option(
    "--plot",
    "plot_prefix",
    type=OutputPath(),
    help="Write PREFIX.png and PREFIX.svg (needs the plot extra).",
)
@click.option(
    "--quiet", is_flag=True, help="No table on stdout, only its one summary line (files only)."
)
@plain_progress_option
def command(
    lengths: str,
    geometry_name: str,
    from_trace: str | None,
    budget: int | None,
    prefix_match_unit: int | None,
    retention_interval: str | None,
    prime_length: int | None,
    blocks_per_chunk: int | None,
    drafter: str | None,
    dcp: int | None,
    inject: str | None,
    fix: str | None,
    compare: bool,
    csv_path: str | None,
    parquet_path: str | None,
    plot_prefix: str | None,
    quiet: bool,
    progress: bool | None,
) -> int:
    """Record prime -> GPU-only reset -> identical resend at every length and diff it
    (--prime-length: a prime of that length sharing the prefix instead).

    Each length runs on a fresh real scheduler of the installed vLLM (CPU, about 0.3 s a
    length on dsv4). The table gives, per length: the expected boundary E, the external
    tokens vLLM returned, the verdict, and for a shortfall the binding group, terminal chunk
    and cause; one line after it counts the lengths that mismatch.

    \b
    Example: keytrace sweep --lengths 17900:18200 --plot sweep
    Exit status: 0 no mismatch, 1 some length mismatched, 2 trouble (or no verdict: a
    geometry the rules do not describe).
    """
    if compare and not fix:
        raise UsageError("--compare needs --fix NAME (it compares the fix with stock vLLM)")
    try:
        todo = parse_lengths(lengths)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if from_trace:
        from keytrace.format.reader import open_trace

        try:
            geo = geometry_from_header(open_trace(from_trace).header)
        except ValueError as exc:
            raise UsageError(f"--from {from_trace}: {exc}") from exc
    else:
        geo = builtin(geometry_name)
    changes: dict[str, object] = {}
    if budget is not None:
        changes["max_num_batched_tokens"] = budget
    if retention_interval is not None:
        changes["retention_interval"] = parse_retention(retention_interval)
    if prefix_match_unit is not None:
        changes["prefix_match_unit"] = prefix_match_unit
    if blocks_per_chunk is not None:
        changes["blocks_per_chunk"] = blocks_per_chunk
    if drafter is not None:
        changes["drafter"] = parse_drafter(drafter)
    if dcp is not None:
        changes["dcp"] = dcp
    longest = max(*todo, prime_length or 0)
    if longest > geo.max_model_len:  # a server refuses the prompt: no verdict to give on it
        raise UsageError(
            f"length {longest:,} is over the max_model_len of geometry {geo.name} "
            f"({geo.max_model_len:,}): vLLM refuses such a prompt"
        )
    if longest + 64 > geo.max_model_len:
        changes["max_model_len"] = longest + 1024
    changes["num_gpu_blocks"] = None  # sized per length
    geo = geo.with_(**changes)
    refused = dcp_refusal(geo)
    if refused:
        raise UsageError(refused)
    show = progress if progress is not None else sys.stderr.isatty()
    from keytrace.vllm.lab.sweep import run_sweep

    stock = (
        run_sweep(
            geo,
            todo,
            inject=inject,
            prime_length=prime_length,
            progress=progress_printer() if show else None,
        )
        if compare
        else None
    )
    rows = run_sweep(
        geo,
        todo,
        inject=inject,
        fix=fix,
        prime_length=prime_length,
        progress=progress_printer() if show else None,
    )
    for note in dict.fromkeys(r.rules_note for r in rows if r.rules_note):
        click.echo(note)  # as diff's first line: the verdicts below on unverified rules
    if not quiet:
        _table(rows, stock)
    click.echo(sweep_line(rows))  # with --quiet too: what the exit status means, in words
    write_rows(rows, csv_path=csv_path, parquet_path=parquet_path)
    if stock is not None and fix:
        click.echo(compare_fix(stock, rows, fix).text())
    if plot_prefix:
        from keytrace.report.plot import plot_sweep

        bad = sum(r.verdict == "mismatch" for r in rows)
        where = (
            f"{geo.name}: budget {geo.max_num_batched_tokens:,}, blocks_per_chunk {geo.blocks_per_chunk}"
            f"{', drafter ' + geo.drafter.spec if geo.drafter else ''}"
            f"{f', dcp {geo.dcp}' if geo.dcp > 1 else ''}"
            f"{', retention ' + retention_text(geo.retention_interval) if geo.retention_interval != 0 else ''}"
            f"{f', prime {prime_length:,}' if prime_length else ''}"
            f"{', inject ' + inject if inject else ''}"
        )
        paths = [plot_prefix + ".png", plot_prefix + ".svg"]
        if stock is not None and fix:  # stock as the series, the fix drawn over it
            was = sum(r.verdict == "mismatch" for r in stock)
            title = f"{where}: {was} of {len(rows)} lengths mismatch; with fix {fix}: {bad}"
            made = plot_sweep(stock, paths, title=title, fixed=(fix, rows))
        else:
            title = f"{where}{', fix ' + fix if fix else ''}: {bad} of {len(rows)} lengths mismatch"
            made = plot_sweep(rows, paths, title=title)
        for p in made:
            click.echo(f"plot: {p}", err=True)
    return exit_for_verdicts([r.verdict for r in rows], f"geometry {geo.name}")
