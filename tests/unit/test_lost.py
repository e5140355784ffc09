"""Where every prompt token came from (keytrace.analysis.lost), on hand-built traces.

TINY with groups 0 (FA) and 1 (SWA), 16 tokens per chunk: a 100-token prompt has cap
L = E = 96 for its resend, and 4 tokens past E are always recomputed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from keytrace.analysis.diff import diff
from keytrace.format.reader import open_trace
from tests.factories import TINY, new_builder
from tests.unit.test_diff import FA_ALL, _swa_scan

GEO = TINY.with_(groups=TINY.groups[:2])


def _rows(d: Path, engine: str = "all") -> dict[str, int]:
    lost = diff(open_trace(str(d)), all_episodes=True).lost
    assert lost is not None
    totals = Counter[str]()
    for r in lost.rows:
        totals[r.engine] += r.tokens
    assert dict(totals) == lost.prompt_tokens  # every engine's rows add up exactly
    return {r.label: r.tokens for r in lost.rows if r.engine == engine}


def test_hit_and_rule_shortfall(tmp_path: Path) -> None:
    b = new_builder(tmp_path / "t", geometry=GEO)
    b.prime("r1", "c", 100, swa_chunks={1: [5]})  # cold: 100 tokens not stored anywhere
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.episode("r3", 100, external=None, chain="c", scans=[(0, [(0, "HIT_PENDING")])])
    b.close()
    assert _rows(tmp_path / "t") == {
        "cold: not stored anywhere": 100,
        "short of E (RULE): never_offered, group 1": 96,
        "recomputed past E (by design)": 4,
    }  # the deferred r3 is counted when it is asked again, not now


def test_served_explained_and_gpu(tmp_path: Path) -> None:
    b = new_builder(tmp_path / "t", geometry=GEO)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    b.episode(
        "r2", 100, external=96, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({4: "HIT", 5: "HIT"}))]
    )
    b.evict("r9", "c", 1, [4])
    # local 32 (two chunks on the GPU), then a shortfall explained by the eviction
    b.episode(
        "r3",
        100,
        external=0,
        local=32,
        chain="c",
        scans=[(0, [(c, "HIT") for c in range(2, 6)]), (1, _swa_scan({5: "HIT"}, lo=2))],
    )
    b.close()
    assert _rows(tmp_path / "t") == {
        "GPU prefix cache": 32,
        "offload tier (loaded)": 96,
        "short of E (timing/capacity): evicted, group 1": 64,
        "cold: not stored anywhere": 100,
        "recomputed past E (by design)": 4 + 4,
    }


def test_a_routing_miss_is_not_plain_cold(tmp_path: Path) -> None:
    # the conversation's earlier turn ran on engine B; the next turn lands on engine A
    d = tmp_path / "t"
    a = new_builder(d, geometry=GEO, engine_id="A")
    bb = new_builder(d, geometry=GEO, engine_id="B", dp_rank=1)
    bb.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    a.episode("r2", 120, external=0, chain="c", scans=[(0, [(0, "MISS")])])
    a.store("r2", "c", 0, list(range(7)))  # r2 then computes and stores its own prompt
    a.close()
    bb.close()
    assert _rows(d, "A") == {
        # B held boundary 96 for this prefix, in its own CPU tier
        "cold: stored on another engine's private tier (routing)": 96,
        "cold: not stored anywhere": 24,
    }
    assert _rows(d, "B") == {"cold: not stored anywhere": 100}
    # the same turn with engine B's store only after it: plain cold
    d2 = tmp_path / "t2"
    a = new_builder(d2, geometry=GEO, engine_id="A")
    bb = new_builder(d2, geometry=GEO, engine_id="B", dp_rank=1)
    a.episode("r2", 120, external=0, chain="c", scans=[(0, [(0, "MISS")])])
    a.store("r2", "c", 0, list(range(7)))
    bb.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    a.close()
    bb.close()
    assert _rows(d2, "A") == {"cold: not stored anywhere": 120}
    # engines by name, then the total: the table's columns never shuffle between runs
    for _ in range(5):
        lost = diff(open_trace(str(d2))).lost
        assert lost is not None and list(lost.prompt_tokens) == ["A", "B", "all"]


def test_an_offer_that_never_completed_on_another_engine_is_no_routing(tmp_path: Path) -> None:
    """Routing means another engine had the prefix on its tier: its store of the boundary
    key completed before the episode. Offers that failed (or are still in flight) put
    nothing there (a fresh-eyes review saw every store fail and the table blame routing)."""
    for outcome, expected in (
        ("failed", {"cold: not stored anywhere": 120}),
        ("in flight", {"cold: not stored anywhere": 120}),
        (
            "completed",
            {
                "cold: stored on another engine's private tier (routing)": 96,
                "cold: not stored anywhere": 24,
            },
        ),
    ):
        d = tmp_path / outcome.replace(" ", "-")
        a = new_builder(d, geometry=GEO, engine_id="A")
        bb = new_builder(d, geometry=GEO, engine_id="B", dp_rank=1)
        bb.episode("r1", 100, external=0, chain="c", scans=[(0, [(0, "MISS")])])
        bb.store("r1", "c", 0, list(range(6)), complete=outcome == "completed")
        if outcome == "failed":
            keys = [bb.key("c", 0, c) for c in range(6)]
            bb.rec.store_completed("r1", keys, bb.positions("c", 0, list(range(6))), 0, False)
        a.episode("r2", 120, external=0, chain="c", scans=[(0, [(0, "MISS")])])
        a.store("r2", "c", 0, list(range(7)))
        a.close()
        bb.close()
        assert _rows(d, "A") == expected, outcome


def test_each_row_counts_the_episodes_with_tokens_in_it(tmp_path: Path) -> None:
    """`episodes` of a row: how many episodes put any token there (not every episode of
    the engine), per cause for shortfalls, and the ``all`` rows sum the engines'."""
    b = new_builder(tmp_path / "t", geometry=GEO)
    b.prime("r1", "c", 100, swa_chunks={1: [5]})
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.episode("r3", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.prime("r4", "d", 100, swa_chunks={1: [4, 5]})
    b.close()
    lost = diff(open_trace(str(tmp_path / "t")), all_episodes=True).lost
    assert lost is not None
    assert {(r.engine, r.label): (r.tokens, r.episodes) for r in lost.rows} == {
        (e, label): counts
        for e in ("engine-a", "all")
        for label, counts in {
            "cold: not stored anywhere": (200, 2),
            "short of E (RULE): never_offered, group 1": (192, 2),
            "recomputed past E (by design)": (8, 2),
        }.items()
    }
    assert lost.episodes == {"engine-a": 4, "all": 4}


def test_promoted_tokens_are_the_served_part_of_the_requests_promoted_chunks() -> None:
    """Only accepted tokens (gpu_prefix, served] count, in chunks the episode's own request
    promoted before the episode; a chunk promoted twice counts once, for its latest tier."""
    import polars as pl

    from keytrace.analysis.lost import promoted_tokens

    episodes = pl.LazyFrame(
        {
            "inst": [1, 1],
            "s": [10, 20],
            "req_id": ["a", "b"],
            "gpu_prefix": [16, 0],
            "served": [56, 0],
        }
    )
    promotions = pl.DataFrame(
        {
            "inst": [1, 1, 1, 1, 1, 2],
            "req_id": ["a", "a", "a", "a", "b", "a"],
            "seq": [3, 4, 5, 12, 6, 7],
            "tier": [0, 0, 1, 0, 0, 0],
            "lo": [0, 16, 16, 32, 0, 32],  # [0,16) is on the GPU; seq 12 is after s
            "hi": [16, 32, 32, 48, 16, 48],
        },
        schema_overrides={"tier": pl.Int32},
    )
    got = promoted_tokens(episodes, promotions).collect().sort("tier")
    assert got.rows() == [(1, 10, 0, 0), (1, 10, 1, 16)]
