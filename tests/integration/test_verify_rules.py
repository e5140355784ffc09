"""Rules verified, not assumed, on the installed vLLM: the header fingerprints the code
that decides keys and rules (``rules_digest``), ``keytrace doctor`` says whether the oracle
verified keytrace's rules on that code (``judge``), and ``keytrace doctor --verify`` runs
the oracle here and keeps what it found for the traces this code records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.judge import trust  # noqa: E402
from keytrace.judge.trust import RulesTrust, Verification  # noqa: E402
from keytrace.vllm.hook import rulecode  # noqa: E402
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine's verifications in a folder of the test's own, and no shipped ones:
    the installed code starts unverified."""
    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(trust, "VERIFIED_FILE", tmp_path / "none.json")
    return tmp_path / "cache"


def test_the_digest_covers_the_rule_bearing_code_and_moves_with_it() -> None:
    found = rulecode.code_digests()
    assert set(found) == {q for _, q in rulecode.RULE_BEARING}
    # the functions every supported release has are read, not reported absent
    for name in (
        "OffloadingConnectorScheduler._lookup",
        "OffloadingConnectorScheduler._build_store_jobs",
        "hash_block_tokens",
    ):
        assert found[name] not in ("absent", "no source"), name
    digest = rulecode.rules_digest()
    assert len(digest) == 16 and rulecode.header_digest() == digest
    changed = dict(found, **{"OffloadingConnectorScheduler._lookup": "0" * 16})
    assert rulecode.rules_digest(changed) != digest


def test_a_trace_is_judged_by_what_the_oracle_found_on_its_code(
    own_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = tmp_path / "t"
    # the geometry stock vLLM's rules agree on: AGREE is what a dispute takes away
    run_workload(WorkloadSpec(geometry="hybrid", seed=3, conversations=3), str(t))
    header = open_trace(str(t)).header
    assert header["rules_digest"] == rulecode.rules_digest()
    assert main(["diff", str(t)]) == 0
    assert capsys.readouterr().out.startswith("note: verdicts apply rules not verified")
    digest = header["rules_digest"]
    trust.record_run(digest, Verification("test", 10, 0, "now"))
    assert main(["diff", str(t)]) == 0
    assert capsys.readouterr().out.startswith("AGREE")
    assert main(["doctor", "--json"]) == 0
    judge = [c for c in json.loads(capsys.readouterr().out)["capabilities"] if c["name"] == "judge"]
    assert judge and judge[0]["ok"]
    trust.record_run(digest, Verification("test", 10, 1, "later"))
    assert main(["diff", str(t)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("RULES DISPUTED") and "AGREE:" not in out
    assert main(["diff", "--by", "engine", str(t)]) == 2  # the fleet view says it too
    out = capsys.readouterr().out
    assert out.startswith("RULES DISPUTED") and "NO VERDICT (rules disputed)" in out
    assert main(["doctor", "--json"]) == 0  # recording still works; the judge does not
    judge = [c for c in json.loads(capsys.readouterr().out)["capabilities"] if c["name"] == "judge"]
    assert not judge[0]["ok"] and "disputed" in judge[0]["reason"]


def test_doctor_verify_runs_the_oracle_and_keeps_the_outcome(
    own_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert rulecode.status().trust is RulesTrust.UNVERIFIED
    # one workload, whatever the machine's speed (a time budget alone let a fast CI
    # machine start a second one)
    argv = ["doctor", "--verify", "--workloads", "1", "--episodes", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workloads"] == 1 and out["episodes"] > 0 and out["disagreements"] == []
    assert out["runs"][0]["checked"] == out["episodes"]
    st = rulecode.status()
    assert st.trust is RulesTrust.VERIFIED and st.episodes == out["episodes"]
    assert (own_cache / "verified" / f"{st.digest}.json").exists()
    # the one workload was no recurrent one: doctor says what it did not cover
    assert out["covers"] == ["attention"]
    check = rulecode.judge_capability().checks[0]
    assert check.ok and check.what.endswith(
        "not on recurrent state groups (keytrace doctor --verify runs them)"
    )
    trust.record_run(st.digest, Verification("x", 5, 0, "t", covers=("recurrent",)))
    assert rulecode.judge_capability().checks[0].what.endswith("recurrent state groups too")


def test_the_plan_covers_every_layout_and_drafter_before_repeating() -> None:
    from keytrace.vllm.lab.verify import (
        CHECKPOINT_LAYOUTS,
        DCP_LAYOUTS,
        DRAFTERS,
        LAYOUTS,
        PARTIAL_LAYOUTS,
        RECURRENT_LAYOUTS,
        RETENTION_LAYOUTS,
        first_pass,
        plan,
    )

    specs = list(plan())
    first = specs[: first_pass(DRAFTERS, recurrent=True, layouts=True, retention=True)]
    plain = [
        s
        for s in first
        if "recurrent" not in s.geometry and s.retention_interval == 0 and not s.dcp
    ]
    assert {(s.drafter, s.geometry, s.tiers) for s in plain} == {
        (d, g, t) for d in DRAFTERS for g, t, _ in LAYOUTS
    }
    recurrent = [s for s in first if s.geometry.startswith("recurrent") and not s.dcp]
    assert [(s.geometry, s.tiers, s.blocks_per_chunk, s.drafter) for s in recurrent] == [
        (g, t, bpc, d) for g, t, _, bpc, d in RECURRENT_LAYOUTS
    ]
    dcp = [s for s in first if s.dcp]
    assert [
        (
            s.geometry,
            s.tiers,
            s.cpu_chunks,
            s.blocks_per_chunk,
            s.dcp,
            s.prefix_match_unit,
            s.drafter,
        )
        for s in dcp
    ] == list(DCP_LAYOUTS)
    # every retention layout once, with its interval (dense: None) and its own settings
    kept = [s for s in first if s.retention_interval != 0]
    assert [
        (s.geometry, s.tiers, s.cpu_chunks, s.blocks_per_chunk, s.retention_interval, s.drafter)
        for s in kept
    ] == list(RETENTION_LAYOUTS)
    assert None in {s.retention_interval for s in kept} and len(first) == len(
        plain + recurrent + dcp + kept
    )
    assert len({s.seed for s in specs}) == len(specs)  # every workload its own traffic
    lookahead = list(plan(drafters=DRAFTERS[1:], recurrent=False, retention=False))
    assert {s.drafter for s in lookahead} == set(DRAFTERS[1:])
    only = list(plan(layouts=False, retention=False))
    assert only and {s.geometry for s in only} == {
        "recurrent",
        "recurrent_mtp",
        "dsv3",
        "dsv3_mla",
    }
    assert {s.geometry for s in only if not s.dcp} == {"recurrent", "recurrent_mtp"}
    retention = list(plan(layouts=False, recurrent=False))
    assert retention and all(s.retention_interval != 0 for s in retention)
    assert not [s for s in only if s.prefix_match_unit and not s.dcp]  # partial: when asked
    partial = list(plan(seeds=1, layouts=False, recurrent=False, retention=False, partial=True))
    assert [(s.geometry, s.cpu_chunks, s.prefix_match_unit) for s in partial] == [
        (g, cpu, unit) for g, tiers, cpu, unit in PARTIAL_LAYOUTS if not tiers
    ]
    assert all(s.blocks_per_chunk == 1 and not s.tiers for s in partial)
    assert not [s for s in specs if s.geometry == "nemotron_h"]  # checkpoints: when asked
    checkpoint = list(
        plan(seeds=2, layouts=False, recurrent=False, retention=False, checkpoint=True)
    )
    assert [(s.geometry, s.tiers, s.blocks_per_chunk, s.dcp) for s in checkpoint] == [
        (g, t, bpc, n) for g, t, _, bpc, n in CHECKPOINT_LAYOUTS
    ] * 2
    assert [s.seed for s in checkpoint] == [900, 901, 902, 903, 1900, 1901, 1902, 1903]


def test_a_workload_vllm_fails_on_is_skipped_with_where_not_a_crash(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keytrace.vllm.lab import verify as v

    def fails(*args: object, **kwargs: object) -> None:
        raise AssertionError("vLLM's own assert")

    monkeypatch.setattr(v, "study_workload", fails)
    out = v.verify(budget_seconds=1, keep=True)
    assert out.workloads == 0 and out.episodes == 0 and not out.verified
    assert out.skipped and "AssertionError at test_verify_rules.py:" in out.skipped[0]
    assert not (own_cache / "verified").exists()  # nothing checked: nothing kept
