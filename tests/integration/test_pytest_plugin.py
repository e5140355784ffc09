"""``pytest --keytrace DIR`` (keytrace.vllm.hook.pytest_plugin), in a pytest of its own: inert
without the flag; with it, one trace folder per test, a keytrace section in a failing test's
report, one summary line. (vLLM's own suite through the plugin: tools/vllm_suite.py
--record plugin, run by .ci/run.)"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.analysis.geometry import SMALL  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.vllm.hook.pytest_plugin import folder_name  # noqa: E402
from tests.integration.vllm_builds import cpu_env  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import sys

import pytest

from keytrace.analysis.geometry import DSV4, SMALL
from keytrace.vllm.lab.harness import Harness


def test_recorder_not_loaded():
    assert "keytrace.vllm.hook.patches" not in sys.modules, "the plugin loaded the recorder"


def test_stock_miss_fails():
    h = Harness(DSV4, max_prompt_tokens=18_000)
    result = h.scenario(17_975)  # store, reset the GPU prefix cache, look up again
    h.close()
    assert result.external_tokens > 0, "the second request should have loaded from the CPU"


def test_small_agrees():
    h = Harness(SMALL)
    assert h.scenario(1000).external_tokens > 0
    h.close()


def test_no_scheduler():
    assert 1 + 1 == 2


@pytest.fixture(scope="module")
def shared():
    h = Harness(SMALL)
    yield h
    h.close()


def test_shared_first(shared):
    assert shared.scenario(1000).external_tokens > 0


def test_shared_second(shared):
    assert shared.scenario(1000).external_tokens > 0
"""


def _pytest(
    tmp_path: Path,
    *args: str,
    source: str = TESTS,
    test_file: str = "test_cases.py",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """A pytest of its own over ``source`` written to ``tmp_path/test_file`` (rooted
    there), keytrace importable; ``env`` adds to (or overrides) the environment."""
    (tmp_path / test_file).write_text(source)
    full = cpu_env(ROOT)
    full.update(env or {})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / test_file),
            *args,
        ],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
        timeout=900,
    )


def test_inert_without_the_flag(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "-k", "recorder_not_loaded or no_scheduler")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "2 passed" in r.stdout and "keytrace:" not in r.stdout


def test_one_trace_per_test_and_the_verdict_of_a_failing_test(tmp_path: Path) -> None:
    out = tmp_path / "kt"
    r = _pytest(tmp_path, "--keytrace", str(out), "-k", "not recorder_not_loaded and not shared")
    # outcomes are the test's own: one failure (its assert), two passes
    assert r.returncode == 1 and "1 failed, 2 passed" in r.stdout, r.stdout[-3000:]
    assert "AssertionError: the second request should have loaded from the CPU" in r.stdout
    nodes = {
        name: f"test_cases.py::{name}"
        for name in ("test_stock_miss_fails", "test_small_agrees", "test_no_scheduler")
    }
    folders = {name: out / folder_name(node) for name, node in nodes.items()}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f.name for n, f in folders.items() if n != "test_no_scheduler"
    )
    assert folder_name(nodes["test_small_agrees"]).startswith("test_cases.py-test_small_agrees-")
    # each folder is a complete trace of its own test, judged as `keytrace diff` would
    miss = diff(open_trace(str(folders["test_stock_miss_fails"])))
    assert miss.first_mismatch is not None
    assert miss.first_mismatch.evidence() == (2, 277, "never_offered")
    assert diff(open_trace(str(folders["test_small_agrees"]))).first_mismatch is None
    # the failing test's report carries the verdict and its first mismatch
    section = r.stdout[r.stdout.index("keytrace ---") :]
    assert "MISMATCH: request " in section and "binding group 2 (SWA, MTP)" in section
    assert f"(keytrace diff {folders['test_stock_miss_fails']})" in section
    assert (
        f"keytrace: 2 of 3 tests recorded a trace under {out} " in r.stdout
        and "0 recorder failures); 1 failing test(s) diffed: 1 MISMATCH" in r.stdout
    )


SCENARIO = ROOT / "tests" / "vllm_scenarios" / "runner_scenario.py"
RUNNER_GEOMETRY = dataclasses.replace(
    SMALL,
    name="runner",
    max_num_batched_tokens=1000,  # RequestRunner's
    max_model_len=2048,  # facebook/opt-125m's, which RequestRunner's config reads
    extra={"offload_prompt_only": False},  # RequestRunner's default
)
"""The harness geometry of the scenario's RequestRunner: SMALL's groups, its batch size."""


def _episodes(trace_dir: Path) -> list[tuple[object, ...]]:
    """Every episode's numbers and evidence, in order (request ids differ by design)."""
    return [
        (v.verdict, v.num_prompt_tokens, v.S, v.L, v.E, v.external_tokens, v.evidence())
        for v in diff(open_trace(str(trace_dir)), all_episodes=True).episodes
    ]


def test_a_request_runner_scenario_diffs_like_the_harness(tmp_path: Path) -> None:
    """vLLM's own test machinery (RequestRunner, in vLLM's test tree) recorded with
    ``pytest --keytrace`` judges as keytrace's harness does on the same prompts: a hit at
    1,000 tokens, the stock MTP peek miss at 970."""
    sys.path.insert(0, str(ROOT / "tools"))
    from vllm_sdist import prepare

    from keytrace.vllm.hook.patches import recording
    from keytrace.vllm.lab.harness import Harness

    tree, home = prepare()
    out = tmp_path / "kt"
    r = _pytest(
        tmp_path,
        "--keytrace",
        str(out),
        source=SCENARIO.read_text(),
        test_file="test_runner_scenario.py",
        # vLLM's `tests` package first, then keytrace
        env={"PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]), "HF_HOME": str(home)},
    )
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    for n, verdict in ((970, "mismatch"), (1000, "hit")):
        [runner_dir] = out.glob(f"test_runner_scenario.py-test_store_then_look_up_again_{n}-*")
        harness_dir = tmp_path / f"harness-{n}"
        with recording(harness_dir):
            h = Harness(RUNNER_GEOMETRY)
            h.scenario(n)
            h.close()
        runner, harness = _episodes(runner_dir), _episodes(harness_dir)
        assert runner == harness, n
        assert [e[0] for e in runner] == ["cold", verdict]
    assert _episodes(runner_dir)[1][4:6] == (960, 960)  # E, external of the 1,000 hit


def test_a_scheduler_that_outlives_its_test_keeps_recording(tmp_path: Path) -> None:
    """A module-scoped fixture's scheduler records both tests into the folder of the test
    that built it; nothing the second test did is lost, and the summary says so."""
    out = tmp_path / "kt"
    r = _pytest(tmp_path, "--keytrace", str(out), "-k", "shared")
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:]
    [folder] = out.iterdir()
    assert folder.name.startswith("test_cases.py-test_shared_first-")
    report = diff(open_trace(str(folder)), all_episodes=True)
    # both tests' prime-and-resend (the second prime starts from the first's GPU cache)
    assert [v.verdict for v in report.episodes] == ["cold", "hit", "cold", "hit"]
    assert "keytrace: 1 of 2 tests recorded a trace" in r.stdout
    assert "1 scheduler(s) outlived their test" in r.stdout
