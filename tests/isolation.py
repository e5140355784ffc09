"""Run Python in a fresh interpreter with some packages made unimportable.

A ``None`` entry in ``sys.modules`` makes ``import X`` raise ModuleNotFoundError and makes
``importlib.util.find_spec("X")`` answer "not installed": exactly a machine without X.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent(
    """
    import sys
    BLOCKED = sys.argv[1].split(",")
    for name in BLOCKED:
        sys.modules[name] = None
    def loaded(name):
        return sys.modules.get(name) is not None
    """
)


def run_blocked(blocked: str, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` with the comma-separated packages ``blocked``; ``sys.argv[2:]`` = args."""
    code = BLOCKER + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, blocked, *args], capture_output=True, text=True, timeout=120
    )
