"""Nothing in the repository points at notes outside it.

Some docstrings and docs once cited research notes kept beside the checkout (a ``shared``
docs folder), which no clone, wheel or reader of the code has. A reference names what the
note summarised instead: the vLLM file and function, the upstream issue or PR, or a doc in
``docs/``. This scans every tracked text file and names each reference as file:line.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

OUTSIDE = re.compile(
    r"\.\./shared|shared/docs"
    r"|(?<![\w-])(?:prior-art|vllm-offload-notes|vllm-tiering-notes|cpu-scheduler-harness"
    r"|vllm-versions|style)\.md"
)
"""The notes that live outside the repository, and the folder they live in."""

SELF = "tests/unit/test_no_outside_refs.py"  # names the notes in order to find them


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout: {exc}")
    return [name for name in out.decode().split("\0") if name]


def references(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every outside reference in ``text``."""
    return [
        (n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)
    ]


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = []
    for name in tracked_files():
        if name == SELF:
            continue
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        data = path.read_bytes()
        if b"\0" in data:  # Parquet, PNG
            continue
        text = data.decode("utf-8", errors="replace")
        found += [f"{name}:{n}: {line}" for n, line in references(text)]
    assert found == [], "references to files outside the repository:\n" + "\n".join(found)


def test_the_scan_can_fail() -> None:
    planted = (
        "ok\n(`../shared/docs/vllm-offload-notes.md` §2)\nsee prior-art.md §1.5\n"
        "style.md\nlifestyle.md and my-style.md are other files\n"
    )
    assert [n for n, _ in references(planted)] == [2, 3, 4]
    assert references("vllm-versions.md, cpu-scheduler-harness.md")
    assert references("vllm-tiering-notes.md")
