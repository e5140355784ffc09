"""The standalone vLLM regression (`keytrace.report.standalone`) inside vLLM 0.33.0's own test
tree (the sdist, tools/vllm_sdist.py): copied unchanged into
tests/v1/kv_connector/unit/offloading_connector/ and run by pytest there, with vLLM's
conftest and without keytrace on the test's import path.

- the live stock miss (17,975 tokens, dsv4): red on stock vLLM;
- 18,877 tokens: green on stock, red with each historical store bug injected (through
  keytrace's vLLM plugin and KEYTRACE_INJECT, as a vLLM developer would reintroduce it);
- the live miss turns green with the candidate fix ``eagle_proof_key`` (KEYTRACE_FIX).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import builtin  # noqa: E402
from keytrace.analysis.plan import plan_from_trace  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.report.standalone import regression_name, render_vllm_regression  # noqa: E402
from keytrace.vllm.lab.replay import replay  # noqa: E402
from keytrace.vllm.mods.catalog import INJECTIONS  # noqa: E402

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
from vllm_sdist import (  # noqa: E402
    CONFCUTDIR,
    OFFLOADING_SUITE,
    TIERING_CONFCUTDIR,
    TIERING_SUITE,
    prepare,
)

LOADER = "def pytest_configure(config):\n    from vllm.plugins import load_general_plugins\n\n    load_general_plugins()\n"


@pytest.fixture(scope="module")
def vllm_tree() -> tuple[Path, Path]:
    return prepare()


def _run_in_vllm(
    tree: Path,
    home: Path,
    text: str,
    name: str,
    tmp: Path,
    inject: str | None = None,
    fix: str | None = None,
    tiered: bool = False,
) -> subprocess.CompletedProcess[str]:
    folder, confcutdir = (
        (Path(TIERING_SUITE).parent, TIERING_CONFCUTDIR)
        if tiered
        else (OFFLOADING_SUITE, CONFCUTDIR)
    )
    target = tree / folder / name
    target.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", HF_HOME=str(home))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(target.relative_to(tree)),
        f"--confcutdir={confcutdir}",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if inject or fix:
        (tmp / "kt_loader.py").write_text(LOADER)
        env.update(KEYTRACE_DIR=str(tmp / "rec"), PYTHONPATH=str(tmp))
        env.update({"KEYTRACE_INJECT": inject} if inject else {"KEYTRACE_FIX": fix or ""})
        cmd += ["-p", "kt_loader"]
    try:
        return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    finally:
        target.unlink()


def _regression(tmp: Path, n: int, inject: str | None = None) -> tuple[str, str]:
    d = tmp / f"trace-{n}-{inject}"
    replay(builtin("dsv4"), [n], n, trace_dir=d, inject=inject)
    plan = plan_from_trace(open_trace(str(d)))
    text = render_vllm_regression(plan)
    assert "keytrace" not in "".join(
        line for line in text.splitlines() if line.startswith(("import", "from"))
    )
    return text, regression_name(plan, text)


def test_live_miss_is_red_on_stock_vllm(vllm_tree: tuple[Path, Path], tmp_path: Path) -> None:
    text, name = _regression(tmp_path, 17_975)
    r = _run_in_vllm(*vllm_tree, text, name, tmp_path)
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-2000:]
    assert "assert 0 == 17920" in r.stdout


def test_live_miss_is_green_with_the_candidate_fix(
    vllm_tree: tuple[Path, Path], tmp_path: Path
) -> None:
    text, name = _regression(tmp_path, 17_975)
    r = _run_in_vllm(*vllm_tree, text, name, tmp_path, fix="eagle_proof_key")
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:]
    assert "candidate fix 'eagle_proof_key'" in r.stdout + r.stderr


def test_18877_is_green_on_stock(vllm_tree: tuple[Path, Path], tmp_path: Path) -> None:
    text, name = _regression(tmp_path, 18_877, inject="pre48911")
    stock = _run_in_vllm(*vllm_tree, text, name, tmp_path)
    assert stock.returncode == 0 and "1 passed" in stock.stdout, stock.stdout[-2000:]


@pytest.mark.parametrize("inject", sorted(INJECTIONS))
def test_each_injected_bug_is_red(
    inject: str, vllm_tree: tuple[Path, Path], tmp_path: Path
) -> None:
    text, name = _regression(tmp_path, 18_877, inject=inject)
    bad = _run_in_vllm(*vllm_tree, text, name, tmp_path, inject=inject)
    assert bad.returncode == 1 and "1 failed" in bad.stdout, bad.stdout[-2000:]
    assert "== 18688" in bad.stdout


def _tiered_stall(tmp: Path) -> tuple[str, str]:
    """The standalone form of the tiered livelock, from a stalled replay (12 CPU chunks over
    an fs tier, 547 tokens: tools/regen_regressions.py's third entry)."""
    from keytrace.vllm.lab.config import tiered

    d = tmp / "trace-tiered"
    geo = tiered(builtin("small").with_(cpu_chunks=12), ("fs",))
    assert replay(geo, [547], 547, trace_dir=d).verdict == "stalled"
    plan = plan_from_trace(open_trace(str(d)))
    text = render_vllm_regression(plan)
    assert "TieringOffloadingManager" in text and "NUM_PRIMARY_CHUNKS = 12" in text
    return text, regression_name(plan, text)


def test_the_tiered_livelock_is_red_on_stock_vllm(
    vllm_tree: tuple[Path, Path], tmp_path: Path
) -> None:
    text, name = _tiered_stall(tmp_path)
    r = _run_in_vllm(*vllm_tree, text, name, tmp_path, tiered=True)
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-2000:]
    assert "still deferred after 64 steps" in r.stdout and "with a MISS: 0" in r.stdout


def test_the_tiered_livelock_is_green_with_the_candidate_fix(
    vllm_tree: tuple[Path, Path], tmp_path: Path
) -> None:
    text, name = _tiered_stall(tmp_path)
    r = _run_in_vllm(*vllm_tree, text, name, tmp_path, fix="promotion_pins_prefix", tiered=True)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:]
