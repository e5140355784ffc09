"""`keytrace.analysis.history.durable`: a key is durable at an episode when a tier's last
holding event before it (or during it) follows that tier's last eviction of the key. It is
computed per (key, tier, episode) with an as-of join, not by joining every tier event with
every episode (a lookup deferred 14,000 times, as a served livelock makes, has as many
episodes and tier rows per key: that product took 24 GB and the OOM killer); checked here
against the definition, computed row by row, on drawn histories."""

from __future__ import annotations

import random

import polars as pl

from keytrace.analysis.history import durable

EVENTS = ("cascade_completed", "lookup", "tier_evicted", "promotion_completed")


def _expected(at: list[tuple[int, int, bytes]], rows: list[dict]) -> dict[tuple, bool]:
    out = {}
    for inst, s, key in at:
        tiers = {r["tier"] for r in rows if r["inst"] == inst and r["key"] == key}
        held_any = False
        for t in tiers:
            mine = [
                r
                for r in rows
                if r["inst"] == inst
                and r["key"] == key
                and r["tier"] == t
                and (r["seq"] < s or r["ep"] == s)
            ]
            held = max((r["seq"] for r in mine if r["event"] != "tier_evicted"), default=None)
            gone = max((r["seq"] for r in mine if r["event"] == "tier_evicted"), default=None)
            held_any |= held is not None and (gone is None or held > gone)
        out[(inst, s, key)] = held_any
    return out


def test_durable_is_the_last_hold_after_the_last_eviction_per_tier() -> None:
    rng = random.Random(7)
    for _ in range(40):
        keys = [bytes([k]) * 36 for k in range(3)]
        rows = []
        for seq in range(rng.randint(0, 60)):
            event = rng.choice(EVENTS)
            rows.append(
                {
                    "inst": rng.randint(0, 1),
                    "seq": seq,
                    "ep": rng.choice([None, rng.randint(0, 60)]),
                    "tier": rng.randint(0, 1),
                    "event": event,
                    "result": "HIT" if event != "lookup" or rng.random() < 0.7 else "MISS",
                    "key": rng.choice(keys),
                }
            )
        at = sorted({(rng.randint(0, 1), rng.randint(0, 60), rng.choice(keys)) for _ in range(30)})
        tiers = pl.LazyFrame(
            rows,
            schema={
                "inst": pl.Int64,
                "seq": pl.Int64,
                "ep": pl.Int64,
                "tier": pl.Int64,
                "event": pl.String,
                "result": pl.String,
                "key": pl.Binary,
            },
        )
        frame = pl.DataFrame(
            at, schema={"inst": pl.Int64, "s": pl.Int64, "key": pl.Binary}, orient="row"
        )
        got = durable(frame, tiers)
        counted = [  # what `durable` reads: write-throughs done, tier HITs, evictions
            r
            for r in rows
            if r["event"] in ("cascade_completed", "tier_evicted")
            or (r["event"] == "lookup" and r["result"] == "HIT")
        ]
        want = _expected(at, counted)
        assert {
            (r["inst"], r["s"], r["key"]): r["durable"] for r in got.iter_rows(named=True)
        } == want
