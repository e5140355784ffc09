"""Decode context parallelism (DCP > 1) on the real scheduler.

Under DCP each rank holds 1/DCP of an attention block's tokens, so vLLM's scheduler, GPU
prefix cache and OffloadingConnector all see an attention block of block x DCP tokens
(``resolve_dcp_kv_block_size``), while a recurrent group's state is not sharded and keeps
its block. On a hybrid recurrent model the full-attention chunk is then DCP recurrent
chunks, the connector turns partial tails off, and the GPU cache keeps a prompt's last
state at the hash unit (``partial_hash_hits_enabled`` accepts a recurrent block equal to
it under DCP): a resend loads nothing unless that state ends a full-attention chunk
(vllm#57216's symptom on the released code). The lab builds the real ``VllmConfig`` with
``decode_context_parallel_size`` over as many TP ranks; only the worker (which now
acknowledges for every rank) is replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import (  # noqa: E402
    DSV3,
    RECURRENT,
    Geometry,
    geometry_from_header,
    synthetic_header,
)
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.vllm.hook.patches import recording  # noqa: E402
from keytrace.vllm.lab.harness import Harness  # noqa: E402
from tests.integration.vllm_builds import DEFAULT_CACHE, run_python  # noqa: E402

pytestmark = pytest.mark.vllm

DCP2 = RECURRENT.with_(dcp=2)
"""Qwen3-Next-like at DCP 2: recurrent chunks of 64 tokens, full-attention chunks of 128,
hash unit 64 (vllm#57216 at DCP 8: 1,536 and 12,288)."""


def _prime_and_resend(geometry: Geometry, d: Path, n: int) -> tuple[int, Harness]:
    with recording(d):
        h = Harness(geometry, max_prompt_tokens=n)
        h.submit_tokens(h.tokens(n, chain=0))
        h.run_until_idle(give_up=True)
        h.reset_gpu_prefix_cache()
        rid = h.submit_tokens(h.tokens(n, chain=0))
        h.run_until_idle(give_up=True)
    h.close()
    return h.observations[rid].external_tokens, h


def test_the_lab_builds_vllms_own_dcp_and_the_header_records_it(tmp_path: Path) -> None:
    external, h = _prime_and_resend(DCP2, tmp_path / "t", 700)
    # vLLM's own resolution, from a real VllmConfig over 2 TP ranks
    par = h.vllm_config.parallel_config
    assert (par.decode_context_parallel_size, par.tensor_parallel_size, par.world_size) == (2, 2, 2)
    cfg = h.connector_scheduler.config
    assert [c.tokens_per_chunk for c in cfg.kv_group_configs] == [64, 64, 64, 128]
    assert cfg.tokens_per_hash == 64 and cfg.dcp_world_size == 2 and cfg.num_workers == 2
    assert cfg.supports_partial_tail is False  # the connector: DCP needs 1
    assert h.scheduler.dcp_world_size == 2
    # the GPU cache hits (and keeps states) at the hash unit, below the attention block
    assert h.kv_cache_config.cache_hit_alignment_tokens == 64
    # 699 // 64 * 64 = 640 ends a full-attention chunk: the state is there, the resend
    # loads it (every rank acknowledged the stores: the worker reports 2 per job)
    assert external == 640
    header = open_trace(str(tmp_path / "t")).header
    assert header["dcp_world_size"] == 2 and header["world_size"] == 2
    synthetic = synthetic_header(DCP2)
    for got, want in zip(header["groups"], synthetic["groups"], strict=True):
        for key in ("block_size", "tokens_per_block", "tokens_per_chunk", "hashes_per_chunk"):
            assert got[key] == want[key], key
    back = geometry_from_header(header)  # replay, sweep --from and the oracle rebuild it
    assert back.dcp == 2 and back.tokens_per_chunk(3) == 128
    assert main(["diff", str(tmp_path / "t")]) == 0


def test_a_resend_past_one_attention_chunk_loads_nothing_and_keytrace_names_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vllm#57216 on vLLM's released code: 1,000 tokens, resent. The GPU cache keeps the
    last state at 999 // 64 * 64 = 960, the connector stores it (960 is a recurrent chunk
    end), but 960 ends no 128-token full-attention chunk, and a hit must end one: lookup
    needs the state at 896, which no request computed."""
    external, _ = _prime_and_resend(DCP2, tmp_path / "t", 1000)
    assert external == 0  # vLLM's own answer
    trace = open_trace(str(tmp_path / "t"))
    stored = {
        (s["group_id"], s["end_token"])
        for s in trace.collect("store").to_dicts()
        if s["event"] == "completed"
    }
    assert (0, 960) in stored and (0, 896) not in stored and (3, 896) in stored
    assert main(["diff", "--json", str(tmp_path / "t")]) == 1
    report = json.loads(capsys.readouterr().out)
    # judged, on rules the oracle verified under DCP for this code (verified_rules.json)
    assert report["rules"]["needs"] == ["recurrent", "recurrent+dcp"]
    assert report["rules"]["trust"] == "verified"
    first = report["first_mismatch"]
    assert first["E"] == 896 and first["external_tokens"] == 0 and first["binding_group"] == 0
    assert first["terminal"]["chunk"] == 13 and first["terminal"]["cause"] == "no_checkpoint"


def test_sweep_and_workload_take_dcp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", "--geometry", "recurrent", "--dcp", "2", "--no-progress"]
    assert main([*argv, "--lengths", "700,1000"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("1 of 2 lengths mismatch")  # the summary line, then the table
    rows = [line.split() for line in lines[1:-1]]
    assert [(r[0], r[4], r[5]) for r in rows] == [("700", "640", "hit"), ("1,000", "0", "mismatch")]
    assert rows[1][-1] == "no_checkpoint"
    # vLLM refuses DCP with sliding-window groups: said before vLLM is asked
    assert main(["sweep", "--geometry", "hybrid", "--dcp", "2", "--lengths", "700"]) == 2
    assert "refuses decode context parallelism (dcp 2) with sliding-window" in (
        capsys.readouterr().err
    )
    assert main(["workload", "--geometry", "small", "--dcp", "2"]) == 2
    assert "sliding-window" in capsys.readouterr().err


def test_attention_under_dcp_is_served_as_keytrace_expects(tmp_path: Path) -> None:
    """Attention only (MLA and its MTP group, blocks of 64 x 2 tokens): the MTP group's
    lookup pops its peek chunk (`rules.peek_cap`, `definitions.fa_prefix_end`), so no
    resend falls short of E: this workload once read 20+ mismatches, each one chunk short
    by vLLM's design, which the oracle could not refute (it checks shortfalls against what
    was offered). Now: hits, no shortfall, the live alarm counting the same."""
    from keytrace.vllm.lab.workload import WorkloadSpec, study_workload

    spec = WorkloadSpec(geometry=DSV3.name, seed=0, conversations=10, dcp=2)
    study = study_workload(spec, str(tmp_path / "t"), alarm=True, oracle=True)
    assert study.report.header["dcp_world_size"] == 2
    assert study.report.counts.get("hit", 0) >= 10
    assert not study.report.counts.get("mismatch") and not study.oracle
    assert study.alarm_counts == study.report.counts


def test_doctor_verify_runs_the_dcp_layouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round of `keytrace doctor --verify`'s DCP layouts (DCP 2 and 4, chunks of one
    and two blocks, a hash unit below the block, the MTP drafter, MLA attention on a CPU
    tier and on a tiered manager, with and without its MTP group): every shortfall looked
    up again alone agrees with the differ, the live alarm counts the same, and the run
    says it covered recurrent and attention groups under DCP."""
    from keytrace.vllm.hook.support import vllm_info
    from keytrace.vllm.lab.verify import DCP_LAYOUTS, verify

    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path / "cache"))
    out = verify(
        layouts=False,
        recurrent=False,
        dcp=True,
        retention=False,
        seeds=1,
        keep=False,
        min_episodes=1,
    )
    assert out.episodes >= 50 and out.disagreements == [], out.disagreements
    assert sum(r.episodes.get("mismatch", 0) for r in out.runs) > 0  # states that end no chunk
    mtp = [g for g, *_ in DCP_LAYOUTS if g == "recurrent_mtp"]
    # MLA + MTP on a tiered manager without lookahead hashes: recorded, not judged
    # (trust.uncovered); on 0.33.0 a drafter's hashes never look ahead
    legacy_tiered = [
        g for g, tiers, *_, drafter in DCP_LAYOUTS if g == "dsv3" and tiers and drafter is None
    ]
    drafted_tiered = [
        g for g, tiers, *_, drafter in DCP_LAYOUTS if g == "dsv3" and tiers and drafter
    ]
    assert legacy_tiered and drafted_tiered
    if (vllm_info().version or "").startswith(("0.31", "0.32", "0.33")):
        skipped = len(mtp) + len(legacy_tiered) + len(drafted_tiered)
        lookahead = set()
    else:
        skipped = len(legacy_tiered)
        lookahead = {"recurrent+lookahead"}
    assert out.workloads == len(DCP_LAYOUTS) - skipped and len(out.skipped) == skipped
    assert (
        set(out.covers)
        == {
            "recurrent",
            "recurrent+dcp",
            "attention",
            "attention+dcp",
        }
        | lookahead
    )
    # DeepSeek-V3-like MLA + MTP under DCP on a CPU tier: every resend the traffic makes is
    # served as keytrace expects (before the popped peek was a rule, every shortfall was a
    # false mismatch: E one chunk above what vLLM serves by design); the LRU tier evicts a
    # prefix from its start, so no shortfall is left there for the oracle
    on_cpu = [r for r in out.runs if r.workload.startswith("dsv3 ") and "+fs" not in r.workload]
    assert len(on_cpu) == 2 and all(r.episodes.get("hit", 0) > 0 for r in on_cpu)
    assert not any(r.episodes.get("mismatch") for r in on_cpu)
    assert not any(r.checked for r in on_cpu)
    # MLA alone over fs: the tiered manager's promotions leave shortfalls, each checked
    tiered = [r for r in out.runs if r.workload.startswith("dsv3_mla")]
    assert len(tiered) == 3 and all(r.checked > 0 for r in tiered), tiered


SENDS_034 = """
import json, tempfile
import vllm
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import RECURRENT
from keytrace.format.reader import open_trace
from keytrace.vllm.hook.patches import recording
from keytrace.vllm.lab.harness import Harness

with tempfile.TemporaryDirectory() as d:
    with recording(d):
        h = Harness(RECURRENT.with_(dcp=2), max_prompt_tokens=1000)
        rids = []
        for i in range(4):
            if i:
                h.reset_gpu_prefix_cache()
            rids.append(h.submit_tokens(h.tokens(1000)))
            h.run_until_idle(give_up=True)
    h.close()
    report = diff(open_trace(d), all_episodes=True)
    print(json.dumps({
        "version": vllm.__version__,
        "served": [h.observations[r].external_tokens for r in rids],
        "verdicts": [v.verdict for v in report.episodes],
        "trust": report.rules.as_json()["trust"],
    }))
"""


def test_on_0_34_the_same_resend_loads_nothing_until_a_send_computes_the_state() -> None:
    """vLLM 0.34.0's own code (its sdist, a fresh interpreter): the same 0 at 1,000 tokens,
    and, as with chunks of two blocks, the missed lookup pins a junction at 896 where the
    next send computes and stores a state: the third send loads it (0.33.0: never)."""
    r = run_python(
        SENDS_034,
        release="0.34.0",
        env={"VLLM_CACHE_ROOT": str(DEFAULT_CACHE / "vllm-cache-0.34")},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0"
    assert found["served"] == [0, 0, 896, 896]
    assert found["verdicts"] == ["cold", "mismatch", "hit", "hit"]
    assert found["trust"] == "verified"
