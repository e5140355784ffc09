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
def command(
    as_json: bool,
    checks: bool,
    hash_algo: str | None,
    kv_transfer_config: str | None,
    trace: str | None,
) -> int:
    """Check this environment: the installed vLLM (version, path, source build or release),
    each hook point keytrace needs, and what works: recording, the live alarm, metrics,
    the CPU lab (demo, replay, sweep, ...) and each injection and candidate fix, with the
    failed check for what does not. Also the Python, torch, pyarrow and polars versions.

    keytrace decides by the installed code, not the version string: a source build of
    main records when its offloading code passes every check. vLLM is only inspected,
    never patched.

    With --hash-algo/--kv-transfer-config or --trace it also checks hash identity: a shared
    tier (fs, obj, p2p) under a random NONE_HASH seed is read by no other engine and no
    restart (a warning), and engines of a trace that share a tier and hash differently.

    Exit 0 when recording would work, 2 otherwise.
    """
    from keytrace.vllm.lab.doctor import diagnose, identity_warnings

    found = diagnose().as_json()
    found["identity_warnings"] = identity_warnings(hash_algo, kv_transfer_config, trace)
    if as_json:
        write_json(found, sys.stdout)
    else:
        render_doctor(found, sys.stdout, checks=checks)
    return EXIT_OK if found["can_record"] else EXIT_TROUBLE
