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
        ["doctor", "--verify"],
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


def _refused(argv: list[str], tmp_path: Path) -> str:
    """Run ``argv`` without vLLM; it must be exit 2 for its own reason, not for the missing
    vLLM (so it was refused before vLLM would have loaded), and never an unexpected error."""
    args = [
        a.format(
            tmp=tmp_path, good=_trace(tmp_path, mismatch=False), bad=_trace(tmp_path, mismatch=True)
        )
        for a in argv
    ]
    r = run_blocked("vllm,torch", MAIN, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    assert "pip install" not in r.stderr, r.stderr  # refused as input, before vLLM
    assert len([line for line in r.stderr.splitlines() if line.strip()]) <= 3, r.stderr
    return r.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["sweep", "--lengths", "0"], "a prompt has at least 1 token"),
        (["sweep", "--lengths", "0:4"], "a prompt has at least 1 token"),
        (["sweep", "--lengths", "200000"], "over the max_model_len of geometry dsv4 (131,072)"),
        (
            ["sweep", "--lengths", "100", "--prime-length", "20000", "--geometry", "small"],
            "over the max_model_len of geometry small (16,384)",
        ),
        (["sweep", "--lengths", "100", "--budget", "0"], "'--budget': 0 is not in the range"),
        (["sweep", "--lengths", "100", "--blocks-per-chunk", "0"], "'--blocks-per-chunk': 0"),
        (["workload", "--engines", "0"], "'--engines': 0 is not in the range"),
        (["workload", "--conversations", "0"], "'--conversations': 0 is not in the range"),
        (["workload", "--cpu-chunks", "-5"], "'--cpu-chunks': -5 is not in the range"),
        (["workload", "--resend-rate", "1.5"], "'--resend-rate': 1.5 is not in the range"),
        (["workload", "--reroute-rate", "-0.1"], "'--reroute-rate': -0.1 is not in the range"),
        (["workload", "--store-delay", "0"], "'--store-delay': 0 is not in the range"),
        (["workload", "--budget", "0"], "'--budget': 0 is not in the range"),
        (["workload", "--system-prompts", "-1"], "'--system-prompts': -1 is not in the range"),
        (["workload", "--turns", "0:3"], "bad range '0:3': LOW must be at least 1"),
        (["summary", "{bad}", "--episodes", "-1"], "'--episodes': -1 is not in the range"),
        (
            ["fuzz", "-o", "{tmp}/f", "--recurrent", "--drafter", "eagle"],
            "--recurrent draws recurrent hybrids without a drafter",
        ),
    ],
)
def test_bad_values_are_usage_errors_before_vllm(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    assert said in _refused(argv, tmp_path)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["diff", "{bad}", "--html", "{tmp}/no/dir/map.html"],
            "folder {tmp}/no/dir does not exist",
        ),
        (["diff", "{bad}", "--html", "{tmp}"], "is a folder, not a file"),
        (["sweep", "--lengths", "100", "--csv", "{tmp}/no/s.csv"], "folder {tmp}/no does not"),
        (["sweep", "--lengths", "100", "--parquet", "{tmp}/no/s.pq"], "folder {tmp}/no does not"),
        (["sweep", "--lengths", "100", "--plot", "{tmp}/no/s"], "folder {tmp}/no does not"),
        (["fixture", "{bad}", "-o", "{tmp}/no/test_x.py"], "folder {tmp}/no does not exist"),
        (["compact", "{bad}", "-o", "{tmp}/no/c"], "folder {tmp}/no does not exist"),
        (["demo", "-o", "{tmp}/no/demo"], "folder {tmp}/no does not exist"),
        (["workload", "-o", "{tmp}/no/w"], "folder {tmp}/no does not exist"),
        (["replay", "{bad}", "-o", "{tmp}/no/r"], "folder {tmp}/no does not exist"),
        (["minimize", "{bad}", "-o", "{tmp}/no/m"], "folder {tmp}/no does not exist"),
        (["report", "{bad}", "-o", "{tmp}/no/r"], "folder {tmp}/no does not exist"),
        (["fuzz", "-o", "{tmp}/no/f"], "folder {tmp}/no does not exist"),
    ],
)
def test_an_output_path_in_a_missing_folder_is_refused_up_front(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    """Every command that writes a file or folder refuses one whose folder is missing
    before it reads or runs anything, naming the folder (not a temporary file's name)."""
    err = _refused(argv, tmp_path)
    assert said.format(tmp=tmp_path) in err, err
    assert ".tmp-" not in err
    assert not (tmp_path / "no").exists()  # nothing created on the way


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["demo", "-o", "{tmp}/full"], "full is not empty; pass a new --out folder"),
        (["report", "{good}", "-o", "{tmp}/r"], "no mismatch in this trace: nothing to report"),
        (["minimize", "{good}", "-o", "{tmp}/m"], "is a hit, not a mismatch: nothing to minimize"),
    ],
)
def test_lab_commands_refuse_before_loading_vllm(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    """What needs no vLLM to refuse (a used folder, a trace without a mismatch: a diff, core
    only) is refused first: without vLLM the refusal, not the missing vLLM, is the error,
    and nothing is written."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert said in _refused(argv, tmp_path)
    assert not (tmp_path / "r").exists() and not (tmp_path / "m").exists()
