"""One error hierarchy for keytrace; `keytrace.cli.main` turns it into exit codes.

Library code raises these; it never calls ``sys.exit`` or prints. Every error carries the
exit code the CLI should use, so the mapping lives in exactly one place.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_TROUBLE = 2


def install_hint(extra: str) -> str:
    """How to install one of keytrace's extras, for an error line. keytrace is installed
    from a clone until a release is published to a package index, so both ways."""
    return f"pip install 'keytrace[{extra}]' (from a clone: pip install -e '.[{extra}]')"


class KeytraceError(Exception):
    """Base class. ``str(err)`` is a complete one-line message for a user."""

    exit_code: int = EXIT_TROUBLE


class TraceError(KeytraceError):
    """A trace cannot be read or used: missing path, bad file, wrong schema, mixed traces."""


class SchemaVersionError(TraceError):
    """A part was written with a schema version this keytrace cannot read."""


class UnknownResultError(TraceError):
    """Raw lookup rows the differ read hold a result value this keytrace does not know."""


class IncompleteEvidenceError(KeytraceError):
    """The trace is known to lack evidence (a torn flush, an unreadable or missing part,
    stores without their lookups): no verdict is given on it unless asked for."""


class RulesDisputedError(KeytraceError):
    """The oracle disagreed with keytrace's rules on the vLLM code that recorded the trace
    (``keytrace doctor --verify``): no AGREE is claimed on it."""


class RulesUncoveredError(KeytraceError):
    """The trace holds what keytrace's rules do not describe (recurrent state groups,
    `keytrace.judge.trust.uncovered`): no verdict is claimed on it."""


class UsageError(KeytraceError):
    """Options that do not make sense together, or point at nothing."""


class VllmUnavailableError(KeytraceError):
    """The command needs vLLM (replay, harness, demo) and it is missing or the wrong version."""
