"""The fixture generator: golden text, determinism, CLI == library, and valid Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from keytrace.analysis.geometry import SMALL
from keytrace.analysis.plan import ReplayPlan, plan_from_trace
from keytrace.cli import main
from keytrace.format.reader import open_trace
from keytrace.report.fixture import file_name, literal, render_fixture

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"

PLAN = ReplayPlan(
    geometry=SMALL.to_dict(),
    prime_lengths=[1030],
    episode_length=1030,
    local_tokens=0,
    expected_E=1024,
    recorded_external=0,
    recorded_verdict="mismatch",
    binding_group=2,
    terminal_chunk=61,
    cause="never_offered",
    request="r2",
    recorded_steps=[[512, 512, 6], [512, 512, 6]],
    keytrace_version="0.1.0",
    schema_version=1,
    vllm_version="0.33.0",
)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"xfail_reason": "known upstream bug"},
        {"xfail_reason": "x" * 150, "docstring_extra": "why"},
    ],
)
def test_generated_text_is_what_the_repo_formatter_writes(kw: dict[str, str]) -> None:
    # the repository's own formatter and linter, on the generator's output as is
    text = render_fixture(PLAN, **kw)
    for cmd in (["format", "--check"], ["check"]):
        r = subprocess.run(
            [sys.executable, "-m", "ruff", *cmd, "--stdin-filename", "tests/regressions/t.py", "-"],
            input=text,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)


def test_literal_matches_the_value() -> None:
    geo = PLAN.geometry
    assert eval(literal(geo)) == geo
    assert literal([1, 2]) == "[1, 2]" and literal({}) == "{}" and literal('a"b') == '"a\\"b"'


def test_deterministic_and_content_named() -> None:
    a, b = render_fixture(PLAN), render_fixture(PLAN)
    assert a == b and file_name(PLAN, a) == file_name(PLAN, b)
    assert file_name(PLAN, a).startswith("test_keytrace_small_1030_")
    other = render_fixture(ReplayPlan(**{**PLAN.to_dict(), "episode_length": 1031}))
    assert file_name(PLAN, a) != file_name(PLAN, other)


def test_cold_episode_has_nothing_to_assert() -> None:
    with pytest.raises(ValueError, match="cold"):
        render_fixture(ReplayPlan(**{**PLAN.to_dict(), "expected_E": None}))


def test_cli_equals_library(tmp_path: Path) -> None:
    # the committed v1 trace: rendering needs no vLLM
    out = tmp_path / "t.py"
    assert main(["fixture", str(DATA / "v1"), "-o", str(out)]) == 0
    plan = plan_from_trace(open_trace(str(DATA / "v1")))
    assert out.read_text() == render_fixture(plan)
    assert (
        plan.prime_lengths,
        plan.episode_length,
        plan.expected_E,
        plan.binding_group,
        plan.terminal_chunk,
    ) == (
        [1030],
        1030,
        1024,
        2,
        61,
    )
    # refuses to overwrite without --force
    assert main(["fixture", str(DATA / "v1"), "-o", str(out)]) == 2
    assert main(["fixture", str(DATA / "v1"), "-o", str(out), "--force"]) == 0


def test_replay_needs_a_complete_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from keytrace.analysis.geometry import synthetic_header
    from tests.factories import TINY, new_builder

    header = {k: v for k, v in synthetic_header(TINY).items() if k != "max_num_batched_tokens"}
    b = new_builder(tmp_path / "t", header=header)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5], 2: [4, 5]})
    b.close()
    assert main(["replay", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "keytrace: error: cannot replay: trace header lacks 'max_num_batched_tokens', which replay needs"
    )


def test_an_output_pytest_would_not_collect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a .py file: refused before the trace is read. A .py name pytest's default
    ``python_files`` misses: written (a project may collect it), with one warning."""
    assert main(["fixture", str(DATA / "v1"), "-o", str(tmp_path / "x.txt")]) == 2
    assert "x.txt is not a .py file: pytest would not collect it" in capsys.readouterr().err
    assert not (tmp_path / "x.txt").exists()
    assert main(["fixture", str(DATA / "v1"), "-o", str(tmp_path / "case.py")]) == 0
    err = capsys.readouterr().err
    assert err == (
        "keytrace: warning: pytest collects test_*.py and *_test.py by default, not case.py: "
        "rename it or list it in python_files\n"
    )
    for name in ("test_case.py", "case_test.py"):
        assert main(["fixture", str(DATA / "v1"), "-o", str(tmp_path / name)]) == 0
        assert capsys.readouterr().err == ""


def test_a_missing_folder_is_refused_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "test_x.py"
    assert main(["fixture", str(DATA / "v1"), "-o", str(out)]) == 2
    assert f"folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    # a folder given as such (trailing slash) is still made, in an existing folder
    assert main(["fixture", str(DATA / "v1"), "-o", str(tmp_path / "new") + "/"]) == 0
    assert len(list((tmp_path / "new").glob("test_keytrace_*.py"))) == 1


def test_a_fixture_for_a_hit_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.factories import TINY, new_builder

    d = tmp_path / "t"
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    fa = [(c, "HIT") for c in range(6)]
    b.episode("r2", 100, external=96, chain="c", scans=[(0, fa), (1, [(5, "HIT"), (4, "HIT")])])
    b.close()
    assert main(["diff", str(d)]) == 0  # AGREE
    capsys.readouterr()
    assert main(["fixture", str(d), "-o", str(tmp_path / "test_hit.py")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "keytrace: note: the test is for request r2's hit episode, not a mismatch: green "
        "today, red if vLLM stops reaching E"
    ]
    # the first mismatch: nothing to say
    assert main(["fixture", str(DATA / "v1"), "-o", str(tmp_path / "test_bad.py")]) == 0
    assert capsys.readouterr().err == ""
