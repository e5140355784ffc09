"""Candidate fixes (`keytrace.vllm.mods.fixes`) for the stock 0.33.0 MTP peek miss, measured on the
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

import polars as pl
import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import Geometry, GroupGeom, builtin  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.keys import key_gid  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.vllm.lab.replay import replay  # noqa: E402
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload  # noqa: E402

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
    ("geometry", "cpu"),
    [("dsv4", 100_000), ("dsv4", None), ("small", None)],
    ids=["dsv4", "dsv4-evicting", "small-evicting"],
)
def test_eagle_proof_key_on_real_traffic(
    geometry: str, cpu: int | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the fix no rule mismatch, and the live alarm agrees with the differ episode by
    episode (with evictions, a needed peek whose group vLLM never scanned is judged by the
    proof key the recorder listed)."""
    import logging

    from keytrace.analysis.diff import diff
    from keytrace.live.registry import alarms
    from tests.alarm_checks import SETTINGS, assert_alarm_agrees

    caplog.set_level(logging.WARNING, logger="keytrace")
    counts = {}
    for fix in (None, "eagle_proof_key"):
        spec = WorkloadSpec(geometry=geometry, seed=11, cpu_chunks=cpu, fix=fix)
        caplog.clear()
        run_workload(spec, str(tmp_path / str(fix)), alarm=SETTINGS)
        warnings = [
            m.getMessage() for m in caplog.records if "write-only offload" in m.getMessage()
        ]
        assert_alarm_agrees(str(tmp_path / str(fix)), alarms(), warnings)
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

    from keytrace.vllm.hook.patches import fixed

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


def test_under_eagle_proof_key_an_evicted_proof_is_capacity_not_a_rule_bug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """small (A = 64, MTP group 2 with 16-token chunks, W = 2), 1,033 tokens: E = 1,024 and
    the peek chunk 64 ([1,024, 1,040)) is past the prompt, so under the fix the store keeps
    chunks 62, 63 and the *proof* of 64, and the lookup queries exactly those (its key list
    has the proof as a 65th key). A second conversation then evicts part of them from a
    40-chunk CPU tier. The resend falls short for capacity: judged with stock rules it
    would need 61-63 and call 61 never offered (a false rule mismatch, exit 1); keytrace
    reads the proof rows the recorder lists and judges 62-64, the proof by its own store
    history. The live alarm agrees episode by episode."""
    import dataclasses
    import logging

    from keytrace.analysis import frames
    from keytrace.analysis.diff import diff
    from keytrace.live.registry import alarms
    from keytrace.vllm.hook.patches import fixed, recording
    from keytrace.vllm.lab.harness import Harness
    from tests.alarm_checks import SETTINGS, assert_alarm_agrees

    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "t")
    with fixed("eagle_proof_key"), recording(d, SETTINGS):
        h = Harness(dataclasses.replace(builtin("small"), cpu_chunks=40), max_prompt_tokens=1_100)
        h.submit(1_033, chain=0)
        h.run_until_idle()
        h.submit(1_033, chain=1)  # another conversation: evicts part of the first
        h.run_until_idle()
        h.reset_gpu_prefix_cache()
        resend = h.submit(1_033, chain=0)
        h.run_until_idle()
    trace = open_trace(d)
    v = diff(trace, request=resend, all_episodes=True).episodes[-1]
    assert (v.verdict, v.E, v.external_tokens) == ("explained", 1_024, 0), v.reason
    mtp = {n.chunk: n for n in v.needed if n.group_id == 2}
    assert sorted(mtp) == [62, 63, 64]
    proofs = frames.collect(frames.proofs(trace).filter(pl.col("req_id") == resend))
    proof_64 = proofs.filter((pl.col("gid") == 2) & (pl.col("chunk") == 64))["key"].to_list()
    assert [mtp[64].key] == [bytes(k).hex() for k in proof_64]
    assert mtp[64].cause == "evicted" and mtp[63].cause == "evicted"
    warnings = [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]
    assert_alarm_agrees(d, alarms(), warnings)


# The second disagreement (docs/findings.md), as `keytrace fuzz` shrank it: full attention
# block 16 + a sliding window of 5 tokens in 4-token blocks, a 32-token resend. The store
# keeps the w - 1 = 4 tokens of context (one chunk) before E = 16; stock lookup asks for
# cdiv(5, 4) = 2 chunks, the fix for cdiv(4, 4) = 1.
WINDOW_PLUS_ONE = Geometry(
    name="fuzz-window-plus-one",
    groups=(GroupGeom("full_attention", 16), GroupGeom("sliding_window", 4, sliding_window=5)),
)


@pytest.mark.parametrize(
    ("fix", "external", "verdict", "window"),
    [
        (None, 0, "mismatch", 2),
        ("window_minus_one", 16, "hit", 1),
        ("eagle_proof_key,window_minus_one", 16, "hit", 1),
        ("eagle_proof_key", 0, "mismatch", 2),
    ],
)
def test_window_minus_one_closes_the_window_plus_one_class(
    fix: str | None, external: int, verdict: str, window: int, tmp_path: Path
) -> None:
    d = tmp_path / "t"
    r = replay(WINDOW_PLUS_ONE, [32], 32, trace_dir=d, fix=fix)
    assert (r.external_tokens, r.verdict, r.expected_E) == (external, verdict, 16), r.explain()
    header = open_trace(str(d)).header
    assert [g["window_chunks"] for g in header["groups"]] == [None, window]
    assert header["vllm_modified"] == [f"fix:{n}" for n in (fix or "").split(",") if n]


def test_window_minus_one_on_a_sweep(tmp_path: Path) -> None:
    """docs/findings.md's table: full attention 64 + SWA block 16, window 33: every length
    misses on stock vLLM, every length hits with the fix (window 32 hits either way)."""
    from keytrace.vllm.lab.sweep import run_sweep

    lengths = list(range(1_000, 1_061, 20))
    for window, fix, want in [
        (33, None, "mismatch"),
        (33, "window_minus_one", "hit"),
        (32, "window_minus_one", "hit"),
    ]:
        geo = Geometry(
            name=f"w{window}",
            groups=(
                GroupGeom("full_attention", 64),
                GroupGeom("sliding_window", 16, sliding_window=window),
            ),
        )
        rows = run_sweep(geo, lengths, fix=fix)
        assert [r.verdict for r in rows] == [want] * len(lengths), (window, fix, rows)


def _scan_numbers(d: str) -> dict[tuple[int, int], list[int]]:
    """(instance, episode) -> the scan numbers its lookup rows carry, in order; each scan
    row's keys all of its own group (a scan the recorder missed would be merged into the
    one before it)."""
    lookups = open_trace(d).frame("lookup").filter(pl.col("scan") >= 0)
    mixed = (
        lookups.select("group_id", pl.col("head_keys").alias("k"))
        .explode("k")
        .filter(key_gid(pl.col("k")) != pl.col("group_id"))
        .collect()
    )
    rows = lookups.group_by("instance_id", "episode").agg(pl.col("scan").sort()).collect()
    assert mixed.height == 0
    return {(i, e): list(s) for i, e, s in rows.iter_rows()}


@pytest.mark.parametrize("fix_first", [True, False], ids=["fix-then-record", "record-then-fix"])
def test_recording_stays_outermost_whatever_the_order(fix_first: bool, tmp_path: Path) -> None:
    """``eagle_proof_key`` replaces ``_sliding_window_lookup``, the helper whose calls the
    recorder counts as scans. Whichever was switched on first, the record row wraps the fix
    (`keytrace.vllm.hook.patches.LAYER_RANK`), so every scan is counted once: each
    episode's scans are numbered 0..n-1, and the fix's lookups are recorded inside them."""
    import contextlib

    from keytrace.vllm.hook.patches import fixed, recording
    from keytrace.vllm.lab.harness import Harness

    d = str(tmp_path / "t")
    with contextlib.ExitStack() as stack:
        if fix_first:
            stack.enter_context(fixed("eagle_proof_key"))
        stack.enter_context(recording(d))
        if not fix_first:
            stack.enter_context(fixed("eagle_proof_key"))
        h = Harness(builtin("dsv4"), max_prompt_tokens=18_100)
        for n in (17_975, 18_039):
            h.submit(n, chain=0)
            h.run_until_idle()
            h.reset_gpu_prefix_cache()
    scans = _scan_numbers(d)
    assert scans and all(s == list(range(len(s))) for s in scans.values()), scans
    assert max(len(s) for s in scans.values()) >= 3  # episodes that scanned several groups
    mtp = open_trace(d).frame("lookup").filter((pl.col("scan") >= 0) & (pl.col("group_id") == 2))
    assert mtp.collect().height > 0  # the fix's own scans of the MTP group, recorded
    trace = open_trace(d)
    assert trace.header["vllm_modified"] == ["fix:eagle_proof_key"]


def test_a_harness_built_with_modifications_in_the_environment_patches_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KEYTRACE_INJECT``/``KEYTRACE_FIX`` are read by entry points (the plugin, `replay`),
    scoped to them; building a harness leaves vLLM as it was."""
    from keytrace.vllm.hook.patches import modifications
    from keytrace.vllm.lab.harness import Harness

    monkeypatch.setenv("KEYTRACE_INJECT", "pre48911")
    monkeypatch.setenv("KEYTRACE_FIX", "eagle_proof_key")
    Harness(builtin("small"))
    assert modifications() == []
    r = replay(builtin("small").to_dict(), [1_030], 1_030)  # a generated regression's run
    assert open_trace(r.trace_dir).header["vllm_modified"] == [
        "fix:eagle_proof_key",
        "inject:pre48911",
    ]
    assert modifications() == []  # and undone after it
