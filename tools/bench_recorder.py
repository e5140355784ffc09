"""Recorder overhead on concurrent traffic through the real scheduler: recording on vs off.

    python tools/bench_recorder.py [--rounds 5] [--seed 0]

The workload (keytrace.vllm.workload, dsv4 geometry, chunked prefill at 8,192 tokens a
step): conversations whose prompts grow to ~32K tokens, shared system prompts, resends,
many requests in flight, GPU cache drops with preemption, a small CPU tier (evictions),
async scheduling, two engines. The same seeded traffic runs with recording on and off,
interleaved round by round; the wall time of a recorded round includes the final flush of
every part. Prints the median ratio on/off, bytes per key row and rows per second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def spec(seed: int):  # type: ignore[no-untyped-def]
    from keytrace.vllm.workload import WorkloadSpec

    # dsv4: A = 256 tokens. System prompts of 8-40 chunks, 2-4 turns of 2-24 chunks: up to
    # 40 + 4*24 = 136 chunks = ~35K tokens; ~70 requests over two engines.
    return WorkloadSpec(
        geometry="dsv4",
        seed=seed,
        conversations=24,
        turns=(2, 4),
        system_chunks=(8.0, 40.0),
        message_chunks=(2.0, 24.0),
        gpu_flush_steps=40,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import polars as pl

    from keytrace.cli._common import quiet_host_logs

    quiet_host_logs()
    from keytrace.format.reader import open_trace
    from keytrace.vllm.workload import run_workload

    s = spec(args.seed)
    warm = run_workload(s, None)  # imports, caches and the model config outside the timing
    times: dict[str, list[float]] = {"off": [], "on": []}
    key_rows = rows_total = bytes_on_disk = 0
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            d = tempfile.mkdtemp(prefix="kt-bench-") if mode == "on" else None
            t = time.perf_counter()
            run_workload(s, d)  # recording: the final flush happens inside, on exit
            times[mode].append(time.perf_counter() - t)
            if d is not None:
                trace = open_trace(d)
                # v2: one lookup row per scan, its calls counted in n_keys
                key_rows = sum(trace.rows(k) for k in ("store", "load")) + int(
                    trace.frame("lookup").select(pl.col("n_keys").sum()).collect().item() or 0
                )
                rows_total = sum(trace.rows(k) for k in trace.kinds)
                bytes_on_disk = sum(os.path.getsize(p.path) for p in trace.parts)
                shutil.rmtree(d, ignore_errors=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(
        f"workload: {warm.requests} requests ({warm.turns} turns, {warm.resends} resends), "
        f"longest prompt {warm.longest_prompt:,} tokens, {warm.steps} steps, 2 engines, "
        f"budget 8,192 tokens/step"
    )
    print(f"off   median {off:.3f} s  {[f'{x:.3f}' for x in times['off']]}")
    print(f"on    median {on:.3f} s  {[f'{x:.3f}' for x in times['on']]}")
    print(f"ratio {on / off:.3f}   (goal <= 1.05)")
    print(f"key rows {key_rows:,}; all rows {rows_total:,}; bytes on disk {bytes_on_disk:,}")
    print(
        f"bytes per key row {bytes_on_disk / max(key_rows, 1):.1f}   (goal <= 40; all parts / key rows)"
    )
    print(f"key rows per second while recording {key_rows / on:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
