"""Reproduce docs/findings.md's table: stock vLLM 0.33.0, several lengths, budgets and
blocks_per_chunk on both built-in geometries, each through the real scheduler.

    python tools/findings.py [--out findings.parquet]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import polars as pl

from keytrace.analysis.geometry import DSV4, SMALL
from keytrace.vllm.lab.sweep import run_one

LENGTHS = [17_975, 18_877, 21_579, 35_947, 100_006, 30_208, 30_272]
BUDGETS = [2_048, 8_192, 32_768]


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", default="findings.parquet")
    args = ap.parse_args()
    rows = []
    for geo in (DSV4, SMALL):
        for bpc in (1, 2):
            for budget in BUDGETS:
                g = geo.with_(
                    max_num_batched_tokens=budget, blocks_per_chunk=bpc, max_model_len=131_072
                )
                for n in LENGTHS:
                    r = run_one(g, n)
                    rows.append({"geometry": geo.name, **dataclasses.asdict(r)})
                    print(
                        geo.name,
                        bpc,
                        budget,
                        n,
                        r.E,
                        r.external,
                        r.verdict,
                        r.binding_group,
                        r.terminal_chunk,
                        r.cause,
                        file=sys.stderr,
                        flush=True,
                    )
    df = pl.DataFrame(rows)
    df.write_parquet(args.out)
    print(
        "| geometry | length | budget | bpc | E | external | verdict | binding group | terminal chunk | cause |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for r in df.sort("geometry", "length", "blocks_per_chunk", "budget").iter_rows(named=True):
        e = "-" if r["E"] is None else f"{r['E']:,}"
        g = "" if r["binding_group"] is None else r["binding_group"]
        c = "" if r["terminal_chunk"] is None else f"{r['terminal_chunk']:,}"
        print(
            f"| {r['geometry']} | {r['length']:,} | {r['budget']:,} | {r['blocks_per_chunk']} | {e} | "
            f"{r['external']:,} | {r['verdict']} | {g} | {c} | {r['cause'] or ''} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
