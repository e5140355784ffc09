"""Recorder overhead on the real scheduler: recording on vs off, interleaved, same run.

    python tools/bench_recorder.py [--rounds 5] [--max-tokens 100000]

Workload per round (dsv4 geometry, chunked prefill at 8,192 tokens a step): prompts of
100k, 60k, 30k and 12k tokens on distinct chains, then the GPU prefix cache is reset and
all four are resent (CPU hits, loads), i.e. every store, lookup and load path is exercised.
Wall time covers the workload and, when recording, the final flush of every part.
Prints the ratio on/off (median of rounds), bytes per key row and rows per second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def workload(h, lengths: list[int]) -> None:  # type: ignore[no-untyped-def]
    for chain, n in enumerate(lengths):
        h.submit(n, chain=chain)
        h.run_until_idle()
    h.reset_gpu_prefix_cache()
    for chain, n in enumerate(lengths):
        h.submit(n, chain=chain)
        h.run_until_idle()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=100_000)
    args = ap.parse_args()

    from keytrace.analysis.geometry import DSV4
    from keytrace.format.reader import open_trace
    from keytrace.vllm.harness import Harness
    from keytrace.vllm.patches import recording

    top = args.max_tokens
    lengths = [top, int(top * 0.6), int(top * 0.3), int(top * 0.12)]
    geo = DSV4.with_(max_model_len=max(131_072, top + 1024))
    times: dict[str, list[float]] = {"off": [], "on": []}
    key_rows = bytes_on_disk = rows_total = 0
    Harness(geo, max_prompt_tokens=top)  # warm imports and caches outside the timing
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            if mode == "off":
                h = Harness(geo, max_prompt_tokens=top)
                t = time.perf_counter()
                workload(h, lengths)
                times["off"].append(time.perf_counter() - t)
                continue
            d = tempfile.mkdtemp(prefix="kt-bench-")
            with recording(d):
                h = Harness(geo, max_prompt_tokens=top)
                t = time.perf_counter()
                workload(h, lengths)
                from keytrace.vllm.patches import recorders

                for rec in recorders():
                    rec.close()  # the final flush is part of the cost
                times["on"].append(time.perf_counter() - t)
            trace = open_trace(d)
            key_rows = sum(trace.rows(k) for k in ("lookup", "store", "load"))
            rows_total = sum(trace.rows(k) for k in trace.kinds)
            bytes_on_disk = sum(os.path.getsize(p.path) for p in trace.parts)
            shutil.rmtree(d, ignore_errors=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"rounds {args.rounds}, prompts {lengths} (+ resend after a GPU-only reset)")
    print(f"off   median {off:.3f} s  {[f'{x:.3f}' for x in times['off']]}")
    print(f"on    median {on:.3f} s  {[f'{x:.3f}' for x in times['on']]}")
    print(f"ratio {on / off:.3f}   (goal <= 1.05)")
    print(f"key rows {key_rows:,}; all rows {rows_total:,}; bytes on disk {bytes_on_disk:,}")
    print(
        f"bytes per key row {bytes_on_disk / max(key_rows, 1):.1f}   (goal <= 40; all parts / key rows)"
    )
    print(f"rows per second while recording {rows_total / on:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
