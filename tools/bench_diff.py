"""`keytrace diff` at fleet scale, against a bare polars scan of the same key columns.

    python tools/bench_diff.py [--rows 10_000_000 50_000_000] [--huge] [--work /tmp/kt-bench]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000_000, 50_000_000])
    ap.add_argument("--huge", action="store_true", help="also 150M rows")
    ap.add_argument("--work", default="/tmp/kt-bench")
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of each side, interleaved (median wall)"
    )
    args = ap.parse_args()
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
        import polars as pl

        key_rows = (
            pl.scan_parquet(os.path.join(d, "kind=lookup", "*.parquet"))
            .select(pl.col("n_keys").sum())
            .collect()
            .item()
            + pl.scan_parquet(os.path.join(d, "kind=store", "*.parquet"))
            .select(pl.len())
            .collect()
            .item()
        )
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
