"""`keytrace doctor`: what works with the vLLM installed here, and why not."""

from __future__ import annotations

import sys

import click

from keytrace.cli._common import json_option, progress_option, subcommand
from keytrace.cli._progress import progress_printer
from keytrace.errors import EXIT_MISMATCH, EXIT_OK, EXIT_TROUBLE, KeytraceError
from keytrace.report.jsonout import write_json
from keytrace.report.text import render_doctor, render_verify


@subcommand("doctor")
@json_option
@click.option("--checks", is_flag=True, help="List every check behind each capability.")
@click.option(
    "--hash-algo",
    default=None,
    help="The --prefix-caching-hash-algo the engines will run with (warns when a shared "
    "tier meets a random per-process seed: xxhash without PYTHONHASHSEED).",
)
@click.option(
    "--kv-transfer-config",
    default=None,
    help="The engines' --kv-transfer-config JSON (its secondary_tiers are checked).",
)
@click.option(
    "--trace",
    "trace",
    default=None,
    help="A recorded trace: each engine's hash identity and tier scope are checked.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Run the isolated-lookup oracle on the installed vLLM (seeded workloads through "
    "its real scheduler: each geometry, a CPU and a tiered manager, no drafter, EAGLE and "
    "MTP lookahead, recurrent state groups with and without an MTP drafter, under "
    "decode context parallelism and with partial tails, retention intervals, positive and "
    "dense) and keep the "
    "outcome for this code: traces recorded on it are then "
    "judged as verified, or, on a disagreement, get no AGREE. Needs the CPU lab.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=1),
    default=900,
    show_default=True,
    help="--verify stops starting workloads after this long.",
)
@click.option(
    "--episodes",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="--verify stops once this many shortfall episodes were checked (after every "
    "layout and drafter ran once).",
)
@click.option(
    "--workloads",
    type=click.IntRange(min=1),
    default=None,
    help="--verify runs at most this many workloads (default: as the time and episode "
    "bounds allow).",
)
@progress_option
def command(
    as_json: bool,
    checks: bool,
    hash_algo: str | None,
    kv_transfer_config: str | None,
    trace: str | None,
    verify: bool,
    seconds: float,
    episodes: int,
    workloads: int | None,
    progress: bool | None,
) -> int:
    """Check this environment: the installed vLLM (version, path, source build or release),
    each hook point keytrace needs, and what works: recording, the live alarm, metrics,
    the CPU lab (demo, replay, sweep, ...), each injection and candidate fix, and whether
    keytrace's rules were verified by the oracle for this vLLM's code (``judge``), with the
    failed check for what does not. Also the Python, torch, pyarrow and polars versions.

    keytrace decides by the installed code, not the version string: a source build of
    main records when its offloading code passes every check, and its verdicts are
    verified when the code that decides keys and rules (its rules digest) is code the
    oracle ran on: shipped with keytrace for the releases it supports, or checked here
    with --verify.

    With --hash-algo/--kv-transfer-config or --trace it also checks hash identity: a shared
    tier (fs, obj, p2p) under a random NONE_HASH seed is read by no other engine and no
    restart (a warning), and engines of a trace that share a tier and hash differently.

    vLLM is only inspected, never patched (--verify runs it in the CPU lab).

    \b
    Exit status: 0 recording works (--verify: the oracle agreed on every shortfall),
    1 --verify found a disagreement, 2 recording does not work here (--verify: nothing
    could be checked).
    """
    if verify:
        return _verify(as_json, seconds, episodes, workloads, progress)
    from keytrace.vllm.lab.doctor import diagnose, identity_warnings

    found = diagnose().as_json()
    found["identity_warnings"] = identity_warnings(hash_algo, kv_transfer_config, trace)
    if as_json:
        write_json(found, sys.stdout)
    else:
        render_doctor(found, sys.stdout, checks=checks)
    return EXIT_OK if found["can_record"] else EXIT_TROUBLE


def _verify(
    as_json: bool, seconds: float, episodes: int, workloads: int | None, progress: bool | None
) -> int:
    from keytrace.vllm.lab.verify import verify

    show = progress if progress is not None else (sys.stderr.isatty() and not as_json)
    out = verify(
        budget_seconds=seconds,
        min_episodes=episodes,
        max_workloads=workloads,
        progress=progress_printer() if show else None,
        partial=True,  # the partial-tail layouts too: a trace with them needs such a run
        checkpoint=True,  # and the prefill-checkpoint ones, likewise
    )
    if as_json:
        write_json(out, sys.stdout)
    else:
        render_verify(out, sys.stdout)
    if out.disagreements:
        return EXIT_MISMATCH
    if out.episodes == 0:
        raise KeytraceError(
            "--verify checked no shortfall episode (every workload was refused or agreed "
            "without a shortfall): nothing verified"
        )
    return EXIT_OK
