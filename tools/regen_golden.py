"""Regenerate the golden files under tests/golden/ from what produces them, byte for byte.

    python tools/regen_golden.py           # rewrite them
    python tools/regen_golden.py --check   # exit 1 if any differs (what tests/unit/test_golden.py checks)

Each golden is one generator's output on fixed input, with no vLLM: the committed schema-2
trace (tests/data/v2: the stock 0.33.0 MTP peek miss at 1,030 tokens on ``small``) and,
for ``report.md``, canned sweep rows (a renderer's input, not a claim about vLLM):

- ``fixture_small_1030.py.txt``: the keytrace pytest regression (`keytrace fixture`);
- ``standalone_small_1030.py.txt``: the standalone vLLM regression (`keytrace report`);
- ``report_small_1030.md``: ``report.md``, with a candidate fix's sweep;
- ``chunkmap_small_1030.json``: the data the chunk map page embeds (`keytrace diff --html`).

A change that moves one of them is reviewed as a diff of the golden file: regenerate, read
the diff, commit both.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keytrace.analysis.results import EpisodeVerdict
    from keytrace.format.reader import Trace

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
TRACE = ROOT / "tests" / "data" / "v2"


def fixture() -> str:
    from keytrace.analysis.geometry import SMALL
    from keytrace.analysis.plan import ReplayPlan
    from keytrace.report.fixture import render_fixture

    plan = ReplayPlan(
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
    return render_fixture(plan, xfail_reason="known upstream bug")


def _mismatch() -> tuple[Trace, EpisodeVerdict]:
    from keytrace.analysis.diff import diff
    from keytrace.format.reader import open_trace

    trace = open_trace(str(TRACE))
    v = diff(trace).first_mismatch
    assert v is not None
    return trace, v


def _evidence(v: EpisodeVerdict, header: dict[str, Any]) -> str:
    from keytrace.report.text import render_episode

    out = io.StringIO()
    render_episode(v, out, header=header)
    return out.getvalue()


def standalone() -> str:
    import dataclasses

    from keytrace.analysis.plan import plan_for
    from keytrace.report.standalone import render_vllm_regression

    trace, v = _mismatch()
    plan = dataclasses.replace(plan_for(trace, v), keytrace_version="0.1.0")
    return render_vllm_regression(plan, evidence=_evidence(v, trace.header))


def report_md() -> str:
    from keytrace.analysis.lengthrule import length_rule
    from keytrace.analysis.sweep import SweepRow, compare_fix
    from keytrace.report.markdown import ReportPage, render_report

    trace, v = _mismatch()

    def row(n: int, fixed: bool) -> SweepRow:
        E = (n - 1) // 64 * 64
        miss = not fixed and 0 < n - E < 16  # the class: P - E < tpc(MTP) = 16
        return SweepRow(
            length=n,
            budget=512,
            blocks_per_chunk=1,
            E=E,
            external=0 if miss else E,
            verdict="mismatch" if miss else "hit",
            binding_group=2 if miss else None,
            terminal_chunk=E // 16 - 3 if miss else None,
            cause="never_offered" if miss else None,
            seconds=0.0,
        )

    lengths = range(966, 1094, 4)
    stock = [row(n, False) for n in lengths]
    fixed = [row(n, True) for n in lengths]
    page = ReportPage(
        v=v,
        header=trace.header,
        keytrace_version="0.1.0",
        prime_lengths=[1030],
        episode_length=1030,
        evidence=_evidence(v, trace.header),
        rule=length_rule(stock, 64),
        step=4,
        fixture="test_keytrace_recorded_1030_00000000.py",
        standalone="test_offload_regression_1030_00000000.py",
        trace="tests/data/v2",
        html="chunkmap.html",
        plot="sweep.png",
        fix=compare_fix(stock, fixed, "eagle_proof_key"),
        fix_text="the candidate fix's description",
    )
    return render_report(page)


def chunkmap() -> str:
    from keytrace.analysis.diff import diff
    from keytrace.format.reader import open_trace
    from keytrace.report.html import page_data

    data = page_data(diff(open_trace(str(TRACE)), maps=200))
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "fixture_small_1030.py.txt": fixture,
    "standalone_small_1030.py.txt": standalone,
    "report_small_1030.md": report_md,
    "chunkmap_small_1030.json": chunkmap,
}
"""Golden file name -> the generator of its text."""


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    args = ap.parse_args()
    stale = []
    for name, generate in GENERATORS.items():
        text = generate()
        path = GOLDEN / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        path.write_text(text)
        print(f"wrote {path}")
    for name in stale:
        print(f"stale: {GOLDEN / name} (run python tools/regen_golden.py and read the diff)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
