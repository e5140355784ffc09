"""Sweep throughput through the real scheduler on dsv4, against one bare scenario run.

    python tools/bench_sweep.py [--lengths 100]

Measured side by side in one run: (a) bare: a fresh harness and one prime/reset/resend
scenario per length, nothing recorded; (b) sweep: keytrace's run_one per length (the same
plus recording, reading the trace back and diffing it). Prints lengths per second, the
ratio sweep/bare, and the goal (100 lengths in <= 60 s on 2 cores).
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--lengths", type=int, default=100)
    args = ap.parse_args()
    from keytrace.analysis.geometry import DSV4
    from keytrace.vllm.lab.harness import Harness
    from keytrace.vllm.lab.sweep import run_one

    lengths = [17_900 + 7 * i for i in range(args.lengths)]
    Harness(DSV4, max_prompt_tokens=lengths[0]).scenario(lengths[0])  # warm imports and caches
    bare = sweep = 0.0
    for i, n in enumerate(lengths):  # interleaved, so drift hits both alike
        order = ("bare", "sweep") if i % 2 == 0 else ("sweep", "bare")
        for what in order:
            t = time.perf_counter()
            if what == "bare":
                Harness(DSV4, max_prompt_tokens=n).scenario(n)
                bare += time.perf_counter() - t
            else:
                run_one(DSV4, n)
                sweep += time.perf_counter() - t
    k = len(lengths)
    print(f"lengths {k} ({lengths[0]:,}..{lengths[-1]:,}), dsv4, budget 8,192")
    print(f"bare scenario   {bare:7.1f} s  {k / bare:6.2f} lengths/s")
    print(f"keytrace sweep  {sweep:7.1f} s  {k / sweep:6.2f} lengths/s")
    print(f"ratio sweep/bare {sweep / bare:.2f}")
    print(f"100 lengths would take {100 * sweep / k:.1f} s  (goal <= 60 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
