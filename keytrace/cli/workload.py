"""`keytrace workload`: record realistic traffic through the real vLLM scheduler, then diff it."""

from __future__ import annotations

import sys
import tempfile

import click

from keytrace.cli._common import (
    OutputPath,
    dcp_option,
    drafter_option,
    fix_option,
    inject_option,
    plain_progress_option,
    retention_option,
    subcommand,
)
from keytrace.cli._progress import progress_printer
from keytrace.errors import EXIT_MISMATCH, EXIT_OK, KeytraceError, UsageError


def _range(text: str, kind: type, least: int = 0) -> tuple:  # type: ignore[type-arg]
    try:
        lo, hi = (kind(x) for x in text.split(":"))
    except ValueError:
        raise UsageError(f"bad range {text!r}: use LOW:HIGH") from None
    if hi < lo:
        raise UsageError(f"bad range {text!r}: LOW must not exceed HIGH")
    if lo < least:
        raise UsageError(f"bad range {text!r}: LOW must be at least {least}")
    return lo, hi


def _tiers(text: str) -> tuple[str, ...]:
    # the geometry's list, not the harness's: the harness imports torch, and an option's
    # callback runs before the command can say that vLLM is missing
    from keytrace.analysis.geometry import REPLAYABLE_TIERS as TIER_TYPES

    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in TIER_TYPES]
    if unknown:
        raise UsageError(f"unknown tier {unknown[0]!r}; known: {', '.join(TIER_TYPES)}")
    return names


@subcommand("workload")
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputPath(folder=True),
    help="Trace folder [default: a new temporary one].",
)
@click.option(
    "--geometry",
    default="dsv4",
    show_default=True,
    type=click.Choice(
        [
            "dsv4",
            "small",
            "hybrid",
            "dsv3",
            "dsv3_mla",
            "recurrent",
            "recurrent_mtp",
            "nemotron_h",
        ]
    ),
    help="Built-in geometry ('hybrid': no MTP group, where stock vLLM's rules agree; "
    "'dsv3', 'dsv3_mla' (MLA without the MTP group) and 'recurrent': no sliding window, "
    "for --dcp).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seeds every draw: same seed, same traffic.",
)
@click.option(
    "--conversations",
    type=click.IntRange(min=1),
    default=24,
    show_default=True,
    help="Conversations, each of --turns turns.",
)
@click.option("--turns", default="2:4", show_default=True, help="Turns per conversation, LOW:HIGH.")
@click.option(
    "--system-prompts",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Shared across conversations.",
)
@click.option(
    "--system-chunks",
    default="2:8",
    show_default=True,
    help="System prompt length, in full-attention chunks.",
)
@click.option(
    "--message-chunks",
    default="0.3:6",
    show_default=True,
    help="New message length per turn, in chunks.",
)
@click.option(
    "--output-tokens", default="1:24", show_default=True, help="Tokens generated per turn."
)
@click.option(
    "--arrival-steps",
    type=click.IntRange(min=0),
    default=40,
    show_default=True,
    help="Conversations start spread over this many steps.",
)
@click.option(
    "--think-steps",
    default="5:40",
    show_default=True,
    help="Steps between a reply and the next turn, LOW:HIGH.",
)
@click.option(
    "--resend-rate",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Chance a turn is resent identically.",
)
@click.option(
    "--engines",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Data-parallel engines (one CPU tier each).",
)
@click.option(
    "--reroute-rate",
    type=click.FloatRange(0, 1),
    default=0.25,
    show_default=True,
    help="Chance a turn goes to another engine.",
)
@click.option(
    "--cpu-chunks",
    type=click.IntRange(min=1),
    default=None,
    help="CPU tier size [default: small enough to evict].",
)
@click.option(
    "--gpu-prompts",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="GPU pool, in average prompts.",
)
@click.option(
    "--store-delay",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Steps before a store is acknowledged.",
)
@click.option(
    "--gpu-flush-steps",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Every N steps vLLM drops the GPU prefix cache and preempts running requests (0: never).",
)
@click.option(
    "--async/--no-async",
    "async_scheduling",
    default=True,
    show_default=True,
    help="vLLM's async scheduling (a step scheduled while the previous one runs).",
)
@click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=None,
    help="max_num_batched_tokens [default: the geometry's].",
)
@click.option(
    "--tiers",
    default="",
    help="Secondary tiers under the CPU tier, joined by commas: vLLM's tiered manager "
    "(TieringOffloadingSpec) over 'fs' (files in a temporary folder the engines share) "
    "and/or 'example' (in memory). Pair it with a small --cpu-chunks for promotions.",
)
@drafter_option("Run the geometry with a speculative drafter (vLLM's own SpeculativeConfig).")
@dcp_option("Decode context parallel size (default: the geometry's, 1).")
@retention_option("vLLM's prefix_cache_retention_interval [default: 0].")
@inject_option("Reintroduce a historical store-side bug (testing keytrace itself).")
@fix_option(
    "Apply a candidate fix to vLLM's offload path for the whole run (does it hold on "
    "real traffic?)."
)
@click.option(
    "--oracle",
    is_flag=True,
    help="Also look every shortfall episode up again in isolation and check the verdicts.",
)
@click.option(
    "--alarm",
    is_flag=True,
    help="Run the live write-only alarm while recording (its warnings go to stderr) and "
    "compare its verdicts with the differ's.",
)
@plain_progress_option
def command(
    out_dir: str | None,
    geometry: str,
    seed: int,
    conversations: int,
    turns: str,
    system_prompts: int,
    system_chunks: str,
    message_chunks: str,
    output_tokens: str,
    arrival_steps: int,
    think_steps: str,
    resend_rate: float,
    engines: int,
    reroute_rate: float,
    cpu_chunks: int | None,
    gpu_prompts: float,
    store_delay: int,
    gpu_flush_steps: int,
    async_scheduling: bool,
    budget: int | None,
    tiers: str,
    drafter: str | None,
    dcp: int | None,
    retention_interval: str | None,
    inject: str | None,
    fix: str | None,
    oracle: bool,
    alarm: bool,
    progress: bool | None,
) -> int:
    """Record seeded, realistic traffic through the installed vLLM's real scheduler, and diff it.

    Conversations of several turns (each extends the previous prompt and output), shared
    system prompts, identical resends, several requests in flight, a CPU tier small enough
    to evict, GPU prefix-cache drops with preemption, slow store acknowledgements, async
    scheduling and two engines with rerouting: what a server sees. The trace is then diffed
    and the prompt tokens accounted for by cause.

    \b
    Example: keytrace workload --geometry dsv4 --seed 3 --out /tmp/kt --oracle
    Exit status: 0 no mismatch, 1 mismatch found, 2 trouble (or the oracle disagreed).
    """
    from keytrace.analysis.geometry import builtin, dcp_refusal, parse_drafter, parse_retention
    from keytrace.report.text import plural, render_diff
    from keytrace.vllm.lab.workload import WorkloadSpec, study_workload

    spec = WorkloadSpec(
        geometry=geometry,
        seed=seed,
        conversations=conversations,
        turns=_range(turns, int, 1),
        system_prompts=system_prompts,
        system_chunks=_range(system_chunks, float),
        message_chunks=_range(message_chunks, float),
        output_tokens=_range(output_tokens, int, 1),
        arrival_steps=arrival_steps,
        think_steps=_range(think_steps, int),
        resend_rate=resend_rate,
        engines=engines,
        reroute_rate=reroute_rate,
        cpu_chunks=cpu_chunks,
        gpu_prompts=gpu_prompts,
        store_delay=store_delay,
        gpu_flush_steps=gpu_flush_steps,
        async_scheduling=async_scheduling,
        budget=budget,
        inject=inject,
        fix=fix,
        tiers=_tiers(tiers),
        drafter=parse_drafter(drafter) if drafter is not None else None,
        dcp=dcp,
        retention_interval=parse_retention(retention_interval)
        if retention_interval is not None
        else 0,
    )
    refused = dcp_refusal(builtin(geometry).with_(dcp=dcp or 1))
    if refused:
        raise UsageError(refused)
    show = progress if progress is not None else sys.stderr.isatty()
    out = out_dir or tempfile.mkdtemp(prefix="keytrace-workload-")
    study = study_workload(
        spec, out, alarm=alarm, oracle=oracle, progress=progress_printer() if show else None
    )
    res, report = study.result, study.report
    click.echo(
        f"recorded {plural(res.requests, 'request')} ({plural(res.turns, 'turn')}, "
        f"{plural(res.resends, 'resend')}, {res.rerouted} rerouted) on "
        f"{plural(engines, 'engine')} in {plural(res.steps, 'step')}, "
        f"{plural(res.gpu_flushes, 'GPU cache drop')}"
        + (f", {res.aborted} aborted after deferrals without end" if res.aborted else "")
        + f", {res.seconds:.1f}s -> {out}"
    )
    render_diff(report, sys.stdout)
    if study.alarm_counts is not None:
        counts = study.alarm_counts
        same = "the same as the differ's" if counts == report.counts else "NOT the differ's"
        listed = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        click.echo(
            f"\nlive alarm: {listed} ({same}); {plural(study.alarm_warnings, 'warning')}, one per "
            "new engine, group and cause"
        )
    if study.oracle is not None:
        bad = study.disagreements
        click.echo(
            f"\noracle: {plural(len(study.oracle), 'shortfall episode')} looked up again in "
            f"isolation, {plural(len(bad), 'disagreement')}"
        )
        for c in bad:
            click.echo(f"  DISAGREES: {c.describe()}")
        if bad:
            raise KeytraceError(
                f"the isolated-lookup oracle disagrees on {plural(len(bad), 'episode')}"
            )
    return EXIT_MISMATCH if report.first_mismatch is not None else EXIT_OK
