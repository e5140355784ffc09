"""`keytrace fuzz`: property-based search for store/lookup mismatches over hybrid geometries."""

from __future__ import annotations

import os
import sys

import click

from keytrace.cli._common import (
    OutputPath,
    drafter_option,
    fix_option,
    inject_option,
    json_option,
    progress_option,
    subcommand,
)
from keytrace.cli._progress import progress_printer
from keytrace.errors import EXIT_MISMATCH, EXIT_OK, UsageError, install_hint


@subcommand("fuzz")
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    default="keytrace-fuzz",
    show_default=True,
    help="Folder for fuzz.json, the minimal case's trace and the Hypothesis database.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Hypothesis seed.")
@click.option(
    "--max-examples",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Cases to try before giving up (shrinking a failure comes on top).",
)
@click.option(
    "--budget",
    "budget_seconds",
    type=click.FloatRange(min=1),
    default=None,
    help="Stop drawing new cases after this many seconds.",
)
@click.option(
    "--aligned-windows",
    is_flag=True,
    help="Only sliding windows that are whole blocks (skip the k*block+1 window class).",
)
@click.option(
    "--recurrent",
    is_flag=True,
    help="Draw recurrent hybrids instead: a full-attention group and 1-3 recurrent "
    "(Mamba) groups, with or without prefill checkpoints, partial tails (a hash unit below "
    "the block) and decode context parallelism 2; no drafter.",
)
@drafter_option(
    "Run each case with a speculative drafter, drawn from those given (repeat the option; "
    "'none' for no drafter; shrinking prefers the first given). Default: none.",
    multiple=True,
)
@inject_option("Reintroduce a historical store-side bug first.")
@fix_option("Apply a candidate fix first.")
@json_option
@progress_option
def command(
    out_dir: str,
    seed: int,
    max_examples: int,
    budget_seconds: float | None,
    aligned_windows: bool,
    recurrent: bool,
    drafters: tuple[str, ...],
    inject: str | None,
    fix: str | None,
    as_json: bool,
    progress: bool | None,
) -> int:
    """Search hybrid geometries and traffic for a store/lookup mismatch, on the real scheduler.

    Hypothesis draws a geometry (a full-attention group and 1-3 sliding-window groups, at
    most one EAGLE/MTP; block sizes, windows, blocks per chunk, step budget) and a traffic
    shape (identical resend after a GPU-only reset, or the next turn), and, with
    --drafter, a speculative drafter (vLLM 0.34.0 then hashes each block over the next
    tokens), records it through the installed vLLM's real scheduler and diffs it (with
    --recurrent: recurrent hybrids instead). The first mismatch is shrunk to a minimal
    case (fewest groups, smallest blocks and lengths), whose trace is kept under
    OUT/minimal-trace for `keytrace diff`, `fixture` and `replay`. Reruns with the same
    OUT start from the examples it found.

    \b
    Example: keytrace fuzz --seed 1 --max-examples 200 --aligned-windows
             keytrace fuzz --drafter none --drafter eagle --drafter mtp:2:3
             keytrace fuzz --recurrent --max-examples 50
    Exit status: 0 no mismatch found, 1 a mismatch (minimal case printed), 2 trouble.
    """
    if recurrent and drafters and set(drafters) != {"none"}:
        raise UsageError("--recurrent draws recurrent hybrids without a drafter: drop --drafter")
    try:
        import hypothesis  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"keytrace fuzz needs Hypothesis: {install_hint('fuzz')}") from exc
    from keytrace.analysis.geometry import parse_drafter
    from keytrace.vllm import require_vllm
    from keytrace.vllm.lab.fuzz import fuzz

    require_vllm()
    show = progress if progress is not None else (sys.stderr.isatty() and not as_json)
    res = fuzz(
        out_dir,
        seed=seed,
        max_examples=max_examples,
        budget_seconds=budget_seconds,
        inject=inject,
        fix=fix,
        aligned_windows=aligned_windows,
        drafters=tuple(parse_drafter(d) for d in drafters) or (None,),
        recurrent=recurrent,
        progress=progress_printer() if show else None,
    )
    if as_json:
        with open(os.path.join(out_dir, "fuzz.json")) as fh:
            click.echo(fh.read().rstrip())
        return EXIT_MISMATCH if res.failure else EXIT_OK
    rate = f"{res.cases} cases in {res.seconds:.0f}s ({res.cases_per_second:.2f}/s)"
    if res.rejected:
        rate += f"; {res.rejected} refused by vLLM (first: {res.first_rejection})"
    if res.stopped_by_budget:
        rate += "; stopped by --budget"
    if res.failure is None:
        click.echo(f"no mismatch: {rate}")
        return EXIT_OK
    v = res.verdict
    click.echo(f"MISMATCH, shrunk to: {res.failure.describe()}")
    click.echo(
        f"  E={v['E']:,}, external {v['external_tokens']:,}; binding group {v['binding_group']}, "
        f"terminal chunk {v['terminal_chunk']}: {v['cause']}"
    )
    click.echo(f"  trace: {os.path.join(out_dir, 'minimal-trace')}   ({rate})")
    click.echo(f"  next: keytrace diff {os.path.join(out_dir, 'minimal-trace')}")
    return EXIT_MISMATCH
