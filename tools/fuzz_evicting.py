"""`keytrace fuzz`'s geometries under CPU-tier pressure: does the differ stay right when
chunks are evicted? A dev check, not a product command.

    python tools/fuzz_evicting.py [--fix NAME[,NAME]] [--seed N] [--budget SECONDS]

Each case draws a geometry and a prompt as `keytrace fuzz` does, then a CPU tier of 0.2 to
2.5 times the chunks one prompt stores, and runs on the real scheduler: the prompt, a second
conversation a little longer (which evicts part of the first, or fails to store), a
GPU-only reset, then the first conversation's resend or next turn. Every episode is diffed;
the property is that none is a ``mismatch``: with evictions a shortfall must be
``explained`` (capacity), never blamed on the rules. Stock vLLM 0.33.0 fails it within
seconds (its two known disagreements, docs/findings.md); with the candidate fixes for both,
any mismatch is either a new vLLM disagreement or a false verdict of keytrace's.

Not part of `keytrace fuzz`: a finding here is not reproducible by `keytrace fixture`,
whose replay re-runs only the episode's own conversation, never the one that evicted it.
Prints the number of cases and the first mismatch (no shrinking); exit 1 when one is found.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from typing import Any

from hypothesis import HealthCheck, given, reject, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from keytrace.analysis.diff import diff
from keytrace.format.reader import open_trace
from keytrace.vllm.hook.patches import fixed, recording
from keytrace.vllm.lab.fuzz import Case, _case_strategy
from keytrace.vllm.lab.harness import Harness


class _Spent(BaseException):
    """The budget is spent: ends the search (Hypothesis lets a BaseException through)."""


def run(case: Case, frac: float, extra_blocks: int) -> list[Any]:
    """The mismatches of one evicting case (empty: none)."""
    g = case.geometry
    A = g.groups[0].block_size * g.blocks_per_chunk
    cpu = max(4, int(frac * (case.prime // A + 1) * len(g.groups)))
    other = case.prime + extra_blocks * A
    d = tempfile.mkdtemp(prefix="keytrace-evicting-")
    try:
        with recording(d):
            h = Harness(g.with_(cpu_chunks=cpu), max_prompt_tokens=max(case.episode, other) + A)
            for n, chain in ((case.prime, 0), (other, 1)):
                h.submit(n, chain=chain)
                h.run_until_idle()
            h.reset_gpu_prefix_cache()
            h.submit(case.episode, chain=0)
            h.run_until_idle()
        report = diff(open_trace(d), all_episodes=True)
        bad = [v for v in report.episodes if v.verdict == "mismatch"]
        return [(case.describe(), f"cpu {cpu} chunks", v) for v in bad]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--fix", default=None, help="candidate fixes, joined by commas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds")
    args = ap.parse_args()
    t0 = time.monotonic()
    cases, rejected, found = 0, 0, []

    @hseed(args.seed)
    @settings(
        max_examples=10**6,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(_case_strategy(False), st.floats(0.2, 2.5), st.integers(1, 3))
    def prop(case: Case, frac: float, extra_blocks: int) -> None:
        nonlocal cases, rejected
        if found or time.monotonic() - t0 > args.budget:
            raise _Spent
        try:
            bad = run(case, frac, extra_blocks)
        except Exception:  # a configuration vLLM does not build
            rejected += 1
            reject()
        cases += 1
        if bad:
            found.extend(bad)
            raise _Spent

    with fixed(args.fix), contextlib.suppress(_Spent):
        prop()
    seconds = time.monotonic() - t0
    print(f"{cases} cases ({rejected} rejected) in {seconds:.0f} s, fix {args.fix or 'none'}")
    if found:
        describe, cpu, v = found[0]
        print(f"MISMATCH: {describe}; {cpu}\n  {v.req_id}: {v.reason}")
        for n in v.needed:
            if n.cause != "resident":
                print(f"  group {n.group_id} chunk {n.chunk}: {n.cause}")
        return 1
    print("no mismatch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
