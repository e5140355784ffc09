"""Replay and generated regressions on the real vLLM scheduler.

Proof both ways: fixtures generated from traces recorded with an injected historical bug
are red when the bug is injected (KEYTRACE_INJECT) and green on stock vLLM.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import DSV4, SMALL, Geometry, synthetic_header  # noqa: E402
from keytrace.analysis.plan import plan_from_trace  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.report.fixture import file_name, render_fixture  # noqa: E402
from keytrace.vllm.lab.replay import replay  # noqa: E402
from keytrace.vllm.lab.sweep import run_one  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INJECTED = [
    (DSV4, 18_877, "pre48911"),
    (DSV4, 18_877, "no_eagle_plus1"),
    (SMALL, 1_024, "pre48911"),
    (SMALL, 1_024, "no_eagle_plus1"),
]


def _pytest(
    folder: Path, inject: str | None, fix: str | None = None, junit: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KEYTRACE_INJECT", "KEYTRACE_FIX")}
    if inject:
        env["KEYTRACE_INJECT"] = inject
    if fix:
        env["KEYTRACE_FIX"] = fix
    # the keytrace under test, whatever else is installed
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(folder),
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(folder),
            *([f"--junitxml={junit}"] if junit else []),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )


def test_generated_fixtures_red_with_bug_green_without(tmp_path: Path) -> None:
    folders: dict[str, Path] = {}
    for geo, n, inject in INJECTED:
        trace = tmp_path / f"trace-{geo.name}-{inject}"
        row = run_one(geo, n, inject=inject, keep_dir=str(trace))
        assert row.verdict == "mismatch"
        plan = plan_from_trace(open_trace(str(trace)))
        text = render_fixture(plan)
        folder = folders.setdefault(inject, tmp_path / f"fixtures-{inject}")
        folder.mkdir(exist_ok=True)
        (folder / file_name(plan, text)).write_text(text)
    for inject, folder in folders.items():
        red = _pytest(folder, inject)
        assert red.returncode == 1 and "2 failed" in red.stdout, red.stdout[-3000:]
        # the failure explains itself: binding group, terminal chunk and cause
        assert "binding group 2 (SWA, MTP), terminal chunk" in red.stdout
        assert "never offered by the store path" in red.stdout
        green = _pytest(folder, None)
        assert green.returncode == 0 and "2 passed" in green.stdout, green.stdout[-3000:]


@pytest.mark.parametrize(
    ("geo", "n", "inject"),
    [
        (DSV4, 17_975, None),
        (DSV4, 18_877, None),
        (SMALL, 1_030, None),
        (SMALL.with_(blocks_per_chunk=2, max_num_batched_tokens=96), 1_000, None),
        (DSV4.with_(max_num_batched_tokens=2048), 18_877, "pre48911"),
    ],
    ids=[
        "dsv4-17975",
        "dsv4-18877",
        "small-1030",
        "small-bpc2-chunked-1000",
        "dsv4-chunked-pre48911",
    ],
)
def test_replay_reproduces_recorded_run(
    geo: Geometry, n: int, inject: str | None, tmp_path: Path
) -> None:
    row = run_one(geo, n, inject=inject, keep_dir=str(tmp_path / "t"))
    plan = plan_from_trace(open_trace(str(tmp_path / "t")))
    assert plan.prime_lengths == [n] and plan.episode_length == n
    result = replay(
        plan.geometry,
        plan.prime_lengths,
        plan.episode_length,
        inject=inject,
        trace_dir=tmp_path / "r",
    )
    assert result.external_tokens == plan.recorded_external == row.external
    assert result.steps == plan.recorded_steps
    assert (result.verdict, result.terminal_chunk) == (row.verdict, row.terminal_chunk)


def test_replay_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_one(DSV4, 17_975, keep_dir=str(tmp_path / "t"))
    assert main(["replay", str(tmp_path / "t")]) == 1
    out = capsys.readouterr().out
    assert "step schedule: identical to the recorded one" in out
    assert "binding group 2 (SWA, MTP), terminal chunk 277" in out
    run_one(DSV4, 18_877, keep_dir=str(tmp_path / "h"))
    assert main(["replay", str(tmp_path / "h")]) == 0


def test_replay_and_fixture_from_the_two_compacted_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_one(SMALL, 1030, keep_dir=str(tmp_path / "t"))
    assert main(["compact", str(tmp_path / "t"), "-o", str(tmp_path / "c")]) == 0
    two = [str(tmp_path / "c" / "store.parquet"), str(tmp_path / "c" / "lookup.parquet")]
    capsys.readouterr()
    assert main(["replay", *two]) == 1
    captured = capsys.readouterr()
    assert "step schedule: not compared (no step rows in the trace)" in captured.out
    assert "pass its step.parquet too" in captured.err
    assert main(["replay", *two, str(tmp_path / "c" / "step.parquet")]) == 1
    assert "step schedule: identical to the recorded one" in capsys.readouterr().out
    assert main(["fixture", *two, "-o", str(tmp_path / "f") + "/"]) == 0
    assert len(list((tmp_path / "f").glob("test_keytrace_*.py"))) == 1


def test_replay_refuses_other_vllm_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.factories import new_builder

    b = new_builder(tmp_path / "t", header={**synthetic_header(SMALL), "vllm_version": "0.34.0"})
    b.geometry = SMALL
    b.prime("r1", "c", 1000)
    b.episode("r2", 1000, external=0, chain="c", scans=[(0, [(0, "MISS")])])
    b.close()
    assert main(["replay", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "recorded on vLLM 0.34.0" in err and len(err.strip().splitlines()) == 1


def test_committed_regressions_regenerate_byte_identically() -> None:
    # tools/regen_regressions.py is their only source: recorded afresh, planned, rendered
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from regen_regressions import OUT, REGRESSIONS, render
    finally:
        sys.path.remove(str(ROOT / "tools"))
    committed = {p.name for p in OUT.glob("test_keytrace_*.py")}
    wanted = dict(render(r) for r in REGRESSIONS)
    assert committed == set(wanted)  # names carry the true content hash
    for name, text in wanted.items():
        assert (OUT / name).read_text() == text, name
        assert name.endswith(f"_{hashlib.sha256(text.encode()).hexdigest()[:8]}.py")


def _failure_messages(junit: Path) -> dict[str, str]:
    """Each failed test's name and the first word of its failure message, from pytest's
    JUnit XML (the terminal layout of a strict XPASS differs between pytest versions)."""
    return {
        case.get("name", ""): (failure.get("message") or "").split(" ", 1)[0]
        for case in ET.parse(junit).getroot().iter("testcase")
        for failure in case.findall("failure")
    }


@pytest.mark.parametrize(
    ("fix", "fixed"),
    [
        ("eagle_proof_key", ["test_offload_hit_recorded_17975", "test_offload_hit_recorded_18000"]),
        ("promotion_pins_prefix", ["test_offload_hit_recorded_547"]),
    ],
)
def test_committed_regressions_pass_with_the_candidate_fix(
    tmp_path: Path, fix: str, fixed: list[str]
) -> None:
    """Each strict-xfail regression passes under its candidate fix, which strict xfail
    reports as XPASS(strict), and only those: the two of the stock MTP peek miss (17,975: the
    resend; 18,000: the next turn keying the peek the previous turn could not) under
    eagle_proof_key, the tiered promotion livelock (547 tokens against a 12-chunk CPU tier
    over an fs tier) under promotion_pins_prefix. On stock vLLM all four are red (the
    recurrent state that ends no chunk has no candidate fix yet)."""
    folder = tmp_path / "regressions"
    shutil.copytree(Path(__file__).resolve().parents[1] / "regressions", folder)
    junit = tmp_path / "fixed.xml"
    r = _pytest(folder, None, fix=fix, junit=junit)
    assert r.returncode == 1, r.stdout[-3000:]
    assert _failure_messages(junit) == dict.fromkeys(fixed, "[XPASS(strict)]"), r.stdout[-3000:]


def test_committed_regressions_are_red_on_stock_vllm(tmp_path: Path) -> None:
    folder = tmp_path / "regressions"
    shutil.copytree(Path(__file__).resolve().parents[1] / "regressions", folder)
    stock = _pytest(folder, None)
    assert stock.returncode == 0 and "4 xfailed" in stock.stdout, stock.stdout[-3000:]
