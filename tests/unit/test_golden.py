"""Generated files are deterministic text: each golden under tests/golden/ is exactly what its
generator writes today (tools/regen_golden.py regenerates them; a change shows as a diff of
the golden file), and the generated Python is what the repository's formatter writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regen_golden", ROOT / "tools/regen_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()


@pytest.mark.parametrize("name", sorted(TOOL.GENERATORS))
def test_golden_file_is_what_its_generator_writes(name: str) -> None:
    text = TOOL.GENERATORS[name]()
    assert text == (TOOL.GOLDEN / name).read_text(), (
        f"tests/golden/{name} is stale: run python tools/regen_golden.py and read the diff"
    )
    assert text == TOOL.GENERATORS[name]()  # and deterministic within a run


def test_every_golden_file_has_a_generator() -> None:
    assert {p.name for p in TOOL.GOLDEN.iterdir()} == set(TOOL.GENERATORS)


@pytest.mark.parametrize("name", [n for n in sorted(TOOL.GENERATORS) if ".py." in n])
def test_generated_python_is_formatted_and_compiles(name: str) -> None:
    text = (TOOL.GOLDEN / name).read_text()
    compile(text, name, "exec")
    # the standalone regression goes into vLLM's tree: vLLM's line length
    length = ["--line-length", "88"] if name.startswith("standalone") else []
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            *length,
            "--stdin-filename",
            "t.py",
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_chunk_map_golden_names_the_miss() -> None:
    """What the golden pins, in words: the 1,030-token resend's map binds group 2 (SWA,
    MTP) at chunk 61, needed and never offered, next to the chunks the store kept."""
    data = json.loads((TOOL.GOLDEN / "chunkmap_small_1030.json").read_text())
    (ep,) = data["episodes"]
    assert (ep["terminal"]["group"], ep["terminal"]["chunk"], ep["terminal"]["cause"]) == (
        2,
        61,
        "never_offered",
    )
    mtp = {c[0]: c for lane in ep["lanes"] if lane["group"] == 2 for c in lane["chunks"]}
    assert mtp[61][1:5] == [None, "MISS", True, "never_offered"]
    assert mtp[62][1] == mtp[63][1] == "resident"


def test_the_check_mode_reports_a_stale_golden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in TOOL.GENERATORS:
        (tmp_path / name).write_text((TOOL.GOLDEN / name).read_text())
    (tmp_path / "report_small_1030.md").write_text("stale\n")
    monkeypatch.setattr(TOOL, "GOLDEN", tmp_path)
    monkeypatch.setattr(sys, "argv", ["regen_golden.py", "--check"])
    assert TOOL.main() == 1
    monkeypatch.setattr(sys, "argv", ["regen_golden.py"])
    assert TOOL.main() == 0
    monkeypatch.setattr(sys, "argv", ["regen_golden.py", "--check"])
    assert TOOL.main() == 0
