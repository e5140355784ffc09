"""Every command of the CPU lab works for a user who exported nothing, and prints only its
own lines.

The lab needs ``VLLM_TARGET_DEVICE=cpu`` and ``HF_HUB_OFFLINE=1`` before vLLM resolves its
platform; it sets them itself (`keytrace.vllm.lab.environment`). CI exports both, so only a
fresh interpreter with nothing but ``PATH`` and ``HOME`` shows whether a user's
``keytrace demo`` works (it did not: "Failed to infer device type"). The demo itself runs
this way in ``tests/integration/test_demo.py``; ``.ci/run`` also runs the README's commands
in a clean environment, fresh clone and fresh venv.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import require_vllm
from tests.isolation import clean_env, foreign_lines, run_keytrace_clean

require_vllm()

DATA = Path(__file__).resolve().parents[1] / "data" / "v1"
"""A small-geometry recording of a 1,030-token miss (schema v1): what replay, minimize and
report start from."""

COMMANDS = {
    # a length that misses and one that hits on the small geometry: exit 1
    "sweep": (["sweep", "--geometry", "small", "--lengths", "1030,1090", "--quiet"], 1),
    "workload": (["workload", "--geometry", "small", "--conversations", "2", "-o", "w"], 0),
    "replay": (["replay", "trace"], 1),
    "fuzz": (["fuzz", "-o", "f", "--max-examples", "2", "--seed", "1"], 0),
    "minimize": (["minimize", "trace", "-o", "m"], 1),
    "report": (["report", "trace", "-o", "r", "--no-minimize", "--sweep-points", "4"], 1),
    "doctor": (["doctor"], 0),
}


def test_clean_env_holds_only_path_and_home() -> None:
    assert set(clean_env()) <= {"PATH", "HOME"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_lab_command_in_a_clean_environment(name: str, tmp_path: Path) -> None:
    args, code = COMMANDS[name]
    shutil.copytree(DATA, tmp_path / "trace")
    r = run_keytrace_clean(*args, cwd=str(tmp_path))
    assert r.returncode == code, r.stderr[-3000:]
    assert "Failed to infer device type" not in r.stderr
    assert foreign_lines(r.stderr) == [], r.stderr
