"""Exit codes never lie: 1 only for a found mismatch; everything else that goes wrong is 2
with one line on stderr (a traceback only with --debug).

Every command runs in a fresh interpreter with vLLM and torch made unimportable, the way it
runs on a laptop that only reads traces.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import TINY, new_builder
from tests.isolation import run_blocked

MAIN = """
from keytrace.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _trace(tmp_path: Path, *, mismatch: bool) -> str:
    d = tmp_path / ("bad" if mismatch else "good")
    b = new_builder(d, geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 100, swa_chunks={1: [5] if mismatch else [4, 5]})
    fa = [(c, "HIT") for c in range(6)]
    swa = [(5, "HIT"), (4, "MISS" if mismatch else "HIT")]
    if mismatch:
        swa += [(3, "MISS"), (2, "MISS"), (1, "MISS"), (0, "MISS")]
    b.episode("r2", 100, external=0 if mismatch else 96, chain="c", scans=[(0, fa), (1, swa)])
    b.close()
    return str(d)


def _one_clean_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--out", "{tmp}/demo"],
        ["sweep", "--lengths", "100"],
        ["sweep", "--lengths", "100", "--inject", "pre48911"],
        ["sweep", "--lengths", "100", "--fix", "unkeyable_peek_fallback"],
        ["sweep", "--lengths", "100", "--fix", "eagle_proof_key,window_minus_one"],
        ["fuzz", "-o", "{tmp}/fuzz", "--max-examples", "1"],
        ["minimize", "{bad}", "-o", "{tmp}/min"],
        ["report", "{bad}", "-o", "{tmp}/report"],
        ["replay", "{bad}"],
    ],
)
def test_vllm_commands_without_vllm_exit_2(tmp_path: Path, argv: list[str]) -> None:
    args = [a.format(tmp=tmp_path, bad=_trace(tmp_path, mismatch=True)) for a in argv]
    r = run_blocked("vllm,torch", MAIN, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    line = _one_clean_line(r.stderr)
    assert line.startswith("keytrace: error: ") and "pip install 'keytrace[vllm]'" in line


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["diff", "{good}"], 0),
        (["diff", "{bad}"], 1),
        (["diff", "{bad}", "--json"], 1),
        (["summary", "{bad}"], 0),
        (["header", "{bad}"], 0),
        (["compact", "{bad}", "-o", "{tmp}/c"], 0),
        (["fixture", "{bad}", "-o", "{tmp}/f.py"], 0),
        (["diff", "{tmp}/nothing-here"], 2),
        (["sweep", "--lengths", "9:1"], 2),
        (["sweep", "--lengths", "100", "--inject", "no-such-bug"], 2),
        (["frobnicate"], 2),
    ],
)
def test_every_command_without_vllm(tmp_path: Path, argv: list[str], code: int) -> None:
    good, bad = _trace(tmp_path, mismatch=False), _trace(tmp_path, mismatch=True)
    args = [a.format(tmp=tmp_path, good=good, bad=bad) for a in argv]
    r = run_blocked("vllm,torch", MAIN, *args)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    if code == 2:
        assert len([line for line in r.stderr.splitlines() if line.strip()]) <= 3, r.stderr


UNEXPECTED = """
import keytrace.analysis.summary as summary
def boom(*a, **k):
    raise RuntimeError("a bug in keytrace\\nsecond line")
summary.summarize = boom
import keytrace.cli.summary
keytrace.cli.summary.summarize = boom
from keytrace.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_an_unexpected_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    trace = _trace(tmp_path, mismatch=True)
    r = run_blocked("vllm,torch", UNEXPECTED, "summary", trace)
    assert r.returncode == 2
    line = _one_clean_line(r.stderr)
    assert line == (
        "keytrace: error: unexpected RuntimeError: a bug in keytrace (run with --debug for "
        "the traceback)"
    )
    for argv in (["--debug", "summary", trace], ["summary", trace, "--debug"]):
        r = run_blocked("vllm,torch", UNEXPECTED, *argv)
        assert r.returncode == 2 and "Traceback" in r.stderr and "a bug in keytrace" in r.stderr


@pytest.mark.parametrize("spec", ["nope", "eagle_proof_key,nope", ","])
def test_an_unknown_fix_in_a_list_is_a_usage_error(spec: str) -> None:
    """``--fix`` takes names joined by commas; one unknown name refuses the whole option
    (exit 2, naming it and the known ones) before anything is run."""
    r = run_blocked("vllm,torch", MAIN, "sweep", "--lengths", "100", "--fix", spec)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Invalid value for '--fix'" in r.stderr and "window_minus_one" in r.stderr
    assert "pip install" not in r.stderr  # refused as input, not for missing vLLM
