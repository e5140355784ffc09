"""Write a sweep table as CSV and/or Parquet."""

from __future__ import annotations

from collections.abc import Sequence

from keytrace.analysis.sweep import SWEEP_SCHEMA, SweepRow


def write_rows(
    rows: Sequence[SweepRow], *, csv_path: str | None = None, parquet_path: str | None = None
) -> None:
    """Write a sweep table as CSV and/or Parquet, with an explicit schema (a column may be
    null in every leading row, which inference would get wrong)."""
    import csv

    import polars as pl

    names = list(SWEEP_SCHEMA)
    if csv_path:
        with open(csv_path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(names)
            w.writerows([getattr(r, n) for n in names] for r in rows)
    if parquet_path:
        schema = {n: getattr(pl, t) for n, t in SWEEP_SCHEMA.items()}
        pl.DataFrame(
            [[getattr(r, n) for n in names] for r in rows], schema=schema, orient="row"
        ).write_parquet(parquet_path)
