"""What recording costs a real server: throughput and time to first token of the CPU
`vllm serve` (vLLM 0.32.0, CPU build: tools/serve_e2e.py) with keytrace off, recording,
the live alarm alone, and recording 1% of prefix chains, side by side in one run.

    python tools/bench_serve.py [--rounds 8] [--clients 4] [--requests 48] [--pause 2]
                                [--together] [--json]

One server per mode, all started first (start-up is not what is measured) and warmed with
one unmeasured round; then rounds interleave the modes (the order rotates each round), and
only one server takes traffic at a time, ``--pause`` seconds after the last (vLLM's CPU
worker threads spin a while after their work: the next server must not share the cores
with them). A round on a server: a GPU-only prefix-cache reset
(``POST /reset_prefix_cache``: what the GPU held is gone, the CPU tier keeps its keys), then
``--requests`` streaming completions from ``--clients`` concurrent clients, each a prompt of
one of four shared 768-token prefixes (loaded back from the CPU tier after the reset) and a
128-token suffix new in that round (computed and stored), 8 output tokens. The same prompts
go to every mode in a round.

Per mode: round throughput (requests/s over the round's wall time) and TTFT (first streamed
token). Ratios to ``off``: of the medians, and paired by round (each round's value over that
round's ``off``, so the machine's drift between rounds cancels: median and range). Goal
(issue 29): <= 1.02 on both with recording on. Then each trace's rows, bytes and verdict.

And what a wall clock on a shared machine cannot decide: the **engine core's own CPU time
per request**: user + system time of every thread of the process that runs vLLM's scheduler,
keytrace's hooks and its writer (``/proc/<pid>/task/*/schedstat``), less the CPU time it
spends in vLLM's message queue waiting for the worker (on a CPU server the model runs in a
worker process, and the engine core spins on ``sched_yield`` while it computes: 73% of its
samples in a py-spy profile; ``tools/bench_wait_meter`` counts it), read before a round and
``--pause`` seconds after it (the writer's idle flush has run by then). Its ratio to ``off``
is paired by round, and its mean comes with a 95% confidence interval (bootstrap over
rounds, a fixed seed): recording's cost is decided when the interval is narrower than the
goal (issue 41: 2%).
``--modes off,record`` measures only those; ``control`` (a second server exactly like
``off``) measures the measure: its ratio to ``off`` should be 1 within its interval.

``--together``: every mode's server takes each round's prompts at the same time, from its
own clients. A shared machine's speed drifts from one round to the next and even within
one (its clock, its host's other tenants): measured one after another, two modes' rounds
see different machines, and the paired ratio carries that (2026-12-05, 20 interleaved
rounds: a round's ratio spread 12%); measured over the same seconds, the drift weighs on
every mode alike and cancels in the ratio (12 rounds together: 5.8%, and 4.0% at 1%
sampling), so the same interval needs a quarter of the rounds. The servers then share
the cores: each one's CPU time per request is still its own, its throughput and TTFT are
not what it would get alone (read those from an interleaved run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_e2e  # the server recipe: one definition

MODES = ("off", "record", "alarm", "record 1%", "control")
"""``control``: a second server exactly like ``off`` (not in the default set): its ratio to
``off`` is what the measure gives two servers of the same code, the bias and spread every
other mode's ratio carries."""
DEFAULT_MODES = MODES[:4]
PREFIXES = 4
PREFIX_TOKENS = 768
SUFFIX_TOKENS = 128
OUTPUT_TOKENS = 8


WAIT_METER = Path(__file__).resolve().parent / "bench_wait_meter"


def mode_env(mode: str, work: Path) -> tuple[Path | None, dict[str, str]]:
    """(KEYTRACE_DIR or None, other environment) of a mode. Every mode's server counts the
    CPU time its processes spend waiting in vLLM's message queue (tools/bench_wait_meter),
    one file per process in ``work/wait``."""
    trace = work / "trace"
    (work / "wait").mkdir(exist_ok=True)
    env = {
        "PYTHONPATH": f"{WAIT_METER}{os.pathsep}{serve_e2e.ROOT}",
        "KEYTRACE_BENCH_WAIT_METER": str(work / "wait"),
        # one hash seed for every server: with a random one each start orders its sets of
        # keys (and so where vLLM's set-ordered work lands, and keytrace's folds) its own
        # way: work that differs by start, not by mode
        "PYTHONHASHSEED": "0",
    }
    if mode in ("off", "control"):
        return None, env
    if mode == "record":
        return trace, env  # the live alarm on, as by default
    if mode == "alarm":
        return None, {**env, "KEYTRACE_ALARM": "1"}
    return trace, {**env, "KEYTRACE_SAMPLE": "0.01"}


def tokens(seed: int, n: int) -> list[int]:
    """A deterministic token-id sequence (examples/serve/send_prompts.py's rule)."""
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def prompts(round_no: int, n: int) -> list[list[int]]:
    """The round's prompts: a shared prefix (4 of them) and a suffix new in this round."""
    return [
        tokens(1 + i % PREFIXES, PREFIX_TOKENS) + tokens(1000 + round_no * 100 + i, SUFFIX_TOKENS)
        for i in range(n)
    ]


def ttft(base: str, ids: list[int]) -> float:
    """Seconds to the first streamed token of one completion (read to its end)."""
    body = {
        "model": str(serve_e2e.MODEL),
        "prompt": ids,
        "max_tokens": OUTPUT_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first: float | None = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("a completion streamed no token")
    return first


@dataclass
class ModeResult:
    mode: str
    throughput: list[float] = field(default_factory=list)
    """Requests per second, one per measured round."""
    ttft: list[float] = field(default_factory=list)
    """Median TTFT of each measured round, seconds."""
    cpu_ms: list[float] = field(default_factory=list)
    """Engine-core CPU milliseconds per request, one per measured round."""
    main_ms: list[float] = field(default_factory=list)
    """Of which its main thread's."""
    block: list[int] = field(default_factory=list)
    """The block (servers started afresh) of each measured round."""
    trace_rows: int | None = None
    trace_bytes: int | None = None
    verdict: str | None = None


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """CPU seconds thread ``tid`` of process ``pid`` has run so far."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def cpu_seconds(pid: int) -> float:
    """CPU seconds the live threads of process ``pid`` have run so far, at nanosecond
    resolution (``/proc/<pid>/task/*/schedstat``; ``stat``'s 10 ms ticks are too coarse
    for a round). A thread that ended during a round takes its time with it: the threads
    measured here (vLLM's engine core, keytrace's writer) live as long as the server."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def waiting_seconds(server: serve_e2e.Server, pid: int) -> float:
    """CPU seconds process ``pid`` of ``server`` spent in vLLM's message-queue wait so far
    (tools/bench_wait_meter; 0 when its file is not there)."""
    cell = server.log_path.parent / "wait" / str(pid)
    try:
        (ns,) = struct.unpack("q", cell.read_bytes()[:8])
        return float(ns) / 1e9
    except (OSError, struct.error):
        return 0.0


def work_seconds(server: serve_e2e.Server, pid: int) -> tuple[float, float]:
    """The engine core's own CPU seconds so far, less its waiting: (every thread, its main
    thread alone: vLLM's busy loop, the scheduler and keytrace's hooks; the message-queue
    reads are on it too)."""
    wait = waiting_seconds(server, pid)
    return cpu_seconds(pid) - wait, thread_cpu_seconds(pid, pid) - wait


def one_round(
    server: serve_e2e.Server, batch: list[list[int]], clients: int, pause: float = 0.0
) -> tuple[float, float, float, float]:
    """(requests/s, median TTFT, engine-core CPU ms per request, of which its main thread)
    of one round on ``server``; the CPU time is read ``pause`` seconds after the round's last
    answer."""
    pid = server.engine_pid()
    cpu0, main0 = work_seconds(server, pid) if pid else (0.0, 0.0)
    server.reset_prefix_cache()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        firsts = list(pool.map(lambda ids: ttft(server.url(""), ids), batch))
    wall = time.perf_counter() - t0
    time.sleep(pause)
    cpu, main = work_seconds(server, pid) if pid else (float("nan"), float("nan"))
    n = len(batch)
    return n / wall, statistics.median(firsts), 1000 * (cpu - cpu0) / n, 1000 * (main - main0) / n


def together_round(
    servers: dict[str, serve_e2e.Server], batch: list[list[int]], clients: int, pause: float
) -> dict[str, tuple[float, float, float, float]]:
    """`one_round` on every server at once: each gets the same prompts from its own
    ``clients`` clients over the same seconds, so what the machine does meanwhile (its
    clock, the other tenants of its host) weighs on every mode alike, and the paired ratio
    cancels it. The servers share the cores: each mode's CPU time is its own, its
    throughput and TTFT are not what it would get alone."""
    pids = {m: s.engine_pid() for m, s in servers.items()}
    start = {m: work_seconds(s, pids[m]) if pids[m] else (0.0, 0.0) for m, s in servers.items()}
    for s in servers.values():
        s.reset_prefix_cache()
    pools = {m: ThreadPoolExecutor(clients) for m in servers}
    t0 = time.perf_counter()
    # submitted in turns, one prompt per server, so no server starts ahead of another
    futures: dict[str, list[Any]] = {m: [] for m in servers}
    for ids in batch:
        for m, s in servers.items():
            futures[m].append(pools[m].submit(ttft, s.url(""), ids))
    walls: dict[str, float] = {}
    firsts: dict[str, list[float]] = {}
    for m in servers:
        firsts[m] = [f.result() for f in futures[m]]
        walls[m] = time.perf_counter() - t0
        pools[m].shutdown()
    time.sleep(pause)
    n = len(batch)
    out = {}
    for m, s in servers.items():
        cpu, main = work_seconds(s, pids[m]) if pids[m] else (float("nan"), float("nan"))
        out[m] = (
            n / walls[m],
            statistics.median(firsts[m]),
            1000 * (cpu - start[m][0]) / n,
            1000 * (main - start[m][1]) / n,
        )
    return out


def mean_interval(
    ratios: list[float], level: float = 0.95, blocks: list[int] | None = None
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``ratios`` and its bootstrap percentile interval
    (10,000 resamples, a fixed seed: the same data give the same interval).

    ``blocks``: the block (the servers' start) of each ratio. With more than one, whole
    blocks are resampled: a server carries its own bias through its life (where its
    processes landed on the cores), which rounds on the same servers never sample, and
    an interval over rounds alone would be narrower than the truth."""
    rng = random.Random(0)
    n = len(ratios)
    clusters: list[list[float]] = [[r] for r in ratios]
    if blocks is not None and len(set(blocks)) > 1:
        by_block: dict[int, list[float]] = {}
        for b, r in zip(blocks, ratios, strict=True):
            by_block.setdefault(b, []).append(r)
        clusters = list(by_block.values())
    means = []
    for _ in range(10_000):
        drawn = [r for c in rng.choices(clusters, k=len(clusters)) for r in c]
        means.append(sum(drawn) / len(drawn))
    means.sort()
    tail = (1 - level) / 2
    return sum(ratios) / n, means[int(tail * len(means))], means[int((1 - tail) * len(means)) - 1]


def paired(values: list[float], base: list[float]) -> list[float]:
    return sorted(a / b for a, b in zip(values, base, strict=True))


def trace_facts(py: Path, trace: Path) -> tuple[int, int, str]:
    """(rows, bytes, verdict line) of a mode's trace, by the CLI in the server's venv."""
    parts = [p for p in trace.rglob("*.parquet")]
    size = sum(p.stat().st_size for p in parts)
    env = serve_e2e.cli_env()
    out = subprocess.run(
        [str(py), "-m", "keytrace", "summary", "--json", str(trace)],
        capture_output=True,
        text=True,
        env=env,
    )
    rows = 0
    if out.returncode == 0:
        doc = json.loads(out.stdout)
        rows = int(sum((doc.get("rows") or {}).values()))
    diff = subprocess.run(
        [str(py), "-m", "keytrace", "diff", str(trace)], capture_output=True, text=True, env=env
    )
    line = (diff.stdout or diff.stderr).strip().splitlines()[:1]
    return rows, size, f"exit {diff.returncode}: {line[0] if line else ''}"


def run_block(
    py: Path,
    root: Path,
    modes: tuple[str, ...],
    block: int,
    rounds: range,
    args: argparse.Namespace,
    results: dict[str, ModeResult],
) -> dict[str, Path]:
    """Start one server per mode (in an order that rotates by block: no mode always
    starts first), warm each with one unmeasured round, measure ``rounds``, stop them.
    Each mode's folder, by mode."""
    servers: dict[str, serve_e2e.Server] = {}
    works: dict[str, Path] = {}
    start_order = modes[block % len(modes) :] + modes[: block % len(modes)]
    try:
        for mode in start_order:  # one at a time: start-up is CPU-bound
            work = works[mode] = root / mode.replace(" ", "-").replace("%", "pct")
            work.mkdir(parents=True)
            trace, env = mode_env(mode, work)
            servers[mode] = serve_e2e.Server(py, work, trace, None, extra_env=env)
            servers[mode].wait_healthy()
            one_round(servers[mode], prompts(-1, args.requests), args.clients)  # warm-up
            print(f"block {block + 1}: started {mode}", file=sys.stderr)
        for r in rounds:
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            batch = prompts(r, args.requests)
            time.sleep(args.pause)
            if args.together:
                measured = together_round(
                    {m: servers[m] for m in order}, batch, args.clients, args.pause
                )
            else:
                measured = {
                    m: one_round(servers[m], batch, args.clients, args.pause) for m in order
                }
            for mode, (tput, first, cpu, main) in measured.items():
                results[mode].throughput.append(tput)
                results[mode].ttft.append(first)
                results[mode].cpu_ms.append(cpu)
                results[mode].main_ms.append(main)
                results[mode].block.append(block)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
            s.remove_shm()
    return works


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=8, help="measured rounds per mode")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=48, help="requests per round")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between two servers' rounds")
    ap.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        # argparse formats help with %: "record 1%" must reach it as "record 1%%"
        help=f"comma-separated modes to run, off first (default: {','.join(DEFAULT_MODES)}; "
        "control: a second off server, the measure's own bias)".replace("%", "%%"),
    )
    ap.add_argument(
        "--together",
        action="store_true",
        help="every mode's server takes each round's traffic at the same time (the "
        "machine's drift cancels in the paired CPU ratio; throughput and TTFT are then "
        "shared-core figures)",
    )
    ap.add_argument(
        "--blocks",
        type=int,
        default=1,
        help="start the servers afresh this many times, the rounds split between them; "
        "the interval then resamples whole blocks (a server's own bias counted)",
    )
    ap.add_argument("--venv", type=Path, default=serve_e2e.DEFAULT_VENV)
    ap.add_argument("--json", action="store_true", help="one JSON document")
    args = ap.parse_args()
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or modes[0] != "off" or not set(modes) <= set(MODES):
        ap.error(f"--modes: off first, then any of {', '.join(MODES[1:])}")

    py = serve_e2e.ensure_venv(args.venv)
    root = Path(tempfile.mkdtemp(prefix="kt-bench-serve-"))
    results = {m: ModeResult(m) for m in modes}
    blocks = max(1, min(args.blocks, args.rounds))
    last: dict[str, Path] = {}
    for b in range(blocks):
        rounds = range(b * args.rounds // blocks, (b + 1) * args.rounds // blocks)
        last = run_block(py, root / f"block{b}", modes, b, rounds, args, results)
    for mode in modes:
        trace, _ = mode_env(mode, last[mode])
        if trace is not None and trace.exists():
            res = results[mode]
            res.trace_rows, res.trace_bytes, res.verdict = trace_facts(py, trace)
    report(results, args)
    shutil.rmtree(root, ignore_errors=True)
    return 0


def report(results: dict[str, ModeResult], args: argparse.Namespace) -> None:
    off = results["off"]
    if args.json:
        print(json.dumps({m: asdict(r) for m, r in results.items()}, indent=2))
        return
    print(
        f"vllm serve (CPU, vLLM 0.32.0, tiny Gemma-2), {args.rounds} rounds "
        f"{'together (shared cores)' if args.together else 'interleaved'} in "
        f"{len(set(off.block))} block(s) of fresh servers, "
        f"{args.requests} requests/round from {args.clients} clients: {PREFIXES} shared "
        f"{PREFIX_TOKENS}-token prefixes from the CPU tier + {SUFFIX_TOKENS} new tokens, "
        f"{OUTPUT_TOKENS} output tokens"
    )
    print(
        f"{'mode':10s} {'req/s median':>13s} {'ratio':>6s} {'paired (range)':>22s}   "
        f"{'TTFT median':>11s} {'ratio':>6s} {'paired (range)':>22s}"
    )
    for m, res in results.items():
        tput, first = statistics.median(res.throughput), statistics.median(res.ttft)
        pt, pf = paired(off.throughput, res.throughput), paired(res.ttft, off.ttft)
        print(
            f"{m:10s} {tput:13.2f} {statistics.median(off.throughput) / tput:6.3f} "
            f"{statistics.median(pt):8.3f} ({pt[0]:.3f}-{pt[-1]:.3f})   "
            f"{first * 1000:9.0f}ms {first / statistics.median(off.ttft):6.3f} "
            f"{statistics.median(pf):8.3f} ({pf[0]:.3f}-{pf[-1]:.3f})"
        )
    print("ratios are cost: off's throughput over the mode's, the mode's TTFT over off's")
    print(
        "the engine-core process's own CPU time per request (all its threads, less their "
        "wait for the worker in vLLM's message queue):"
    )
    print(
        f"{'mode':10s} {'CPU ms/request':>15s} {'paired ratio: mean, 95% interval':>34s}   "
        f"{'main thread':>11s} {'paired ratio: mean, 95% interval':>34s}"
    )
    for m, res in results.items():
        cells = []
        for mine, base in ((res.cpu_ms, off.cpu_ms), (res.main_ms, off.main_ms)):
            mean, lo, hi = mean_interval(
                [a / b for a, b in zip(mine, base, strict=True)], blocks=res.block
            )
            cells.append(
                f"{statistics.median(mine):11.2f} {mean:14.3f} [{lo:.3f}, {hi:.3f}] "
                f"(+-{(hi - lo) / 2 * 100:4.1f}%)"
            )
        print(f"{m:10s} {cells[0]:>49s}   {cells[1]:>46s}")
    for m, res in results.items():
        if res.verdict is not None:
            print(
                f"trace of {m}: {res.trace_rows:,} rows, {res.trace_bytes:,} bytes; {res.verdict}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
