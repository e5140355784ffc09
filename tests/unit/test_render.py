"""The text reporters, compared line for line (what a person reads is the contract)."""

from __future__ import annotations

import io
from pathlib import Path

from keytrace.analysis.diff import diff
from keytrace.analysis.summary import summarize
from keytrace.format.reader import open_trace
from keytrace.report.text import render_diff, render_summary
from tests.factories import TraceBuilder, new_builder
from tests.unit.test_diff import _build


def _text(render, obj) -> list[str]:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    render(obj, buf)
    return buf.getvalue().splitlines()


def test_mismatch_report(tmp_path: Path) -> None:
    trace = open_trace(str(_build(tmp_path, swa1=[5], episode_external=0)))
    assert _text(render_diff, diff(trace)) == [
        "MISMATCH: request r2 got 0 external tokens, expected 96 (E=96); binding group 1 (SWA), "
        "terminal chunk 4 (MISS)",
        "episodes: cold 1, mismatch 1",
        "",
        "MISMATCH: request r2 (engine engine-a, rank 0, step 0): 100 prompt tokens, local 0, "
        "external 0, expected boundary E=96 (cap L=96)",
        "  why: lookup needed chunks the store path did not keep: never offered by the store path",
        "  binding group 1 (SWA); terminal key chunk 4 (tokens 64–80) looked up as MISS: never "
        "offered by the store path",
        "  group 1 (SWA) needed chunks 4–5 for a hit at 96; store wrote 5 near there",
        "    group 1 chunk 4 [64, 80): lookup MISS; never offered by the store path",
        "",
        "where the tokens to prefill came from (2 lookups, 200 tokens):",
        "                                                              all engines",
        "  short of E (RULE): never_offered, group 1 (SWA)              96  48.0%",
        "  cold: not stored anywhere                                   100  50.0%",
        "  recomputed past E (by design)                                 4   2.0%",
    ]


def test_explained_and_agree_reports(tmp_path: Path) -> None:
    def evict(b: TraceBuilder) -> None:
        b.evict("r3", "c", 1, [4])

    d = _build(tmp_path, swa1=[4, 5], episode_external=0, swa1_results={5: "HIT"}, extra=evict)
    report = diff(open_trace(str(d)), all_episodes=True)
    lines = _text(render_diff, report)
    assert lines[:2] == [
        "AGREE: no store/lookup mismatch in 2 episodes",
        "episodes: cold 1, explained 1",
    ]
    assert (
        "  why: shortfall explained by timing/capacity/routing: evicted before the episode" in lines
    )
    assert "    group 1 chunk 4 [64, 80): lookup MISS; evicted before the episode" in lines
    assert (
        "COLD: request r1 (engine engine-a, rank 0, step 0): 100 prompt tokens, local 0, "
        "external 0, expected boundary E=- (cap L=96)" in lines
    )


def test_summary(tmp_path: Path) -> None:
    trace = open_trace(str(_build(tmp_path, swa1=[5], episode_external=0)))
    assert _text(render_summary, summarize(trace)) == [
        "trace: 2 parts from 1 recorder instance; vLLM 0.33.0, model None, blocks_per_chunk 1",
        "recorded: store events 14, key lookups 13, episodes 2, load events 0, step rows 0",
        "",
        "group  kind        tpc    stored prepared  not new evicted   lookups      HIT     MISS "
        "PENDING RETRY",
        "    0  FA           16         6        6        0       0         7        6        1 "
        "      0     0",
        "    1  SWA          16         1        1        0       0         6        1        5 "
        "      0     0",
        "(not new: offered to the store path and not written because the key was already "
        "stored, being stored, or under store_threshold)",
        "",
        "episodes (first 2):",
        "  request        prompt    local  external  accepted",
        "  r1                100        0         0         0",
        "  r2                100        0         0         0",
    ]


def test_summary_labels_mtp_and_lists_the_first_20_episodes(tmp_path: Path) -> None:
    b = new_builder(tmp_path / "t")
    for i in range(21):
        b.prime(f"r{i}", f"c{i}", 64, swa_chunks={1: [2, 3], 2: [2, 3]})
    b.close()
    lines = _text(render_summary, summarize(open_trace(str(tmp_path / "t"))))
    assert [ln.split()[:3] for ln in lines if ln.startswith("    2 ")] == [["2", "SWA,", "MTP"]]
    assert "episodes (first 20):" in lines
    assert sum(ln.startswith("  r") and not ln.startswith("  request") for ln in lines) == 20


def test_a_chunk_on_a_secondary_tier_is_not_listed_as_absent() -> None:
    """The text report lists the absent needed chunks, as the verdict counts them
    (`keytrace.judge.definitions.absent`): a chunk a secondary tier held (``on_tier``) was
    there to serve and is not listed; it was, when the report re-stated the rule without
    it."""
    from keytrace.analysis.results import EpisodeVerdict, NeededChunk
    from keytrace.report.text import render_episode

    def chunk(c: int, cause: str) -> NeededChunk:
        return NeededChunk(0, c, 16 * c, 16 * c + 16, None, "MISS", cause)

    v = EpisodeVerdict(
        verdict="mismatch",
        instance="i",
        instance_id=1,
        engine_id="e",
        dp_rank=0,
        req_id="r2",
        episode=9,
        step=3,
        num_prompt_tokens=100,
        S=0,
        L=96,
        E=96,
        external_tokens=0,
        accepted_tokens=0,
        binding_group=0,
        binding_label="FA",
        needed=[chunk(3, "on_tier"), chunk(4, "promotion_starved"), chunk(5, "resident")],
    )
    buf = io.StringIO()
    render_episode(v, buf, header={})
    listed = [line for line in buf.getvalue().splitlines() if line.startswith("    group 0 ")]
    assert listed == [
        "    group 0 chunk 4 [64, 80): lookup MISS; on a secondary tier; no CPU slot to promote "
        "it into, though the request fits the CPU tier beside the transfers in flight"
    ]


def test_counts_take_the_plural_they_need() -> None:
    from keytrace.report.text import plural

    assert [plural(n, "lookup") for n in (0, 1, 2, 1_000)] == [
        "0 lookups",
        "1 lookup",
        "2 lookups",
        "1,000 lookups",
    ]


def test_one_lookup_one_episode(tmp_path: Path) -> None:
    """A trace of one episode reads "1 lookup" and "1 episode", never "(s)"."""
    b = new_builder(tmp_path / "t")
    b.episode("r1", 64, external=0, scans=[(0, [(0, "MISS")])], chain="c")
    b.close()
    text = "\n".join(_text(render_diff, diff(open_trace(str(tmp_path / "t")))))
    assert "no store/lookup mismatch in 1 episode\n" in text
    assert "(1 lookup, 64 tokens)" in text
    assert "(s)" not in text
    summary = _text(render_summary, summarize(open_trace(str(tmp_path / "t"))))
    assert summary[0].startswith("trace: 1 part from 1 recorder instance; ")


def test_sweep_line() -> None:
    from keytrace.analysis.sweep import SweepRow
    from keytrace.report.text import sweep_line

    hit = SweepRow(1030, 512, 1, 1024, 1024, "hit", None, None, None, 0.1)
    miss = SweepRow(1028, 512, 1, 1024, 0, "mismatch", 2, 60, "never_offered", 0.1)
    assert sweep_line([hit]) == "0 of 1 length mismatch"
    assert sweep_line([hit, miss, miss]) == (
        "2 of 3 lengths mismatch: binding group 2, cause never_offered"
    )


def test_replay_names_its_cause_once() -> None:
    """The replay's line names the cause in the reason, not a second time around it."""
    from keytrace.vllm.lab.replay import ReplayResult

    r = ReplayResult(
        external_tokens=0,
        local_tokens=0,
        expected_E=17_920,
        verdict="mismatch",
        binding_group=2,
        binding_label="SWA, EAGLE",
        terminal_chunk=277,
        cause="never_offered",
        reason="lookup needed chunks the store path did not keep: never offered by the store path",
        steps=[],
        trace_dir="t",
    )
    assert r.explain() == (
        "replay got 0 external tokens; expected boundary E=17,920; verdict mismatch; binding "
        "group 2 (SWA, EAGLE), terminal chunk 277: lookup needed chunks the store path did "
        "not keep: never offered by the store path; trace: t"
    )
    other = ReplayResult(**{**r.__dict__, "reason": "a reason of its own"})
    assert other.explain().endswith(
        "terminal chunk 277: never offered by the store path (a reason of its own); trace: t"
    )


def test_the_episodes_table_widens_for_a_servers_request_ids(tmp_path: Path) -> None:
    """A served request id (``cmpl-<16 hex>-0-<8 hex>``, 32 characters) keeps its columns
    under their headings."""
    b = new_builder(tmp_path / "t")
    rid = "cmpl-b4262c3b0116a688-0-9aacaebc"
    b.prime(rid, "c0", 64, swa_chunks={1: [2, 3], 2: [2, 3]})
    b.close()
    lines = _text(render_summary, summarize(open_trace(str(tmp_path / "t"))))
    head = next(ln for ln in lines if ln.startswith("  request"))
    row = next(ln for ln in lines if ln.startswith(f"  {rid}"))
    assert len(head) == len(row)
    assert [head.index(c) + len(c) for c in ("prompt", "accepted")] == [
        len(f"  {rid} ") + 8,
        len(row),
    ]
