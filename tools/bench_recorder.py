"""Recorder overhead on concurrent traffic through the real scheduler: recording, recording
with the live alarm, and the alarm alone, each against off.

    python tools/bench_recorder.py [--rounds 5] [--seed 0]

The workload (keytrace.vllm.lab.workload, dsv4 geometry, chunked prefill at 8,192 tokens a
step): conversations whose prompts grow to ~32K tokens, shared system prompts, resends,
many requests in flight, GPU cache drops with preemption, a small CPU tier (evictions),
async scheduling, two engines. The same seeded traffic runs with recording on and off,
interleaved round by round; the wall time of a recorded round includes the final flush of
every part. Prints the median ratio of each mode to off in wall time (goal <= 1.05 each) and
in process CPU time (every thread, less sensitive to other work on the box), bytes per key
row and rows per second. Modes: ``record`` (KEYTRACE_DIR with KEYTRACE_ALARM=0),
``record+alarm`` (KEYTRACE_DIR, the default), ``alarm`` (KEYTRACE_ALARM=1 alone),
``record 1%`` (KEYTRACE_SAMPLE=0.01, alarm off).

    python tools/bench_recorder.py --instructions [--conversations 8]

counts the instructions each mode's workload executes under valgrind's callgrind instead
(one process per mode; imports and a warm-up run in the same mode are not counted, so
what a process pays once, such as the writer's first pyarrow conversion, is not charged
to the steps): the same number on a busy or an idle machine, where the timings below swing
by a third. Two counts of the same code still differ by up to ~20 million (0.15%): the
writer thread's turns move where work lands. With the alarm on, every measure also runs
what one Prometheus scrape makes the alarm do (`scrape_alarms`).

    python tools/bench_recorder.py --profile [--conversations 8]

the same workload, recording on, once per *part* of keytrace (one process each, callgrind
collecting only inside that part): the lookup hook, the episode hooks, the step hooks, the
store and load hooks, the writer's appends (inside the hooks), the writer's encoding and
part writing (its thread, here flushed at the end), the live alarm (inside the hooks).
Each is printed in instructions per scheduler step and per key, and as a share of the
scheduler's own work (the ``off`` run).

Two measures beside wall time, because one mode's round times spread by half on a shared
2-core machine: the ratio *paired by round* (each round's time over that round's ``off``,
so drift between rounds cancels; median and range), and the CPU time of the thread the
scheduler runs in (`time.thread_time`: the hooks' own work, unaffected by other processes
taking the core and by the writer's thread, whose cost is reported apart as process CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def spec(seed: int, conversations: int = 24):  # type: ignore[no-untyped-def]
    from keytrace.vllm.lab.workload import WorkloadSpec

    # dsv4: A = 256 tokens. System prompts of 8-40 chunks, 2-4 turns of 2-24 chunks: up to
    # 40 + 4*24 = 136 chunks = ~35K tokens; ~70 requests over two engines.
    return WorkloadSpec(
        geometry="dsv4",
        seed=seed,
        conversations=conversations,
        turns=(2, 4),
        system_chunks=(8.0, 40.0),
        message_chunks=(2.0, 24.0),
        gpu_flush_steps=40,
    )


INSTRUCTION_MODES = ("off", "record", "record+alarm", "record 1%", "record+alarm 1%")
_TOGGLE_C = """
#include <valgrind/callgrind.h>
void kt_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void kt_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void kt_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""

HOOK_PARTS = {
    "lookup hook": ("manager.lookup",),
    "episode hooks": (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "request_finished",
        "scan",
    ),
    "step hooks": ("build_connector_meta", "reset_cache"),
    "store and load hooks": (
        "manager.prepare_store",
        "manager.complete_store",
        "manager.prepare_load",
        "manager.complete_load",
        "manager.reset_cache",
    ),
}
"""Parts of keytrace measured apart (`--profile`): the observers of the patch table's rows,
by their ``where`` name (`keytrace.vllm.hook.table`), each with everything it calls."""
OTHER_PARTS = ("writer append", "writer encode", "alarm")
PROFILE_PARTS = (*HOOK_PARTS, *OTHER_PARTS)


def freeze_startup_heap() -> None:
    """What vLLM's engine core does once it has started (``freeze_gc_heap``: collect, then
    ``gc.freeze()``): the start-up heap (vLLM, torch, ~800K objects) leaves the collector's
    view. Without it, a full collection over that heap costs more than a short workload
    itself (about 0.5 s), and whether one lands inside a counted run depends on every
    allocation before it: it landed in recorded runs and not in ``off`` ones, and was read
    as a per-session cost of recording. Collections of what is allocated afterwards (the
    recorder's and the alarm's objects among them) are still counted, as in a server."""
    import gc

    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()


def scrape_alarms() -> None:
    """What one Prometheus scrape makes the live alarms do, counted with the run: the
    stored keys it held back are counted (`keytrace.live.state.KeyStore.stored`)."""
    from keytrace.live.registry import alarms

    for alarm in alarms():
        _ = alarm.stored


def _toggles():  # type: ignore[no-untyped-def]
    """callgrind's start/stop client requests, callable from Python: a two-function C
    library compiled here (gcc and valgrind's header), so only the workload is counted,
    not the imports and the warm-up run."""
    import ctypes
    import subprocess

    folder = tempfile.mkdtemp(prefix="kt-callgrind-lib-")
    src, lib = os.path.join(folder, "toggle.c"), os.path.join(folder, "toggle.so")
    Path(src).write_text(_TOGGLE_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
    return ctypes.CDLL(lib)


def one_run(mode: str, seed: int, conversations: int, part: str | None = None) -> None:
    """What one process run under callgrind does: imports and a warm-up run in ``mode``
    uncounted, then one run of the workload in ``mode``, counted (``part``: only inside
    that part of keytrace, `PROFILE_PARTS`)."""
    from keytrace.cli._common import quiet_host_logs

    quiet_host_logs()
    # Parts are closed by row count and at the end, not by the clock: under callgrind the
    # workload runs about 50 times slower, and a wall-clock policy (a part every 10 s, or
    # after 1 s idle) would close 50 times more parts than the same traffic does at real
    # speed (this workload is about 2 s of scheduling), charging that to recording.
    os.environ["KEYTRACE_MAX_SECONDS"] = os.environ["KEYTRACE_IDLE_SECONDS"] = "1e9"
    toggles = _toggles()
    counted = _profiled(part, toggles) if part else None
    from keytrace.live.registry import AlarmSettings
    from keytrace.vllm.lab.workload import run_workload

    s = spec(seed, conversations)
    alarm = AlarmSettings(warn=False) if "alarm" in mode else None
    if mode.endswith("%"):
        os.environ["KEYTRACE_SAMPLE"] = "0.01"
    for warm in (True, False):  # the warm-up pays what a process pays once
        d = tempfile.mkdtemp(prefix="kt-bench-") if mode.startswith("record") else None
        if not warm:
            freeze_startup_heap()
            toggles.kt_start()  # instrumented from here on; a part's collection toggles
            if counted is not None:
                counted.update(dict.fromkeys(counted, 0))
        run_workload(s, d, alarm=alarm)  # recording: its final flush included
        scrape_alarms()
        if not warm:
            toggles.kt_stop()
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
    if counted is not None:
        print("COUNTS " + json.dumps(counted, sort_keys=True))


def _profiled(part: str, toggles: Any) -> dict[str, int]:
    """Collect callgrind's counts only inside ``part`` of keytrace (callgrind runs with
    ``--collect-atstart=no``): its functions are wrapped to toggle collection on at the
    outermost entry and off at the exit. Writers flush only when closed (on this thread:
    callgrind's collection is process-wide, and a writer thread's flush would interleave
    with the scheduler's work; `one_run` sets that). Returns counters of steps and keys,
    filled as the run goes (outside the collected parts)."""
    import functools

    counted: dict[str, int] = {"steps": 0, "lookup keys": 0, "store keys": 0}
    depth = [0]

    def collected(fn: Any) -> Any:
        @functools.wraps(fn)
        def inside(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                toggles.kt_toggle()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    toggles.kt_toggle()

        return inside

    from keytrace.vllm.hook import wrappers  # before the patch table is built from it

    wanted = HOOK_PARTS.get(part, ())
    observed, hot = wrappers._observed, wrappers.observe_hot

    def observed_counted(rec: Any, sched: Any, where: str, *rest: Any) -> Any:
        if where == "build_connector_meta":
            counted["steps"] += 1
        elif where in ("manager.prepare_store", "manager.complete_store"):
            call_args = rest[4]  # (before, after, always, wrapped, args, kwargs)
            keys = call_args[0] if call_args else ()
            counted["store keys"] += len(keys) if isinstance(keys, (list, tuple)) else 0
        if where in wanted:  # keytrace's hooks around the call, not vLLM's call itself
            before, after, always, wrapped, args, kwargs = rest
            return observed(
                rec,
                sched,
                where,
                collected(before) if before is not None else None,
                collected(after) if after is not None else None,
                always,
                wrapped,
                args,
                kwargs,
            )
        return observed(rec, sched, where, *rest)

    def uncollected(fn: Any) -> Any:
        """vLLM's own call inside a collected part: not counted as keytrace's. It keeps
        ``fn``'s signature (``__wrapped__``): the row keytrace builds around it depends on
        that signature (the CPU manager's ``lookup(key, req_context)`` gets its own), and
        the part must count the row a server runs."""

        @functools.wraps(fn)
        def outside(*args: Any, **kwargs: Any) -> Any:
            inner = depth[0] > 0
            if inner:
                toggles.kt_toggle()
            try:
                return fn(*args, **kwargs)
            finally:
                if inner:
                    toggles.kt_toggle()

        return outside

    def hot_counted(where: str, after: Any, direct: Any = None) -> Any:
        def counting(*args: Any) -> Any:
            counted["lookup keys"] += 1
            return (collected(after) if where in wanted else after)(*args)

        if direct is None:
            return hot(where, counting)

        def direct_counted(rec: Any, sched: Any, w: Any, wrapped: Any, aft: Any) -> Any:
            # the plain form a real manager gets: keytrace's code around vLLM's call
            if where not in wanted:
                inner = direct(rec, sched, w, wrapped, aft)
            else:
                inner = collected(direct(rec, sched, w, uncollected(wrapped), aft))

            def call(*args: Any, **kwargs: Any) -> Any:
                counted["lookup keys"] += 1
                return inner(*args, **kwargs)

            return call

        return hot(where, counting, direct_counted)

    wrappers._observed = observed_counted  # type: ignore[assignment]
    wrappers.observe_hot = hot_counted  # type: ignore[assignment]
    from keytrace.format import writer
    from keytrace.live.alarm import Alarm

    if part == "writer append":
        writer.TraceWriter.append = collected(writer.TraceWriter.append)  # type: ignore[method-assign]
    elif part == "writer encode":
        writer.TraceWriter._write_part = collected(writer.TraceWriter._write_part)  # type: ignore[method-assign]
    elif part == "alarm":
        for name in (
            "instance_started",
            "store_called",
            "tier_called",
            "episode_began",
            "episode_ended",
            "episode_closed",
            "request_finished",
            "recorder_closed",
        ):
            setattr(Alarm, name, collected(getattr(Alarm, name)))
    return counted


def _callgrind(args: list[str], collect_at_start: bool) -> tuple[int, str]:
    """(instructions, stdout) of one ``--one`` process under callgrind."""
    import re
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="kt-callgrind-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        run = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",  # the counted run starts it (kt_start)
                f"--collect-atstart={'yes' if collect_at_start else 'no'}",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                *args,
            ],
            check=True,
            capture_output=True,
            text=True,
            # one hash seed for every counted process: vLLM's sets order its evictions, so
            # with a random seed each mode would schedule (and count) other steps
            env={**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")},
        )
        m = re.search(r"^totals: (\d+)", Path(out).read_text(), re.M)  # all threads
        if m is None:
            raise RuntimeError("no instruction total in callgrind's output")
        return int(m.group(1)), run.stdout


def profile(seed: int, conversations: int) -> int:
    """Instructions of each part of keytrace (`PROFILE_PARTS`), per scheduler step, per
    key, and as a share of the scheduler's own work (the ``off`` run)."""
    common = ["--seed", str(seed), "--conversations", str(conversations)]
    off, _ = _callgrind(["--one", "off", *common], collect_at_start=True)
    print(f"off (the scheduler's own work): {off:,} instructions", flush=True)
    print(f"{'part':38s} {'instructions':>15s} {'of off':>8s} {'per step':>10s} {'per key':>9s}")
    for part in PROFILE_PARTS:
        mode = "record+alarm" if part == "alarm" else "record"
        n, stdout = _callgrind(["--one", mode, "--part", part, *common], collect_at_start=False)
        counts = next(
            (json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("COUNTS ")),
            {},
        )
        keys = counts.get("lookup keys", 0) + counts.get("store keys", 0)
        print(
            f"{part:38s} {n:>15,} {n / off:>8.2%} {n / max(counts.get('steps', 1), 1):>10,.0f}"
            f" {n / max(keys, 1):>9,.0f}",
            flush=True,
        )
    print(
        "(the hooks' parts include what they call: the writer's appends, and in record+alarm "
        "the alarm's work; keys: lookup calls plus keys stored)"
    )
    return 0


def instructions(seed: int, conversations: int) -> int:
    """Instructions the workload executes in each mode (valgrind's callgrind, every
    thread, one process per mode). Counts, not seconds: the same on a busy and an idle
    machine (perf's counters are not available in this VM)."""
    counts: dict[str, int] = {}
    for mode in INSTRUCTION_MODES:
        t = time.perf_counter()
        args = ["--one", mode, "--seed", str(seed), "--conversations", str(conversations)]
        counts[mode], _ = _callgrind(args, collect_at_start=True)
        print(
            f"  {mode:15s} {counts[mode]:,} instructions ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    for mode in INSTRUCTION_MODES[1:]:
        goal = "1.02" if mode.endswith("%") else "1.05"
        print(
            f"ratio {mode:15s} {counts[mode] / counts['off']:.4f}  (instructions; goal <= {goal})"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="The module docstring (python -m pydoc tools/bench_recorder.py) says what "
        "each measure means and why the instruction counts are the ones to compare.",
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="timed rounds per mode (default 5; timing only)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions under valgrind (callgrind) instead of timing: one run per "
        "mode, repeatable on any machine (several minutes; use --conversations to shrink)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instructions of each part of keytrace (the hooks, the writer, the alarm) under "
        "callgrind, per scheduler step and per key (one process per part, minutes each)",
    )
    ap.add_argument(
        "--conversations",
        type=int,
        default=24,
        help="conversations in the workload (default 24; the README's counts use 18, "
        "a quick look 1 to 6)",
    )
    ap.add_argument("--one", choices=(*INSTRUCTION_MODES, "record+alarm"), help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=PROFILE_PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one_run(args.one, args.seed, args.conversations, args.part)
        return 0
    if args.profile:
        return profile(args.seed, args.conversations)
    if args.instructions:
        return instructions(args.seed, args.conversations)

    import polars as pl

    from keytrace.cli._common import quiet_host_logs

    quiet_host_logs()
    from keytrace.format.reader import open_trace
    from keytrace.live.registry import AlarmSettings
    from keytrace.vllm.lab.workload import run_workload

    s = spec(args.seed)
    warm = run_workload(s, None)  # imports, caches and the model config outside the timing
    freeze_startup_heap()
    modes = ("off", "record", "record+alarm", "alarm", "record 1%")
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # process CPU time, every thread
    own: dict[str, list[float]] = {m: [] for m in modes}  # the scheduler thread's CPU time
    key_rows = rows_total = bytes_on_disk = 0
    sampled_rows = 0
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]  # rotate: no mode always first
        for mode in order:
            d = tempfile.mkdtemp(prefix="kt-bench-") if mode.startswith("record") else None
            alarm = AlarmSettings(warn=False) if mode.endswith("alarm") else None
            if mode.endswith("%"):
                os.environ["KEYTRACE_SAMPLE"] = "0.01"
            t, c, th = time.perf_counter(), time.process_time(), time.thread_time()
            run_workload(s, d, alarm=alarm)  # recording: the final flush happens inside
            scrape_alarms()
            times[mode].append(time.perf_counter() - t)
            cpu[mode].append(time.process_time() - c)
            own[mode].append(time.thread_time() - th)
            os.environ.pop("KEYTRACE_SAMPLE", None)
            if d is not None:
                trace = open_trace(d)
                if mode.endswith("%"):
                    sampled_rows = sum(trace.rows(k) for k in trace.kinds)
                else:
                    # v2: one lookup row per scan, its calls counted in n_keys
                    key_rows = sum(trace.rows(k) for k in ("store", "load")) + int(
                        trace.frame("lookup").select(pl.col("n_keys").sum()).collect().item() or 0
                    )
                    rows_total = sum(trace.rows(k) for k in trace.kinds)
                    bytes_on_disk = sum(os.path.getsize(p.path) for p in trace.parts)
                shutil.rmtree(d, ignore_errors=True)
    med = {m: statistics.median(times[m]) for m in modes}
    print(
        f"workload: {warm.requests} requests ({warm.turns} turns, {warm.resends} resends), "
        f"longest prompt {warm.longest_prompt:,} tokens, {warm.steps} steps, 2 engines, "
        f"budget 8,192 tokens/step; {args.rounds} rounds, modes interleaved"
    )
    for m in modes:
        print(
            f"{m:13s} median {med[m]:.3f} s  spread {min(times[m]):.3f}-{max(times[m]):.3f} s"
            f"  ({100 * (max(times[m]) - min(times[m])) / med[m]:.0f}% of the median)"
        )
    cmed = {m: statistics.median(cpu[m]) for m in modes}
    omed = {m: statistics.median(own[m]) for m in modes}
    print(
        "ratio to off        wall (medians)  wall paired by round (range)   "
        "scheduler thread CPU  process CPU"
    )
    for m in modes[1:]:
        paired = sorted(a / b for a, b in zip(times[m], times["off"], strict=True))
        print(
            f"  {m:13s}     {med[m] / med['off']:.3f}           "
            f"{statistics.median(paired):.3f} ({paired[0]:.3f}-{paired[-1]:.3f})"
            f"          {omed[m] / omed['off']:.3f}                {cmed[m] / cmed['off']:.3f}"
        )
    print(
        "goal <= 1.05 with recording on; the scheduler thread's CPU is the measure that "
        "does not swing with the machine"
    )
    print(f"the alarm on top of recording: {med['record+alarm'] / med['record']:.3f}")
    print(f"key rows {key_rows:,}; all rows {rows_total:,}; bytes on disk {bytes_on_disk:,}")
    print(
        f"rows of the 1% sampled trace {sampled_rows:,} ({sampled_rows / max(rows_total, 1):.2%})"
    )
    print(
        f"bytes per key row {bytes_on_disk / max(key_rows, 1):.1f}   (goal <= 40; all parts / key rows)"
    )
    print(f"key rows per second while recording {key_rows / med['record']:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
