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


CLEAN_ENV_KEPT = ("PATH", "HOME")
"""What a user's shell hands a command in the clean environment the README's commands must
work in: nothing of CI's own exports (``VLLM_TARGET_DEVICE``, ``HF_HUB_OFFLINE``,
``PYTHONHASHSEED``...)."""


def clean_env() -> dict[str, str]:
    """The environment of a user who exported nothing (`CLEAN_ENV_KEPT` only)."""
    import os

    return {k: os.environ[k] for k in CLEAN_ENV_KEPT if k in os.environ}


def run_keytrace_clean(
    *args: str, cwd: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``keytrace ARGS`` in a fresh interpreter and a clean environment (`clean_env`), as a
    user types it."""
    return subprocess.run(
        [sys.executable, "-m", "keytrace", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=cwd,
        timeout=timeout,
    )


def foreign_lines(stderr: str) -> list[str]:
    """Lines of a command's stderr that are not keytrace's own (``keytrace: ...``): library
    warnings that leaked into a user's terminal."""
    return [line for line in stderr.splitlines() if line and not line.startswith("keytrace: ")]
