"""`keytrace diff` at fleet scale, against a bare polars scan of the same key columns.

    python tools/bench_diff.py [--rows 10_000_000 50_000_000] [--huge] [--work /tmp/kt-bench]
    python tools/bench_diff.py --engines 50 [--rows 2_000_000] [--workers 2]

``--engines N``: a fleet trace of N engines with routing between them (gen_trace.py
``--misroute 0.2``), judged side by side in one run, each mode in a fresh process, rounds
interleaved: in this process as one partition (the whole trace at once) and cut one engine
per partition (the finest split, what each engine's judgement costs alone), in ``--workers``
local processes (``--jobs``), and as Ray tasks on a local Ray cluster of ``--workers`` CPUs
(the cluster started before the clock; its start-up reported apart). Prints wall times and ratios,
the peak RSS of the driver and of the largest worker, the cross-engine facts' rows and bytes
beside the trace's, the per-worker rates, and whether every mode's report is the same bytes.

``--huge`` adds a 150M-row point (about 3 minutes to generate, 1 GB of disk) and reports how
the diff's peak memory grew from 50M to 150M rows (the goal: under 25%).

For each size: generate a trace with tools/gen_trace.py (reused if present), then, each in a
fresh subprocess so peak RSS is its own, run (1) `keytrace diff TRACE --all --json` through
the CLI and (2) a bare polars scan that reads the same lookup and store key columns once and
aggregates them, each ``--repeat`` times interleaved (median wall, max RSS). Prints wall
times, `ratio` (diff / scan), key rows per second, peak RSS, and checks that the diff found
exactly the planted mismatches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

SCAN = r"""
import sys, polars as pl
d = sys.argv[1]
# every key byte of the trace read once: store keys, and each scan's raw lookup keys (v2
# keeps them as head/tail lists), with the columns the differ also touches
lk = pl.scan_parquet(d + "/kind=lookup/*.parquet").filter(pl.col("scan") >= 0)
st = pl.scan_parquet(d + "/kind=store/*.parquet")
keys = lambda c: pl.col(c).list.eval(pl.element().bin.size()).list.sum().sum()
a = lk.group_by("group_id").agg(
    pl.col("n_keys").sum(), keys("head_keys"), keys("tail_keys"), pl.col("term_seq").max(),
    pl.col("episode").n_unique(), pl.col("scan").max()).collect(engine="streaming")
b = st.group_by("group_id", "event").agg(pl.len(), pl.col("key").bin.size().sum(),
    pl.col("seq").max(), pl.col("chunk_idx").max()).collect(engine="streaming")
print(a.height + b.height)
"""


def count_key_rows(d: str) -> int:
    """Key rows of a trace: every key its scans looked up, and every store row."""
    import polars as pl

    lookups = pl.scan_parquet(os.path.join(d, "kind=lookup", "*.parquet"))
    stores = pl.scan_parquet(os.path.join(d, "kind=store", "*.parquet"))
    return int(
        lookups.select(pl.col("n_keys").sum()).collect().item()
        + stores.select(pl.len()).collect().item()
    )


def timed(cmd: list[str]) -> tuple[float, int, str, int]:
    wrapped = ["/usr/bin/time", "-f", "__RSS_KB__ %M", *cmd]
    t = time.perf_counter()
    p = subprocess.run(wrapped, capture_output=True, text=True)
    wall = time.perf_counter() - t
    rss_kb = 0
    for line in p.stderr.splitlines():
        if line.startswith("__RSS_KB__"):
            rss_kb = int(line.split()[1])
    if p.returncode not in (0, 1):
        sys.stderr.write(p.stderr[-2000:])
    return wall, rss_kb * 1024, p.stdout, p.returncode


FLEET_RUN = r"""
import hashlib, io, json, resource, sys, time
from keytrace.analysis.diff import diff
from keytrace.analysis.runners import LocalRunner, RayRunner
from keytrace.format.reader import open_trace
from keytrace.report.jsonout import write_json

def rss_call(fn, *args):
    out = fn(*args)
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

class Measured:
    def __init__(self, inner):
        self.inner, self.name, self.peaks = inner, inner.name, []
        self.partitions = inner.partitions
    def map(self, fn, calls, shared, done=None):
        got = self.inner.map(rss_call, [(fn, *c) for c in calls], shared, done)
        self.peaks += [p for _, p in got]
        return [r for r, _ in got]

if __name__ == "__main__":
    d, mode, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    startup = 0.0
    if mode == "ray":
        import ray
        t = time.perf_counter()
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        inner = RayRunner()
        startup = time.perf_counter() - t
    else:
        inner = LocalRunner(workers if mode == "local" else 1)
    runner = Measured(inner)
    t = time.perf_counter()
    trace = open_trace(d)
    cut = len(trace.instances()) if mode == "engines" else None
    report = diff(trace, all_episodes=True, runner=runner, partitions=cut)
    buf = io.StringIO()
    write_json(report, buf)
    wall = time.perf_counter() - t
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall": wall, "startup": startup, "driver": me,
        "worker": max(runner.peaks) if mode in ("local", "ray") else me,
        "digest": hashlib.sha256(buf.getvalue().encode()).hexdigest(),
        "episodes": sum(report.counts.values()), "counts": report.counts}))
"""

FACTS = r"""
import json, sys
import polars as pl
from keytrace.analysis import partition
from keytrace.analysis.diff import _groups
from keytrace.format.reader import open_trace
trace = open_trace(sys.argv[1])
groups = _groups(trace)
views = [trace.of_instances([i]) for i in trace.instances()]
ex = [partition.exports(v, (groups, len(views) > 1)) for v in views]
cross = partition.cross_engine(ex)
asked = partition.asked_of(ex)
first = partition.first_offers([partition.first_offers_of(v, asked) for v in views])
print(json.dumps({"elsewhere": [cross.elsewhere.height, cross.elsewhere.estimated_size()],
    "asked": [asked.height, asked.estimated_size()], "first": [first.height, first.estimated_size()],
    "engines": len(views)}))
"""


def fleet(args: argparse.Namespace) -> int:
    """The ``--engines`` benchmark (module doc)."""
    rows = args.rows[0] if args.rows_given else 2_000_000
    d = os.path.join(args.work, f"fleet-{args.engines}-{rows}")
    if not os.path.exists(d + ".planted.json"):
        print(f"generating {rows:,} rows on {args.engines} engines into {d} ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "gen_trace.py"),
                d,
                "--rows",
                str(rows),
                "--engines",
                str(args.engines),
                "--misroute",
                "0.2",
            ],
            check=True,
        )
    # a script file, not -c: spawned pool workers re-import the main module for rss_call
    script = os.path.join(args.work, "fleet_run.py")
    with open(script, "w") as fh:
        fh.write(FLEET_RUN)
    modes = ["single", "engines", "local", "ray"]
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in modes}
    for r in range(args.repeat):
        for m in modes[r % 4 :] + modes[: r % 4]:  # order rotates: no mode always first
            p = subprocess.run(
                [sys.executable, script, d, m, str(args.workers)],
                capture_output=True,
                text=True,
            )
            if p.returncode != 0:
                sys.stderr.write(p.stderr[-3000:])
                return 2
            runs[m].append(json.loads(p.stdout.strip().splitlines()[-1]))
    facts = json.loads(
        subprocess.run(
            [sys.executable, "-c", FACTS, d], capture_output=True, text=True, check=True
        ).stdout
    )
    trace_bytes = sum(
        os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(d) for f in fs
    )
    key_rows = count_key_rows(d)
    episodes = runs["single"][0]["episodes"]
    print(
        f"fleet trace: {facts['engines']} engines, {key_rows:,} key rows, {episodes:,} "
        f"episodes, {trace_bytes / 2**20:.1f} MiB on disk; {args.repeat} rounds, "
        f"{args.workers} workers"
    )
    base = statistics.median(float(x["wall"]) for x in runs["single"])  # type: ignore[arg-type]
    labels = {
        "single": "one process, whole trace",
        "engines": "one process, engine by engine",
        "local": f"{args.workers} local processes (--jobs)",
        "ray": f"Ray, local cluster of {args.workers} CPUs",
    }
    print(f"{'mode':<36} {'wall s':>7} {'ratio':>6} {'driver RSS':>11} {'worker RSS':>11}")
    for m in modes:
        wall = statistics.median(float(x["wall"]) for x in runs[m])  # type: ignore[arg-type]
        drv = max(int(x["driver"]) for x in runs[m])  # type: ignore[call-overload]
        wrk = max(int(x["worker"]) for x in runs[m])  # type: ignore[call-overload]
        print(
            f"{labels[m]:<36} {wall:>7.2f} {wall / base:>6.2f} {drv / 2**20:>10.0f}M "
            f"{wrk / 2**20:>10.0f}M"
        )
    startup = statistics.median(float(x["startup"]) for x in runs["ray"])  # type: ignore[arg-type]
    print(f"Ray cluster start-up (not in the wall above): {startup:.1f} s")
    kb = 1024
    print(
        "cross-engine facts: boundary offers {:,} rows ({:.0f} KiB), asked keys {:,} "
        "({:.0f} KiB), first offers {:,} rows ({:.0f} KiB): {:.2%} of the trace's bytes".format(
            facts["elsewhere"][0],
            facts["elsewhere"][1] / kb,
            facts["asked"][0],
            facts["asked"][1] / kb,
            facts["first"][0],
            facts["first"][1] / kb,
            (facts["elsewhere"][1] + facts["asked"][1] + facts["first"][1]) / trace_bytes,
        )
    )
    each = statistics.median(float(x["wall"]) for x in runs["engines"])  # type: ignore[arg-type]
    print(
        f"one process: {key_rows / base:,.0f} key rows/s whole, {key_rows / each:,.0f} key "
        f"rows/s engine by engine ({each / facts['engines']:.3f} s per engine of "
        f"{key_rows / facts['engines']:,.0f} key rows)"
    )
    digests = {str(x["digest"]) for m in modes for x in runs[m]}
    print(f"every report the same bytes: {len(digests) == 1}")
    return 0 if len(digests) == 1 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--engines", type=int, default=None, help="the fleet benchmark (module doc)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--huge", action="store_true", help="also 150M rows")
    ap.add_argument("--work", default="/tmp/kt-bench")
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of each side, interleaved (median wall)"
    )
    args = ap.parse_args()
    args.rows_given = args.rows is not None
    if args.engines is not None:
        args.rows = args.rows or [2_000_000]
        return fleet(args)
    args.rows = args.rows or [10_000_000, 50_000_000]
    if args.huge and 150_000_000 not in args.rows:
        args.rows.append(150_000_000)
    os.makedirs(args.work, exist_ok=True)
    results = []
    for n in args.rows:
        d = os.path.join(args.work, f"trace-{n}")
        if not os.path.exists(d + ".planted.json"):
            print(f"generating {n:,} rows into {d} ...", file=sys.stderr)
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, os.path.join(HERE, "gen_trace.py"), d, "--rows", str(n)],
                check=True,
            )
            print(f"  generated in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        with open(d + ".planted.json") as fh:
            planted = {tuple(x) for x in json.load(fh)}
        # interleaved repeats, medians: one run each swings the ratio by +-0.4 on a shared box
        scans, diffs = [], []
        for _ in range(args.repeat):
            scans.append(timed([sys.executable, "-c", SCAN, d]))
            diffs.append(
                timed([sys.executable, "-m", "keytrace.cli", "diff", d, "--all", "--json"])
            )
        w_scan = statistics.median(r[0] for r in scans)
        w_diff = statistics.median(r[0] for r in diffs)
        rss_scan = max(r[1] for r in scans)
        rss_diff = max(r[1] for r in diffs)
        out, code = diffs[-1][2], diffs[-1][3]
        report = json.loads(out)
        found = {
            (e["engine_id"], e["req_id"]) for e in report["episodes"] if e["verdict"] == "mismatch"
        }
        key_rows = count_key_rows(d)
        results.append(
            (
                n,
                key_rows,
                w_scan,
                w_diff,
                rss_scan,
                rss_diff,
                code,
                found == planted,
                report["counts"],
                statistics.median(r[1] for r in diffs),
            )
        )
    print(
        f"{'rows':>12} {'key rows':>12} {'scan s':>8} {'diff s':>8} {'ratio':>6} {'diff rows/s':>12} "
        f"{'scan RSS':>9} {'diff RSS':>9}  exit  planted-found-exactly  counts"
    )
    for n, kr, ws, wd, rs, rd, code, ok, counts, _ in results:
        print(
            f"{n:>12,} {kr:>12,} {ws:>8.1f} {wd:>8.1f} {wd / ws:>6.2f} {kr / wd:>12,.0f} "
            f"{rs / 2**20:>8.0f}M {rd / 2**20:>8.0f}M  {code:>4}  {ok!s:>21}  {counts}"
        )
    print("goals: ratio <= 3, diff peak RSS <= 4 GiB at 50M rows, < 25% more at 150M")
    rss = {r[0]: r[5] for r in results}
    mid = {r[0]: r[9] for r in results}
    if 50_000_000 in rss and 150_000_000 in rss:
        print(
            f"diff peak RSS 50M -> 150M: {rss[150_000_000] / rss[50_000_000] - 1:+.1%} "
            f"(largest of the runs; medians: {mid[150_000_000] / mid[50_000_000] - 1:+.1%})"
        )
    return 0 if all(r[7] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
