"""What recording costs a real server: throughput and time to first token of the CPU
`vllm serve` (vLLM 0.32.0, CPU build: tools/serve_e2e.py) with keytrace off, recording,
the live alarm alone, and recording 1% of prefix chains, side by side in one run.

    python tools/bench_serve.py [--rounds 8] [--clients 4] [--requests 48] [--pause 2] [--json]

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
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_e2e  # the server recipe: one definition

MODES = ("off", "record", "alarm", "record 1%")
PREFIXES = 4
PREFIX_TOKENS = 768
SUFFIX_TOKENS = 128
OUTPUT_TOKENS = 8


def mode_env(mode: str, work: Path) -> tuple[Path | None, dict[str, str]]:
    """(KEYTRACE_DIR or None, other environment) of a mode."""
    trace = work / "trace"
    if mode == "off":
        return None, {}
    if mode == "record":
        return trace, {}  # the live alarm on, as by default
    if mode == "alarm":
        return None, {"KEYTRACE_ALARM": "1"}
    return trace, {"KEYTRACE_SAMPLE": "0.01"}


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
    trace_rows: int | None = None
    trace_bytes: int | None = None
    verdict: str | None = None


def one_round(
    server: serve_e2e.Server, batch: list[list[int]], clients: int
) -> tuple[float, float]:
    """(requests/s, median TTFT) of one round on ``server``."""
    server.reset_prefix_cache()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        firsts = list(pool.map(lambda ids: ttft(server.url(""), ids), batch))
    wall = time.perf_counter() - t0
    return len(batch) / wall, statistics.median(firsts)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="measured rounds per mode")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=48, help="requests per round")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between two servers' rounds")
    ap.add_argument("--venv", type=Path, default=serve_e2e.DEFAULT_VENV)
    ap.add_argument("--json", action="store_true", help="one JSON document")
    args = ap.parse_args()

    py = serve_e2e.ensure_venv(args.venv)
    root = Path(tempfile.mkdtemp(prefix="kt-bench-serve-"))
    servers: dict[str, serve_e2e.Server] = {}
    results = {m: ModeResult(m) for m in MODES}
    try:
        for mode in MODES:  # one at a time: start-up is CPU-bound
            work = root / mode.replace(" ", "-").replace("%", "pct")
            work.mkdir()
            trace, env = mode_env(mode, work)
            servers[mode] = serve_e2e.Server(py, work, trace, None, extra_env=env)
            servers[mode].wait_healthy()
            one_round(servers[mode], prompts(-1, args.requests), args.clients)  # warm-up
            print(f"started {mode}", file=sys.stderr)
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            batch = prompts(r, args.requests)
            for mode in order:
                time.sleep(args.pause)
                tput, first = one_round(servers[mode], batch, args.clients)
                results[mode].throughput.append(tput)
                results[mode].ttft.append(first)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
            s.remove_shm()
    for mode in MODES:
        trace, _ = mode_env(mode, root / mode.replace(" ", "-").replace("%", "pct"))
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
        f"vllm serve (CPU, vLLM 0.32.0, tiny Gemma-2), {args.rounds} rounds interleaved, "
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
    for m, res in results.items():
        if res.verdict is not None:
            print(
                f"trace of {m}: {res.trace_rows:,} rows, {res.trace_bytes:,} bytes; {res.verdict}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
