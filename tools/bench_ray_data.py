"""Why `keytrace diff --ray` runs Ray tasks and not Ray Data: what bringing each engine's
rows together costs both ways, side by side in one run.

    python tools/bench_ray_data.py TRACE [--rounds 2] [--cpus 2]

Ray tasks: one per engine, each reading its writer's own store parts
(`Trace.of_instances`). Ray Data: ``read_parquet`` of the same parts, then ``groupby``
the instance (the shuffle Ray Data needs before an engine's rows are in one place). Both on a
local Ray cluster of ``--cpus`` CPUs; Ray Data needs pandas (``pip install pandas``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("trace")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2)
    args = ap.parse_args()
    import ray

    from keytrace.format.reader import Trace, open_trace

    ray.init(
        num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
    )

    @ray.remote(num_cpus=1, runtime_env={"env_vars": {"POLARS_MAX_THREADS": "1"}})
    def engine_rows(view: Trace) -> int:
        return view.collect("store").height

    def count(batch: dict[str, Any]) -> dict[str, Any]:
        return {"n": [len(batch["instance_id"])]}

    trace = open_trace(args.trace).absolute()
    ids = trace.instances()
    print(f"{len(ids)} engines, {trace.rows('store'):,} store rows, {args.cpus} CPUs")
    for r in range(args.rounds):
        t = time.perf_counter()
        rows = ray.get([engine_rows.remote(trace.of_instances([i])) for i in ids])
        tasks = time.perf_counter() - t
        t = time.perf_counter()
        ds = ray.data.read_parquet(os.path.join(args.trace, "kind=store"))
        groups = ds.groupby("instance_id").map_groups(count, batch_format="numpy").take_all()
        data = time.perf_counter() - t
        assert len(groups) == len(ids) and sum(rows) == trace.rows("store")
        print(
            f"round {r}: Ray tasks {tasks:.2f} s, Ray Data read + groupby {data:.2f} s "
            f"(ratio {data / tasks:.1f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
