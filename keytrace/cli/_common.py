"""What every command shares: the command decorator (--debug, --verbose, quiet host logs),
trace arguments, --json, and how warnings from reading a trace are shown."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import click

from keytrace.format.reader import Trace

FLAGS = {"debug": False, "verbose": False}
"""Set from --debug/--verbose (before or after the command name); read by `cli.main`."""


def quiet_host_logs() -> None:
    """Keep vLLM's and torch's start-up chatter out of keytrace's own commands.

    The harness builds real vLLM configs on a CPU, which makes vLLM warn about block sizes,
    SSM dtypes and its experimental connector API on every scheduler (hundreds of lines in
    a sweep). Their loggers go to ERROR unless ``--verbose``; an explicit
    ``VLLM_LOGGING_LEVEL`` or ``TORCH_LOGS`` wins. torch sets its own logger levels when it
    initialises, so only its environment variable reaches it. Never called when keytrace
    runs as a plugin in a server.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")
    for name in ("vllm", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _flag(name: str) -> Callable[[click.Context, click.Parameter, bool], None]:
    def set_flag(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            FLAGS[name] = True

    return set_flag


debug_option = click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_flag("debug"),
    help="Print the traceback of an unexpected error.",
)
verbose_option = click.option(
    "--verbose",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_flag("verbose"),
    help="Show vLLM's and torch's own log lines.",
)


def subcommand(name: str) -> Callable[[Callable[..., int]], click.Command]:
    """``@click.command(name)`` plus --debug and --verbose, and quiet host logs before the
    command body runs (so before any vLLM import)."""

    def decorate(fn: Callable[..., int]) -> click.Command:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> int:
            if not FLAGS["verbose"]:
                quiet_host_logs()
            return fn(*args, **kwargs)

        return verbose_option(debug_option(click.command(name)(run)))

    return decorate


trace_paths = click.argument("paths", nargs=-1, required=True, metavar="TRACE...")
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout."
)


def _progress(default_text: str) -> Callable[[Any], Any]:
    return click.option(
        "--progress/--no-progress",
        default=None,
        help=f"Progress on stderr [default: {default_text}].",
    )


progress_option = _progress("on for a terminal, off with --json")
"""``--progress/--no-progress`` for a command with ``--json``."""
plain_progress_option = _progress("on for a terminal")
"""``--progress/--no-progress`` for a command without ``--json``."""


def inject_option(help: str) -> Callable[[Any], Any]:
    """``--inject NAME``: one of `keytrace.vllm.mods.catalog.INJECTIONS`."""
    from keytrace.vllm.mods.catalog import INJECTIONS

    return click.option("--inject", type=click.Choice(sorted(INJECTIONS)), default=None, help=help)


class FixSpec(click.ParamType):  # type: ignore[type-arg]  # not generic at runtime in older click
    """One candidate fix, or several joined by commas (``eagle_proof_key,window_minus_one``),
    each one of `keytrace.vllm.mods.catalog.FIXES`; the value stays the string."""

    name = "NAME[,NAME]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from keytrace.errors import UsageError
        from keytrace.vllm.mods.catalog import check_fix, fix_names

        try:
            names = fix_names(str(value)) or [check_fix(str(value))]
        except UsageError as exc:
            self.fail(str(exc), param, ctx)
        return ",".join(dict.fromkeys(names))


def fix_option(help: str) -> Callable[[Any], Any]:
    """``--fix NAME[,NAME]``: candidate fixes of `keytrace.vllm.mods.catalog.FIXES`, several joined by commas."""
    from keytrace.vllm.mods.catalog import FIXES

    return click.option(
        "--fix",
        type=FixSpec(),
        default=None,
        help=f"{help} Known: {', '.join(sorted(FIXES))}; several joined by commas.",
    )


class DrafterSpec(click.ParamType):  # type: ignore[type-arg]  # not generic at runtime in older click
    """A speculative drafter, ``METHOD[:K[:MODULES]]`` (`keytrace.analysis.geometry.parse_drafter`)
    or ``none``; checked when parsed, the value stays the string."""

    name = "METHOD[:K[:MODULES]]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from keytrace.analysis.geometry import parse_drafter

        try:
            parse_drafter(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


def drafter_option(help: str, *, multiple: bool = False) -> Callable[[Any], Any]:
    """``--drafter METHOD[:K[:MODULES]]``: the geometry runs a real speculative config
    (``multiple``: the option may be given several times; a tuple, empty when not given)."""
    from keytrace.analysis.geometry import DRAFTER_METHODS

    return click.option(
        "--drafter",
        "drafters" if multiple else "drafter",
        type=DrafterSpec(),
        multiple=multiple,
        default=() if multiple else None,
        help=f"{help} METHOD is one of {', '.join(DRAFTER_METHODS)}; K the speculative "
        "tokens (default 1); MODULES an MTP checkpoint's module count (n_predict, default 1): "
        "mtp:2:3. The trace header records the drafter and vLLM's hash lookahead.",
    )


def dcp_option(help: str) -> Callable[[Any], Any]:
    """``--dcp N``: vLLM's decode context parallel size for the lab's geometry
    (`keytrace.analysis.geometry.Geometry.dcp`)."""
    return click.option(
        "--dcp",
        type=click.IntRange(min=1),
        default=None,
        help=f"{help} vLLM's --decode-context-parallel-size, over as many tensor parallel "
        "ranks: an attention block spans block x N tokens, a recurrent state stays one "
        "block. vLLM refuses it with sliding-window groups.",
    )


class RetentionSpec(click.ParamType):  # type: ignore[type-arg]  # not generic at runtime in older click
    """vLLM's ``prefix_cache_retention_interval``: ``N`` tokens or ``dense``
    (`keytrace.analysis.geometry.parse_retention`); checked when parsed, the value stays
    the string (None: not given, the geometry's own)."""

    name = "N|dense"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from keytrace.analysis.geometry import parse_retention

        try:
            parse_retention(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


def retention_option(help: str) -> Callable[[Any], Any]:
    """``--retention-interval N|dense``: the geometry runs with vLLM's
    ``prefix_cache_retention_interval`` (a string; `parse_retention` reads it)."""
    return click.option(
        "--retention-interval",
        "retention_interval",
        type=RetentionSpec(),
        default=None,
        help=f"{help} N: sliding-window tails every N tokens too (a multiple of every "
        "windowed group's chunk and of the blocks' LCM, as vLLM requires); 0: only at each "
        "request's own boundary and junctions (vLLM's default); dense: every block of "
        "every window. The trace header records it.",
    )


class OutputPath(click.ParamType):  # type: ignore[type-arg]  # not generic at runtime in older click
    """A file (or, ``folder=True``, a folder) a command writes: it may be new, but the folder
    it goes in must exist. Checked when the option is parsed, so a typo in a folder name is
    one usage error before anything runs, not a failure at the end of the work (a URI such
    as ``s3://...`` is not checked here). The value stays the string."""

    def __init__(self, *, folder: bool = False) -> None:
        self.folder = folder
        self.name = "DIR" if folder else "FILE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        refused = output_refusal(str(value), folder=self.folder)
        if refused:
            self.fail(refused, param, ctx)
        return str(value)


def output_refusal(path: str, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written as a new or existing file (``folder``: folder), or
    None: the folder it goes in must exist, and an existing ``path`` must be of its kind."""
    if "://" in path:
        return None
    if os.path.exists(path):
        if folder and not os.path.isdir(path):
            return f"{path} is a file, not a folder"
        if not folder and os.path.isdir(path):
            return f"{path} is a folder, not a file"
        return None
    parent = os.path.dirname(path.rstrip("/")) or "."
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        return f"folder {parent} {what}"
    return None


def echo_warnings(warnings: list[str]) -> None:
    for w in warnings:
        click.echo(f"keytrace: warning: {w}", err=True)


def echo_trace_warnings(trace: Trace, *, allow_incomplete: bool = True) -> None:
    """Warnings and notes from reading go to stderr, one line each. A judging command
    passes its ``--allow-incomplete``: without it, a trace `check_complete` refuses leaves
    out the warning the error line repeats (the first thing missing)."""
    repeated = _named(_incomplete_reasons(trace)) if not allow_incomplete else None
    echo_warnings([w for w in trace.warnings if w != repeated])
    for n in trace.notes:
        click.echo(f"keytrace: note: {n}", err=True)


allow_incomplete_option = click.option(
    "--allow-incomplete",
    is_flag=True,
    help="Work from a trace known to be incomplete anyway (torn by a kill, parts unreadable "
    "or missing, stores without their lookups); what it says then says so. Without it such "
    "a trace is exit 2: a verdict on partial evidence can be wrong either way.",
)


def _named(reasons: list[str]) -> str | None:
    """The warning line that `refuse_incomplete`'s error repeats (its first reason)."""
    return f"incomplete trace: {reasons[0].removeprefix('incomplete trace: ')}" if reasons else None


def _incomplete_reasons(trace: Trace) -> list[str]:
    return trace.missing + [f"part {p} unreadable" for p in trace.skipped]


def refuse_incomplete(reasons: list[str]) -> None:
    """Raise `IncompleteEvidenceError` naming the first of ``reasons`` (what is missing):
    every command that judges a trace refuses one known to be incomplete."""
    from keytrace.errors import IncompleteEvidenceError

    first = reasons[0].removeprefix("incomplete trace: ") if reasons else "see the warnings"
    more = f" (and {len(reasons) - 1} more, see the warnings)" if len(reasons) > 1 else ""
    raise IncompleteEvidenceError(
        f"the trace is incomplete: {first}{more}; no verdict on partial evidence "
        "(--allow-incomplete judges what is there)"
    )


def check_complete(trace: Trace, allow_incomplete: bool, *, unlooked: bool = True) -> None:
    """`refuse_incomplete` unless ``allow_incomplete``, for a trace the reader found torn,
    capped or with unreadable parts, or whose requests stored keys without lookups
    (`keytrace.analysis.diff.stores_without_lookups`; ``unlooked=False`` for ``keytrace
    diff``, whose report finds them itself, after saying what else it cannot judge)."""
    if allow_incomplete:
        return
    if trace.incomplete:
        refuse_incomplete(_incomplete_reasons(trace))
    if not unlooked:
        return
    from keytrace.analysis.diff import stores_without_lookups

    missing = stores_without_lookups(trace)
    if missing:
        refuse_incomplete(
            [f"{len(missing)} request(s) stored keys and have no lookup rows ({missing[0]} ...)"]
        )


def exit_for_verdicts(verdicts: list[str], what: str) -> int:
    """The exit status of lab commands that judge scenarios: 1 when one mismatches, 2 (one
    line) when one was recorded on a geometry keytrace has no rules for, else 0."""
    from keytrace.analysis.results import NO_VERDICT
    from keytrace.errors import EXIT_MISMATCH, EXIT_OK, RulesUncoveredError

    if "mismatch" in verdicts:
        return EXIT_MISMATCH
    if NO_VERDICT in verdicts:
        raise RulesUncoveredError(
            f"no verdict: {what} holds what keytrace has no rules for yet (recurrent state "
            "groups in some settings, a full-attention draft group with legacy hashes on a "
            "tiered manager: keytrace diff on its trace names it); recorded, not judged "
            "(see docs/diff.md, 'Rules verified by the oracle')"
        )
    return EXIT_OK
