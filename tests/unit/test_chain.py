"""The junction a request carries: vLLM sets ``shared_prefix_boundary`` afresh at every
lookup and its store path reads the value carried when it stores, so a junction counts
for the offers between the episode that reported it and the request's next episode. The
live chain book (`keytrace.record.chain.ChainBook`) and the differ's columns
(`keytrace.analysis.boundaries.request_boundaries`) keep the same window."""

from __future__ import annotations

import polars as pl

from keytrace.analysis.boundaries import request_boundaries
from keytrace.format.keys import make_key
from keytrace.judge import definitions as d
from keytrace.judge.rules import Group
from keytrace.record.chain import ChainBook

FA = Group(gid=3, tpc=64, window=None, kind="full_attention")
SWA = Group(gid=1, tpc=64, window=2, sliding_window=128)
MAMBA = Group(gid=0, tpc=64, window=1, kind="mamba")


def _key(n: int) -> bytes:
    return make_key(n.to_bytes(32, "big"), FA.gid)


def test_a_junction_counts_until_the_request_looks_up_again() -> None:
    book = ChainBook([SWA, FA])
    book.begin("r", 700, 128)  # episode 10: carries the junction at 128
    book.offered("r", [_key(1)], [128], 11)
    book.begin("r", 700, 0)  # episode 20 (resumed after preemption): carries none
    book.offered("r", [_key(2), _key(3)], [128, 640], 21)
    assert book.intended([_key(1)], 30) == ({128}, 700)
    assert book.intended([_key(2)], 30) == (set(), None)  # after its window closed
    assert book.intended([_key(3)], 30) == ({640}, 700)  # its own boundary: always
    book.begin("r", 700, 130)  # episode 40: carries one again (aligned down)
    book.offered("r", [_key(4)], [128], 41)
    assert book.intended([_key(4)], 50) == ({128}, 700)


def test_a_recurrent_junction_counts_only_once_computed_through() -> None:
    book = ChainBook([MAMBA, FA])
    book.begin("r", 700, 128)  # lookup start: where computation begins is not known
    book.offered("r", [_key(1)], [128], 11)
    book.begin("r", 700, 128, computed_from=64)  # answered: computes through 128
    book.offered("r", [_key(2)], [128], 12)
    book.begin("r", 700, 128, computed_from=448)  # resumed with a hit past it
    book.offered("r", [_key(3)], [128], 21)
    assert [book.intended([_key(n)], 30)[0] for n in (1, 2, 3)] == [set(), {128}, set()]


def test_the_differ_keeps_the_same_windows() -> None:
    episodes = pl.LazyFrame(
        {
            "inst": [1, 1, 1, 1],
            "req_id": ["r", "r", "r", "q"],
            "s": [10, 20, 40, 15],
            "P": [700, 700, 700, 300],
            "spb": [128, 0, 130, 64],
            "S": [0, 0, 0, 0],
            "X": [0, 0, 0, 0],
        },
        schema_overrides={c: pl.Int64 for c in ("inst", "s", "P", "spb", "S", "X")},
    )
    got = request_boundaries(episodes, [SWA, FA]).collect().sort("req_id", "b", "since")
    rows = list(zip(got["req_id"], got["b"], got["since"], got["until"], strict=True))
    assert rows == [
        ("q", 64, 15, None),  # q's junction, its only episode: no end
        ("q", 256, 15, None),  # q's own boundary
        ("r", 128, 10, 20),  # episode 10's junction until episode 20 looked up again
        ("r", 128, 40, None),
        ("r", 640, 10, None),
    ]
    assert d.request_boundaries([SWA, FA], 700, 0) == [640]
