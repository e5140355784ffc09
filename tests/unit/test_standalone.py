"""The standalone vLLM regression's text: deterministic, literal geometry, vLLM-only imports,
formatted as vLLM formats code (ruff, line length 88). Running it inside vLLM's own test
tree is tests/integration/test_standalone_regression.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from keytrace.analysis.plan import plan_from_trace
from keytrace.format.reader import open_trace
from keytrace.report.standalone import regression_name, render_vllm_regression
from tests.unit.test_chunkmap import two_shortfalls


def _text(tmp_path: Path) -> tuple[str, object]:
    plan = plan_from_trace(open_trace(str(two_shortfalls(tmp_path / "t"))))
    return render_vllm_regression(plan, evidence="group 1 chunk 4: never offered"), plan


def test_literal_deterministic_and_vllm_only(tmp_path: Path) -> None:
    text, plan = _text(tmp_path)
    again, _ = _text(tmp_path / "again")
    assert text == again
    assert regression_name(plan, text) == regression_name(plan, again)
    assert "GROUPS = [\n    (16, None, False),\n    (16, 32, False),\n]" in text
    assert "PRIME_TOKENS = 100\nEPISODE_TOKENS = 100\nEXPECTED_EXTERNAL_TOKENS = 96\n" in text
    imports = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert imports and all(
        ln.split()[1].split(".")[0] in ("types", "unittest", "torch", "vllm") for ln in imports
    )
    compile(text, "t.py", "exec")


def test_formatted_as_vllm_formats_code(tmp_path: Path) -> None:
    text, _ = _text(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "--line-length",
            "88",
            "--stdin-filename",
            "t.py",
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
