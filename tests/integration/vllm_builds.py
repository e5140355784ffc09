"""Run keytrace in a fresh interpreter on another vLLM than the installed release: another
release's own Python code (its sdist's ``vllm/`` first on ``PYTHONPATH``, over the installed
dependencies: tools/vllm_sdist.py), or the installed code under another version string (a
finder that answers ``vllm._version``, as setuptools_scm writes it for a source build;
nothing installed is edited)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REQUIRE_VLLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from vllm_sdist import DEFAULT_CACHE, fetch, unpack_sources  # noqa: E402

VERSION_FINDER = '''
import importlib.abc, importlib.machinery, sys, types

class _Version(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answer ``vllm._version`` as setuptools_scm writes it for a source build."""

    def __init__(self, version):
        self.version = version

    def find_spec(self, name, path, target=None):
        if name == "vllm._version":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__version__ = module.version = self.version
        module.__version_tuple__ = module.version_tuple = tuple(self.version.split("."))

sys.meta_path.insert(0, _Version({version!r}))
'''


def release_sources(version: str) -> Path:
    """A tree whose ``vllm`` package is release ``version``'s Python code (downloaded and
    unpacked once under ~/.cache/keytrace); skipped offline unless vLLM is required."""
    try:
        return unpack_sources(fetch(version, DEFAULT_CACHE), version, DEFAULT_CACHE)
    except (OSError, SystemExit) as exc:
        if REQUIRE_VLLM:
            pytest.fail(f"vLLM {version}'s sdist is required and not available: {exc}")
        pytest.skip(f"vLLM {version}'s sdist not available: {exc}")


def cpu_env(*paths: Path) -> dict[str, str]:
    """This environment for a child that imports vLLM on a CPU, offline, from ``paths``
    (``PYTHONPATH``), with no ``KEYTRACE_*`` setting of the parent's leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(str(p) for p in paths),
    )
    return env


def run_python(
    code: str,
    *,
    release: str | None = None,
    version: str | None = None,
    env: dict[str, str] | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter on release ``release``'s own code and/or with
    vLLM reporting ``version``."""
    paths = [ROOT]
    if release is not None:
        paths.insert(0, release_sources(release))
    prelude = VERSION_FINDER.format(version=version) if version else ""
    full = cpu_env(*paths)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        env=full,
        cwd=ROOT,
        timeout=timeout,
    )


DOCTOR = """
import sys
from keytrace.cli import main
sys.exit(main(["doctor", "--json"]))
"""


def doctor(**where: Any) -> tuple[int, dict[str, Any]]:
    """``keytrace doctor --json`` there: (exit code, its JSON)."""
    r = run_python(DOCTOR, **where)
    assert r.stdout.strip(), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def capability_table(found: dict[str, Any]) -> dict[str, bool]:
    return {c["name"]: c["ok"] for c in found["capabilities"]}
