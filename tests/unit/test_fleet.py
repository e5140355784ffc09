"""``keytrace diff --by engine`` on a generated fleet trace whose mismatches are planted on
known engines (tools/gen_trace.py writes them down apart from the differ)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from keytrace.analysis.diff import diff
from keytrace.analysis.fleet import by_engine
from keytrace.format.reader import open_trace
from tests.generated import fleet_trace

ROOT = Path(__file__).resolve().parents[2]
ENGINES = 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    out = fleet_trace(
        tmp_path_factory.mktemp("fleet") / "trace", rows=150_000, engines=ENGINES, planted=3, seed=4
    )
    planted = json.loads(Path(f"{out}.planted.json").read_text())
    return out, planted


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keytrace", "diff", *args], capture_output=True, text=True
    )


def test_each_engine_has_its_planted_mismatches_worst_first(
    fleet: tuple[Path, list[list[str]]],
) -> None:
    trace, planted = fleet
    want = Counter(engine for engine, _req in planted)
    report = by_engine(diff(open_trace(str(trace))))
    assert len(report.engines) == ENGINES
    got = {e.engine: e.mismatches for e in report.engines}
    assert got == {f"engine-{i}": want.get(f"engine-{i}", 0) for i in range(ENGINES)}
    # worst first: mismatches never increase down the list
    counts = [e.mismatches for e in report.engines]
    assert counts == sorted(counts, reverse=True)
    planted_pairs = {tuple(p) for p in planted}
    for e in report.engines:
        assert (e.first_mismatch is None) == (e.mismatches == 0)
        if e.first_mismatch is not None:
            assert (e.engine, e.first_mismatch.req_id) in planted_pairs
            assert e.rule_tokens > 0 and all(r.engine == e.engine for r in e.rule_rows)
        else:
            assert e.rule_tokens == 0
        # each engine's counts add up to the trace's
    totals: Counter[str] = Counter()
    for e in report.engines:
        totals.update(e.counts)
    assert dict(totals) == diff(open_trace(str(trace))).counts


def test_by_engine_text_and_json(fleet: tuple[Path, list[list[str]]]) -> None:
    trace, planted = fleet
    text = _cli("--by", "engine", str(trace))
    assert text.returncode == 1, text.stderr
    n_bad = len({e for e, _ in planted})
    first = text.stdout.splitlines()[0]
    assert first == f"MISMATCH: {n_bad} of {ENGINES} engines with mismatches"
    assert "first: request " in text.stdout and "RULE " in text.stdout
    doc = json.loads(_cli("--by", "engine", "--json", str(trace)).stdout)
    assert doc["verdict"] == "mismatch" and len(doc["engines"]) == ENGINES
    assert doc["engines"][0]["mismatches"] == max(e["mismatches"] for e in doc["engines"])


def test_an_agreeing_engine_has_no_first_mismatch(tmp_path: Path) -> None:
    """One engine whose resend hits: AGREE, no first mismatch, no RULE row (exit 0); and
    the committed v3 trace's one mismatch, named in its engine's row (exit 1)."""
    from tests.factories import new_builder

    b = new_builder(tmp_path / "t")
    b.prime("r1", "c", 64)
    b.episode("r2", 64, external=48, scans=[(0, [(0, "HIT"), (1, "HIT"), (2, "HIT")])], chain="c")
    b.close()
    out = _cli("--by", "engine", str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("AGREE: 0 of 1 engine with mismatches\n")
    assert "first:" not in out.stdout and "RULE " not in out.stdout.split("\n", 2)[2]
    v3 = _cli("--by", "engine", str(ROOT / "tests" / "data" / "v3"))
    assert v3.returncode == 1
    assert "first: request r3, group 2, chunk 61 (MISS): never_offered" in v3.stdout
