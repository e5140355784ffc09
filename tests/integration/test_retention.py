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
import re
from pathlib import Path

import polars as pl
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


def test_the_oracle_holds_the_full_attention_chunk_e_falls_inside(tmp_path: Path) -> None:
    # The verify plan's first workload with two blocks per chunk and an interval of 192:
    # shortfalls at E = 192, 576, ... inside full-attention chunks of 128. The isolated
    # lookup must hold the chunk E falls in (vLLM's hit at 192 loads FA chunk 1's first
    # half): with only chunks ending by E it never reached 192 (four false disagreements
    # here before). The live alarm counts what the differ does.
    from keytrace.vllm.lab.workload import WorkloadSpec, study_workload

    spec = WorkloadSpec(
        geometry="hybrid",
        seed=704,
        conversations=10,
        cpu_chunks=16,
        blocks_per_chunk=2,
        retention_interval=192,
    )
    study = study_workload(spec, str(tmp_path / "wl"), alarm=True, oracle=True)
    cases = study.oracle or []
    inside = [c for c in cases if c.E is not None and c.E % 128]
    assert len(inside) >= 3, [c.describe() for c in cases]
    assert study.disagreements == [], [c.describe() for c in study.disagreements]
    assert study.alarm_counts == study.report.counts
    assert study.report.header["retention_interval"] == 192


@pytest.mark.parametrize(("given", "recorded"), [("128", 128), ("dense", None)])
def test_workload_and_sweep_take_a_retention_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str, recorded: int | None
) -> None:
    from keytrace.cli import main
    from keytrace.format.reader import open_trace

    out = tmp_path / "wl"
    args = ["workload", "-o", str(out), "--geometry", "hybrid", "--seed", "0"]
    args += ["--conversations", "6", "--cpu-chunks", "16", "--retention-interval", given]
    args += ["--oracle", "--alarm", "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "(the same as the differ's)" in text
    assert re.search(r"oracle: \d+ shortfall episodes? .* 0 disagreements", text)
    assert open_trace(str(out)).header["retention_interval"] == recorded
    # a sweep of prefixes of one 2,000-token prime: 128 keeps tails every 128 tokens,
    # dense at every FA chunk boundary (64)
    sweep = ["sweep", "--geometry", "hybrid", "--retention-interval", given]
    sweep += ["--prime-length", "2000", "--lengths", "600,700", "--quiet", "--no-progress"]
    assert main([*sweep, "--parquet", str(tmp_path / "s.parquet")]) == 0
    rows = pl.read_parquet(tmp_path / "s.parquet")
    want = [512, 640] if recorded else [576, 640]
    assert rows["E"].to_list() == want and rows["external"].to_list() == want


def test_a_retention_interval_that_is_not_one_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from keytrace.cli import main

    argv = ["sweep", "--lengths", "600", "--retention-interval", "sometimes"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "use a token count N or 'dense'" in err


RELEASE_034 = """
import json, tempfile
import vllm
from keytrace.analysis.geometry import SMALL, Drafter
from keytrace.vllm.lab.replay import replay

out = {"version": vllm.__version__}
for name, drafter in (("none", None), ("eagle", Drafter("eagle", 1))):
    geo = SMALL.with_(retention_interval=128, drafter=drafter)
    with tempfile.TemporaryDirectory() as d:
        r = replay(geo, [2000], 391, trace_dir=d)
    out[name] = [r.expected_E, r.external_tokens, r.verdict, r.cause]
print(json.dumps(out))
"""


def test_on_0_34_lookahead_hashes_close_the_peek_at_a_retention_boundary() -> None:
    # vLLM 0.34.0's own code (its sdist over the installed dependencies): without a
    # drafter the MTP group keeps legacy hashes and the 391-token prefix loses the
    # interval as on 0.33.0; with an EAGLE drafter every block hash looks ahead one token,
    # no block is dropped, and the prefix is served its E = 384
    import json

    from tests.integration.vllm_builds import DEFAULT_CACHE, run_python

    r = run_python(
        RELEASE_034,
        release="0.34.0",
        env={"VLLM_CACHE_ROOT": str(DEFAULT_CACHE / "vllm-cache-0.34")},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0"
    assert found["none"] == [384, 256, "mismatch", "not_keyable"]
    assert found["eagle"] == [384, 384, "hit", None]
