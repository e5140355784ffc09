"""Engines that share a tier, or do not (issue 40 items 2-3), on the real scheduler: each
engine a process of its own (`tests.integration.identity_engine`, the CPU lab's Harness
with vLLM's real tiering manager and ``fs`` tier in a temporary folder), recording into one
trace folder, with its own PYTHONHASHSEED and hash function, one after the other.

Geometry ``small`` (FA tpc 64): a prompt of 675 tokens has its own boundary at 640. None
of these cases may read "cold: not stored anywhere" for the engine that came second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import engine_headers, open_trace  # noqa: E402
from keytrace.judge.definitions import Verdict  # noqa: E402
from keytrace.judge.identity import Finding  # noqa: E402

TOKENS = 675
E = 640
ROOT = Path(__file__).resolve().parents[2]


def _engine(trace: Path, disk: Path, seed: str | None, *args: str) -> str:
    """Run one engine to completion; returns its stderr (vLLM's and keytrace's log)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "tests.integration.identity_engine", str(trace)]
    done = subprocess.run(
        [*command, str(disk), str(TOKENS), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _two(tmp_path: Path, a: tuple[str | None, ...], b: tuple[str | None, ...]) -> Path:
    """Engine A then engine B into one trace, sharing one fs root; returns the trace."""
    trace, disk = tmp_path / "t", tmp_path / "disk"
    _engine(trace, disk, a[0], *[x for x in a[1:] if x])
    _engine(trace, disk, b[0], *[x for x in b[1:] if x])
    return trace


def _second(trace: Path) -> set[int]:
    """The recorder instance of the engine that ran second (the later ``started_ns``)."""
    started = {
        p.source["instance_id"]: p.source["started_ns"] for p in open_trace(str(trace)).parts
    }
    assert len(started) == 2
    return {max(started, key=lambda i: started[i])}


def _rows(report: object, engine_of: dict[int, str], insts: set[int]) -> dict[str, int]:
    lost = report.lost  # type: ignore[attr-defined]
    names = {engine_of[i] for i in insts}
    return {r.label: r.tokens for r in lost.rows if r.engine in names}


def _engine_names(trace: Path) -> dict[int, str]:
    """instance id -> the engine name the token table uses (engine id)."""
    out = {}
    for p in open_trace(str(trace)).parts:
        out[p.source["instance_id"]] = p.source.get("engine_id") or p.source["instance"]
    return out


def test_same_seed_engine_b_is_served_from_a_s_files(tmp_path: Path) -> None:
    trace = _two(tmp_path, ("7",), ("7",))
    report = diff(open_trace(str(trace)), all_episodes=True)
    assert report.identity == [] and report.verdict == "agree"
    b = _second(trace)
    mine = [v for v in report.episodes if v.instance_id in b and v.verdict != Verdict.DEFERRED]
    # B's lookup was served from the files A wrote: a hit at A's boundary, never cold
    assert [(v.verdict, v.E, v.external_tokens) for v in mine] == [(Verdict.HIT, E, E)]
    rows = _rows(report, _engine_names(trace), b)
    assert rows.get("offload tier, promoted from secondary tier 0") == E
    assert "cold: not stored anywhere" not in rows
    assert main(["diff", str(trace)]) == 0


@pytest.mark.parametrize(
    ("a", "b", "field"),
    [
        (("7",), ("8",), "none_hash"),  # different PYTHONHASHSEED
        (("7",), ("7", "--algo", "sha256_cbor"), "hash_algo"),  # different hash functions
    ],
    ids=["seeds", "hash-functions"],
)
def test_engines_that_hash_differently_are_one_finding(
    tmp_path: Path, a: tuple[str, ...], b: tuple[str, ...], field: str
) -> None:
    trace = _two(tmp_path, a, b)
    t = open_trace(str(trace))
    report = diff(t, all_episodes=True)
    (finding,) = report.identity
    assert finding.finding is Finding.HASH_IDENTITY and finding.field == field
    assert finding.tier.startswith("fs:") and len(finding.engines) == 2
    assert "PYTHONHASHSEED" in finding.fix or "hash-algo" in finding.fix
    assert str(open_trace(str(trace)).parts[0].source["engine_id"]) in " ".join(finding.engines)
    assert report.verdict == "mismatch"
    # B's tokens are named for the cause, not "not stored anywhere"
    rows = _rows(report, _engine_names(trace), _second(trace))
    assert rows == {"cold: an engine on its shared tier hashes differently (hash identity)": TOKENS}
    assert main(["diff", str(trace)]) == 1
    # the seed itself is never written: only where it came from, and a digest
    for header, _ in engine_headers(t).values():
        ident = header["hash_identity"]
        assert ident["seed_source"] == "PYTHONHASHSEED"
        assert "7" not in ident.values() and "seed" not in ident  # a source, never the seed
        assert set(ident) >= {"hash_algo", "none_hash", "canary", "lookahead_tokens"}


def test_a_restart_with_a_random_xxhash_seed(tmp_path: Path) -> None:
    pytest.importorskip("xxhash")
    trace, disk = tmp_path / "t", tmp_path / "disk"
    _engine(trace, disk, None, "--algo", "xxhash")
    # the restart, with the live alarm on: it knows the first run from the trace folder
    log = _engine(trace, disk, None, "--algo", "xxhash", "--alarm")
    assert log.count("keytrace: hash_identity:") == 1, log[-2000:]
    t = open_trace(str(trace))
    seeds = {h["hash_identity"]["seed_source"] for h, _ in engine_headers(t).values()}
    assert seeds == {"random"}
    report = diff(t, all_episodes=True)
    (finding,) = report.identity
    assert finding.field == "none_hash" and "PYTHONHASHSEED" in finding.fix
    rows = _rows(report, _engine_names(trace), _second(trace))
    assert rows == {"cold: an engine on its shared tier hashes differently (hash identity)": TOKENS}
    assert main(["diff", str(trace)]) == 1
    assert main(["doctor", "--trace", str(trace)]) == 0  # warns; recording still works


def test_dp_ranks_with_private_cpu_tiers_are_routing(tmp_path: Path) -> None:
    trace = _two(tmp_path, ("7", "--dp", "0", "--cpu-only"), ("7", "--dp", "1", "--cpu-only"))
    t = open_trace(str(trace))
    scopes = [h["tier_scope"] for h, _ in engine_headers(t).values()]
    regions = {s["cpu"]["identity"] for s in scopes}
    assert len(regions) == 2 and not any(s["cpu"]["shared"] for s in scopes)
    assert {s["cpu"]["dp_rank"] for s in scopes} == {0, 1}
    report = diff(t, all_episodes=True)
    assert report.identity == [] and report.verdict == "agree"
    rows = _rows(report, _engine_names(trace), _second(trace))
    # stored on dp0, missed on dp1: by design for a private tier, and named so
    assert rows.get("cold: stored on another engine's private tier (routing)") == E
    assert rows.get("cold: not stored anywhere", 0) == TOKENS - E
