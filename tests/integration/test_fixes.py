"""Candidate fixes (`keytrace.vllm.fixes`) for the stock 0.33.0 MTP peek miss, measured on the
real scheduler (dsv4: A = 256, MTP group 2 with 64-token chunks, C4 group 3 with 4-token
chunks).

17,975 tokens: E = 17,920, and the MTP peek chunk 280 ([17,920, 17,984)) is past the prompt.
- stock: 0 external tokens, group 2 never offered chunk 277.
- mtp_left_chunk: group 2 now finds 277-279, pops 279, and the lookup's boundary drops to
  17,856 = E - 64, where the C4 group kept nothing: its scan starts at chunk 4,463 (tokens
  17,852-17,856) and misses. Still 0: storing more MTP chunks alone cannot reach E.
- unkeyable_peek_fallback: every group also keeps its tail for 17,664 = E - A (the MTP group
  with its peek chunk 276, which the prompt keys): 17,664 external tokens instead of 0. E
  itself stays out of reach, so keytrace still reports the shortfall against E = 17,920.
- eagle_proof_key: store also writes the proof key of the unkeyable peek (the chain hash at
  17,920 and token 17,920), lookup accepts it where the full peek is missing: 17,920, a hit.
  The next turn (18,039 tokens, whose chunk 280 is full and keyed by its own continuation)
  hits too, where stock vLLM misses it at chunk 280.
18,000 tokens (P - E = 80 >= 64: the peek is keyed): a hit at 17,920 with or without a fix.

Real traffic with and without eagle_proof_key (multi-turn, shared system prompts, two
engines, rerouting, preemption, late store acknowledgements): stock vLLM has rule mismatches
(the peek miss, and junction peeks keyed by one conversation's continuation), the fix none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import Geometry, GroupGeom, builtin  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.vllm.replay import replay  # noqa: E402
from keytrace.vllm.workload import WorkloadSpec, run_workload  # noqa: E402

CASES = [
    # fix, length, external, verdict, binding group, terminal chunk
    (None, 17_975, 0, "mismatch", 2, 277),
    ("mtp_left_chunk", 17_975, 0, "mismatch", 3, 4_463),
    ("unkeyable_peek_fallback", 17_975, 17_664, "mismatch", 2, 277),
    (None, 18_000, 17_920, "hit", None, None),
    ("mtp_left_chunk", 18_000, 17_920, "hit", None, None),
    ("unkeyable_peek_fallback", 18_000, 17_920, "hit", None, None),
    ("eagle_proof_key", 17_975, 17_920, "hit", None, None),
    ("eagle_proof_key", 18_000, 17_920, "hit", None, None),
]


@pytest.mark.parametrize(("fix", "n", "external", "verdict", "group", "chunk"), CASES)
def test_candidate_fix_on_the_real_scheduler(
    fix: str | None,
    n: int,
    external: int,
    verdict: str,
    group: int | None,
    chunk: int | None,
    tmp_path: Path,
) -> None:
    d = tmp_path / "t"
    r = replay(builtin("dsv4"), [n], n, trace_dir=d, fix=fix)
    assert (r.external_tokens, r.verdict, r.binding_group, r.terminal_chunk) == (
        external,
        verdict,
        group,
        chunk,
    ), r.explain()
    assert r.expected_E == (17_920 if n in (17_975, 18_000) else None)
    assert open_trace(str(d)).header["vllm_modified"] == ([f"fix:{fix}"] if fix else [])


def test_sweep_with_a_fix_names_it_and_refuses_unknown_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "sweep",
            "--lengths",
            "17975,18000",
            "--fix",
            "unkeyable_peek_fallback",
            "--quiet",
            "--csv",
            str(tmp_path / "s.csv"),
        ]
    )
    assert code == 1  # 17,975 still falls short of E
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert rows[1].startswith("17975,") and ",17664," in rows[1]
    assert rows[2].startswith("18000,") and ",17920," in rows[2]
    capsys.readouterr()
    assert main(["sweep", "--lengths", "100", "--fix", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fix", "external", "verdict", "chunk"),
    [(None, 0, "mismatch", 280), ("eagle_proof_key", 17_920, "hit", None)],
)
def test_next_turn_after_an_unkeyable_peek(
    fix: str | None, external: int, verdict: str, chunk: int | None, tmp_path: Path
) -> None:
    """Prime 17,975 tokens, then a longer prompt sharing them: its chunk 280 is full, so it
    queries the full peek, which the prime could not key."""
    r = replay(builtin("dsv4"), [17_975], 18_039, trace_dir=tmp_path / "t", fix=fix)
    assert (r.external_tokens, r.verdict, r.terminal_chunk) == (external, verdict, chunk), (
        r.explain()
    )


@pytest.mark.parametrize(
    ("geometry", "cpu"), [("dsv4", 100_000), ("small", None)], ids=["dsv4", "small-evicting"]
)
def test_eagle_proof_key_on_real_traffic(geometry: str, cpu: int | None, tmp_path: Path) -> None:
    from keytrace.analysis.diff import diff

    counts = {}
    for fix in (None, "eagle_proof_key"):
        spec = WorkloadSpec(geometry=geometry, seed=11, cpu_chunks=cpu, fix=fix)
        run_workload(spec, str(tmp_path / str(fix)))
        trace = open_trace(str(tmp_path / str(fix)))
        assert trace.header["vllm_modified"] == ([f"fix:{fix}"] if fix else [])
        counts[fix] = diff(trace).counts
    assert counts[None].get("mismatch", 0) >= 10, counts  # the traffic has the stock bug
    assert counts["eagle_proof_key"].get("mismatch", 0) == 0, counts
    assert counts["eagle_proof_key"]["hit"] > counts[None]["hit"], counts


# Found by `keytrace fuzz --fix eagle_proof_key` (seed 1) and shrunk: the MTP group's run
# reaches the first chunk (its window, with extra retained tokens, is longer than the
# prefix), which vLLM accepts whole; its peek needs the proof there too.
SHORT_PREFIX = Geometry(
    name="fuzz-short-prefix",
    groups=(
        GroupGeom("full_attention", 16),
        GroupGeom("sliding_window", 4, sliding_window=4),
        GroupGeom("sliding_window", 4, sliding_window=4),
        GroupGeom("sliding_window", 16, sliding_window=32, eagle=True, extra_retained_tokens=16),
    ),
    blocks_per_chunk=1,
    max_num_batched_tokens=32,
    max_model_len=1137,
    cpu_chunks=100_000,
)


@pytest.mark.parametrize(("fix", "external"), [(None, 0), ("eagle_proof_key", 32)])
def test_peek_of_a_run_from_the_first_chunk(fix: str | None, external: int, tmp_path: Path) -> None:
    r = replay(SHORT_PREFIX, [33], 49, trace_dir=tmp_path / "t", fix=fix)
    assert (r.external_tokens, r.expected_E) == (external, 32), r.explain()


def test_the_fix_leaves_calls_it_cannot_serve_to_vllm() -> None:
    """vLLM's own unit tests call the scan helper on a bare scheduler (no config) with
    integer keys; with the fix applied that call is vLLM's, unchanged."""
    from unittest.mock import MagicMock

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key

    from keytrace.vllm.patches import fixed

    sched = OffloadingConnectorScheduler.__new__(OffloadingConnectorScheduler)
    sched.manager = MagicMock()
    sched.manager.lookup.side_effect = lambda key, ctx: (
        LookupResult.HIT if key in (1, 2, 3) else LookupResult.MISS
    )
    with fixed("eagle_proof_key"):
        assert sched._sliding_window_lookup([0, 1, 2, 3], 2, MagicMock()) == 4
        assert sched._sliding_window_lookup([1, 2, 3], 4, MagicMock()) == 3
        # real OffloadKeys on a scheduler without a config: still vLLM's call
        keys = [make_offload_key(str(i).encode(), 0) for i in range(4)]
        hits = set(keys[1:])
        sched.manager.lookup.side_effect = lambda key, ctx: (
            LookupResult.HIT if key in hits else LookupResult.MISS
        )
        assert sched._sliding_window_lookup(keys, 2, MagicMock()) == 4
