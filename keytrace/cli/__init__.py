"""Layer 8, the ``keytrace`` command line: thin click commands over library functions.

Exit codes are decided here and nowhere else (`main`):

- a command returns 0 (agree / done) or 1 (a mismatch was found);
- a `KeytraceError` becomes its ``exit_code`` (2) with a one-line message on stderr;
- anything else unexpected is also exit 2 with one line naming it, and a pointer to
  ``--debug``, which prints the traceback instead. Exit 1 therefore always means a mismatch.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

import click

from keytrace._version import __version__
from keytrace.cli._common import FLAGS, debug_option, verbose_option
from keytrace.errors import EXIT_TROUBLE, KeytraceError


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # keep the order commands were added in


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="keytrace")
@debug_option
@verbose_option
def cli() -> None:
    """Record, diff and replay vLLM KV-offload OffloadKeys, per KV-cache group.

    \b
    Record:   KEYTRACE_DIR=/tmp/kt vllm serve ...   (pip install keytrace; no flag needed)
    Inspect:  keytrace summary /tmp/kt
    Diff:     keytrace diff /tmp/kt                  (exit 0 agree, 1 mismatch, 2 trouble)
    Try it:   keytrace demo                          (real vLLM scheduler on a CPU)
    Check:    keytrace doctor                        (what works with this vLLM, and why)
    """


def _register() -> None:
    from keytrace.cli import (
        compact,
        demo,
        diff,
        doctor,
        fixture,
        fuzz,
        header,
        minimize,
        replay,
        report,
        summary,
        sweep,
        workload,
    )

    for mod in (
        doctor,
        demo,
        diff,
        summary,
        header,
        replay,
        fixture,
        minimize,
        report,
        sweep,
        fuzz,
        workload,
        compact,
    ):
        cli.add_command(mod.command)


_register()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns the exit code (also used by tests)."""
    FLAGS.update(debug=False, verbose=False)
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except KeytraceError as exc:
        click.echo(f"keytrace: error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    except click.ClickException as exc:
        exc.show()
        return EXIT_TROUBLE
    except click.exceptions.Abort:
        click.echo("keytrace: aborted", err=True)
        return EXIT_TROUBLE
    except KeyboardInterrupt:
        click.echo("keytrace: interrupted", err=True)
        return 130
    except Exception as exc:
        if FLAGS["debug"]:
            traceback.print_exc()
        else:
            first = str(exc).splitlines()[0] if str(exc) else ""
            click.echo(
                f"keytrace: error: unexpected {type(exc).__name__}"
                + (f": {first}" if first else "")
                + " (run with --debug for the traceback)",
                err=True,
            )
        return EXIT_TROUBLE


def entry() -> None:
    sys.exit(main())
