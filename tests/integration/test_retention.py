"""vLLM's ``prefix_cache_retention_interval`` on the real 0.33.0 scheduler (CPU lab).

What vLLM does with it (docs/diff.md, "Retention intervals"): the store path keeps
sliding-window tails at each request's own boundary and junctions (0, the default), at every
multiple of the interval too (N > 0: ``SlidingWindowManager.reachable_block_mask``'s
segment tails), or at every full-attention chunk boundary (None, dense). The lookup side
does not read it. keytrace's standing boundaries say the same
(`keytrace.judge.definitions.standing_boundaries`); these tests hold them against the real
scheduler, the live alarm and the isolated-lookup oracle.

Geometry ``hybrid``: FA tpc 64 + SWA tpc 16, window 32. A prompt that is a *prefix* of a
longer prime can hit only where the prime kept tails below its own boundary: a retention
interval's. Each replay is a fresh scheduler (prime, GPU-only reset, resend).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.alarm_checks import SETTINGS, assert_alarm_agrees
from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import HYBRID, RECURRENT, SMALL  # noqa: E402
from keytrace.analysis.results import NO_VERDICT  # noqa: E402
from keytrace.live.registry import alarms  # noqa: E402
from keytrace.vllm.lab.replay import replay  # noqa: E402

pytestmark = pytest.mark.vllm

PRIME = 2_000
"""The prime's prompt; its own boundary is round_down(1,999, 64) = 1,984."""


@pytest.mark.parametrize(
    ("retention", "E", "external"),
    [
        (0, None, 0),  # tails only at 1,984: the prefix resend is cold
        (128, 512, 512),  # tails every 128 tokens: round_down(576, 128)
        (None, 576, 576),  # dense: every FA chunk boundary, L = round_down(599, 64)
    ],
)
def test_a_prefix_resend_hits_where_the_retention_interval_kept_tails(
    tmp_path: Path, retention: int | None, E: int | None, external: int
) -> None:
    r = replay(HYBRID.with_(retention_interval=retention), [PRIME], 600, trace_dir=tmp_path)
    assert (r.expected_E, r.external_tokens) == (E, external)
    assert r.verdict == ("cold" if E is None else "hit")


def test_an_interval_inside_full_attention_chunks_is_hit_there(tmp_path: Path) -> None:
    # two blocks per chunk: FA chunk 128, SWA chunk 32; an interval of 192 (a multiple of
    # the blocks' LCM 64 and of the SWA chunk, as vLLM requires) is no multiple of 128.
    # vLLM's FA scan finds chunks to 256; the SWA group tightens the hit to its tail at 192
    # and the FA groups are not scanned again: it serves 192, inside FA chunk 1
    geo = HYBRID.with_(retention_interval=192, blocks_per_chunk=2)
    r = replay(geo, [PRIME], 300, trace_dir=tmp_path)
    assert (r.expected_E, r.external_tokens, r.verdict) == (192, 192, "hit")


@pytest.mark.parametrize(("last", "L"), [(800, 0), (1_000, 896)])
def test_a_local_hit_inside_a_chunk_loads_nothing_short_of_a_chunk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, last: int, L: int
) -> None:
    # Retention 0, two blocks per chunk (FA chunk 128): the GPU prefix cache hits at block
    # granularity (64). X (800 tokens) stores FA chunks to 768 and its own tail at 768;
    # after a GPU reset Y (720, a prefix) computes and leaves a GPU hit of 704 behind.
    # Z starts at S = 704 with the FA chunk [640, 768) and X's tail at 768 resident, and
    # vLLM loads nothing: a group's hit past S under one of its chunks is skipped ("We can
    # only load less than a chunk", _lookup_complete_chunks). Z of 800 tokens: its cap
    # 799 is under S + 128 (`lookup_cap`: L = 0); Z of 1,000: the cap is not, but the FA
    # run ends at 768, 64 past S (`fa_prefix_end`: F = S). Cold, not a mismatch at 768.
    from keytrace.vllm.hook.patches import recording
    from keytrace.vllm.lab.harness import Harness

    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "trace")
    with recording(d, SETTINGS):
        h = Harness(HYBRID.with_(blocks_per_chunk=2), max_prompt_tokens=last)
        rids = []
        for n, reset in ((800, False), (720, True), (last, False)):
            if reset:
                h.reset_gpu_prefix_cache()
            rids.append(h.submit_tokens(h.tokens(n)))
            h.run_until_idle()
        z = h.observations[rids[2]]
    assert (z.local_tokens, z.external_tokens) == (704, 0)
    warnings = [r.getMessage() for r in caplog.records if "write-only" in r.getMessage()]
    report = assert_alarm_agrees(d, alarms(), warnings)
    first = next(v for v in report.episodes if v.req_id == rids[2])
    assert (first.S, first.L, first.E, first.F, first.verdict) == (704, L, None, 704, "cold")
    assert report.first_mismatch is None and not warnings


def test_the_mtp_peek_is_unkeyable_at_a_retention_boundary_too(tmp_path: Path) -> None:
    # small (FA 64, SWA 16, MTP SWA 16; legacy hashes on 0.33.0), interval 128. The prime
    # keeps the MTP tail for 384 shifted for the peek: chunks 22, 23 and the peek 24
    # ([384, 400)). A prefix resend of 391 tokens cannot key chunk 24 (it ends at 400), so
    # its MTP lookup needs the run 21-23 and pops 23: 21 was never keyable by the tail at
    # 384. It falls back to 256. The same class as an identical resend's (docs/findings.md),
    # at every multiple of the interval: a write-only peek for every prefix that ends in
    # its first MTP chunk.
    r = replay(SMALL.with_(retention_interval=128), [PRIME], 391, trace_dir=tmp_path)
    assert (r.expected_E, r.external_tokens, r.verdict) == (384, 256, "mismatch")
    assert (r.binding_group, r.terminal_chunk, r.cause) == (2, 21, "not_keyable")


def test_recurrent_groups_under_a_retention_interval_are_not_judged(tmp_path: Path) -> None:
    # vLLM keeps a recurrent state at a multiple of the interval only where a prefill step
    # ended there: no standing boundary; keytrace has no rule for which, and says so
    r = replay(RECURRENT.with_(retention_interval=128), [PRIME], 600, trace_dir=tmp_path)
    assert r.verdict == NO_VERDICT
