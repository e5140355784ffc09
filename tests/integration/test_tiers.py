"""Tiered offloading (vLLM 0.33.0's TieringOffloadingSpec: a CPU primary tier over a
secondary tier) recorded and judged on the real scheduler, with vLLM's real tiering manager
and its real ``fs`` tier in a temporary folder (or its in-memory ``example`` tier).

Geometry ``small``: FA tpc 64, SWA groups 1 and 2 (2 is MTP) tpc 16 with a 2-chunk window.
A prompt of ``n * 64 + 35`` tokens has E = n * 64 and needs, for a hit at E, n FA chunks,
2 chunks of group 1 and 3 of group 2 (the MTP peek): ``n + 5`` chunks at once.

- ``n = 8`` (13 chunks) against a 12-chunk primary: each lookup promotes keys from disk,
  the promotions evict the prefix's own earlier keys, and the request is deferred forever.
- ``n = 12`` (17) against 16: promotions run out of room: the request cannot fit the
  primary at all (capacity).
- ``n = 3`` (8) behind an ``n = 12`` resend against 20: the long one's promotions hold the
  slots and vLLM answers MISS for the short one's keys on disk, 0 external tokens, where an
  uncontended manager would have served 192.
"""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl
import pytest

from tests.alarm_checks import SETTINGS, assert_alarm_agrees
from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.diff import diff  # noqa: E402
from keytrace.analysis.frames import tiers as trace_tiers  # noqa: E402
from keytrace.analysis.geometry import builtin  # noqa: E402
from keytrace.analysis.history import crowding  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402
from keytrace.live.registry import alarms  # noqa: E402
from keytrace.vllm.hook.patches import recording  # noqa: E402
from keytrace.vllm.lab.config import tiered  # noqa: E402
from keytrace.vllm.lab.harness import Harness  # noqa: E402


def tokens(n: int) -> int:
    return n * 64 + 35


def _harness(tmp_path: Path, cpu: int, tier: str = "fs", **kw: object) -> Harness:
    geo = tiered(builtin("small").with_(cpu_chunks=cpu), (tier,), str(tmp_path / "disk"))
    return Harness(geo, max_prompt_tokens=4_000, **kw)  # type: ignore[arg-type]


def _steps(h: Harness, n: int) -> None:
    for _ in range(n):
        h.step()
        if not h.scheduler.has_requests():
            return


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]


def test_the_header_names_the_tiers(tmp_path: Path) -> None:
    d = str(tmp_path / "t")
    with recording(d):
        h = _harness(tmp_path, 12)
        h.scenario(tokens(3))
    header = open_trace(d).header
    assert header["offload_spec"] == "TieringOffloadingSpec"
    assert header["cpu_num_chunks"] == 12
    (tier,) = header["secondary_tiers"]
    assert (tier["index"], tier["type"], tier["medium"]) == (0, "fs", "STORAGE")
    assert tier["settings"]["root_dir"] == str(tmp_path / "disk")


def test_a_prefix_on_disk_against_a_small_primary_is_stalled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "t")
    with recording(d, SETTINGS):
        h = _harness(tmp_path, 12)
        h.submit(tokens(8), chain=0)
        h.run_until_idle()
        h.reset_gpu_prefix_cache()
        resend = h.submit(tokens(8), chain=0)
        _steps(h, 60)
        assert h.scheduler.has_requests()  # still waiting: vLLM never serves it
        warnings = _warnings(caplog)
    trace = open_trace(d)
    report = diff(trace)
    v = report.first_mismatch
    assert v is not None and (v.req_id, v.verdict, v.E) == (resend, "stalled", 512)
    # 49 deferrals, then stalled; the prime waited once for the fs tier's first answer
    assert report.counts["deferred"] == 49 + 1 and report.counts["stalled"] >= 10
    # the promotions evicted the prefix's own keys: every such eviction is a store row too
    tiers = trace.collect("tier").with_columns(pl.col("event").cast(pl.String))
    promoted_out = tiers.filter(pl.col("event") == "promotion_evicted")
    evicted = trace.collect("store").filter(pl.col("event").cast(pl.String) == "evicted")
    assert promoted_out.height > 50
    assert set(promoted_out["key"].to_list()) <= set(evicted["key"].to_list())
    assert main(["diff", d]) == 1
    assert_alarm_agrees(d, alarms(), warnings)
    # the operator is told once, at the 50th deferral, not at every step after it
    (said,) = [r.getMessage() for r in caplog.records if "stalled lookup" in r.getMessage()]
    assert f"request {resend} " in said and "expected E=512 from S=0" in said
    assert not [r for r in caplog.records if "more stalled" in r.getMessage()]  # one request


def test_a_short_resend_behind_anothers_promotions_is_a_busy_primary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the long resend's promotions hold the primary's slots when the short one looks up:
    # vLLM answers MISS rather than wait (on purpose, vllm #40020), so the short one is
    # recomputed. Timing, not a rule bug: explained, and the alarm stays quiet.
    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "t")
    with recording(d, SETTINGS):
        h = _harness(tmp_path, 20)
        for chain, n in ((0, 12), (1, 3), (2, 12)):  # the third pushes both out of the CPU tier
            h.submit(tokens(n), chain=chain)
            h.run_until_idle()
        h.reset_gpu_prefix_cache()
        long, short = h.submit(tokens(12), chain=0), h.submit(tokens(3), chain=1)
        _steps(h, 80)
        warnings = _warnings(caplog)
    assert h.observations[long].accepted_tokens == 768  # served from disk after promotion
    assert h.observations[short].lookups[-1] == (0, 0)
    trace = open_trace(d)
    report = diff(trace, all_episodes=True)
    (v,) = [e for e in report.episodes if e.req_id == short and e.verdict == "explained"]
    assert (v.E, v.external_tokens) == (192, 0)
    assert v.terminal is not None and v.terminal.cause == "primary_busy"
    assert {n.cause for n in v.needed} == {"primary_busy", "promoting"}
    assert "the CPU tier was busy" in v.reason
    # what crowded it out: the long request's promotions in flight, more slots than the
    # short one's needed chunks leave in a 20-chunk primary
    (held,) = crowding(trace_tiers(trace)).filter(pl.col("s") == v.episode)["held"].to_list()
    assert (held, len(v.needed)) == (17, 8) and held + len(v.needed) > 20
    assert report.verdict == "agree" and warnings == []
    assert_alarm_agrees(d, alarms(), warnings)


def test_a_request_bigger_than_the_primary_is_capacity(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "t")
    with recording(d, SETTINGS):
        h = _harness(tmp_path, 16, tier="example")
        for chain in (0, 1, 2):
            h.submit(tokens(12), chain=chain)
            h.run_until_idle()
        h.reset_gpu_prefix_cache()
        resend = h.submit(tokens(12), chain=0)
        _steps(h, 40)
        warnings = _warnings(caplog)
    report = diff(open_trace(d), all_episodes=True)
    (v,) = [e for e in report.episodes if e.req_id == resend and e.verdict == "explained"]
    # 17 chunks needed at once, 16 in the primary: no promotion can make room
    assert v.E == 768 and v.F == 768 and v.terminal is not None
    assert v.terminal.cause == "promotion_no_room"
    assert report.verdict == "agree"
    assert_alarm_agrees(d, alarms(), warnings)


def test_a_key_on_disk_is_part_of_the_resident_prefix(tmp_path: Path) -> None:
    """The primary holds none of the prefix and the full-attention scan stops at its first
    key (no room to promote it): F still reaches E, because the keys after it are on disk
    (the recorder lists them), so the episode is a shortfall, not a cold lookup."""
    d = str(tmp_path / "t")
    with recording(d, SETTINGS):
        h = _harness(tmp_path, 16, tier="example")
        for chain in (0, 1, 2):
            h.submit(tokens(12), chain=chain)
            h.run_until_idle()
        h.reset_gpu_prefix_cache()
        h.submit(tokens(12), chain=0)
        _steps(h, 40)
    trace = open_trace(d)
    report = diff(trace, all_episodes=True)
    listed = trace.frame("lookup").filter((pl.col("scan") == -2) & (pl.col("group_id") == 0))
    assert listed.collect().height > 0  # full-attention keys past the scan, listed
    assert not [v for v in report.episodes if v.req_id == "r4" and v.verdict == "cold"]


def _overflow_then_resend(
    tmp_path: Path, params: dict[str, object] | None = None
) -> tuple[str, Harness, str]:
    """Two conversations of 6 chunks each over a 16-chunk primary (the second overflows
    it), then the first one's resend with ``params`` as its kv_transfer_params, recorded:
    (trace folder, harness, the resend's request id)."""
    d = str(tmp_path / "t")
    with recording(d, SETTINGS):
        h = _harness(tmp_path, 16)
        for chain in (0, 1):
            h.submit(tokens(6), chain=chain)
            h.run_until_idle()
        h.reset_gpu_prefix_cache()
        resend = h.submit(tokens(6), chain=0, kv_transfer_params=params)
        h.run_until_idle()
    return d, h, resend


def test_a_resend_after_an_overflow_is_served_from_disk(tmp_path: Path) -> None:
    """A second conversation overflows the 16-chunk primary; the first one's resend finds
    its keys on disk (the fs tier answers RETRY while its lookup runs: deferred), they are
    promoted, and all 384 tokens are served. The lost-token table says where they came
    from: promoted from secondary tier 0 (fs), none from the CPU tier, adding up exactly."""
    d, h, resend = _overflow_then_resend(tmp_path)
    assert h.observations[resend].accepted[-1] == 384
    report = diff(open_trace(d), all_episodes=True)
    assert report.verdict == "agree"
    served = [v for v in report.episodes if v.req_id == resend and v.verdict != "deferred"]
    assert [(v.verdict, v.external_tokens) for v in served] == [("hit", 384)]
    lost = report.lost
    assert lost is not None
    rows = {(r.category, r.tier): r.tokens for r in lost.rows if r.engine == "all"}
    assert rows[("promoted", 0)] == 384 and ("offload", None) not in rows
    assert sum(rows.values()) == lost.prompt_tokens["all"] == 3 * tokens(6)
    assert_alarm_agrees(d, alarms(), [])


# (the resend's kv_load_tiers, what vLLM serves it, keytrace's verdict, limit, cause): the
# fs tier's medium is STORAGE, its locality unset (it matches any locality)
LOAD_TIERS = [
    ([], 0, "limited", "kv_load_tiers", "tier_excluded"),
    ([{"medium": "cpu"}], 0, "limited", "kv_load_tiers", "tier_excluded"),
    ([{"medium": "Storage"}], 384, "hit", None, None),
    ([{"locality": "remote"}], 384, "hit", None, None),
    ([{"medium": "tape"}], 384, "hit", None, None),  # vLLM skips it: every tier allowed
    (["storage"], 384, "hit", None, None),  # not a dict: skipped, every tier allowed
]


@pytest.mark.parametrize(("load_tiers", "served", "verdict", "limit", "cause"), LOAD_TIERS)
def test_a_resend_whose_kv_load_tiers_excludes_the_disk_is_limited_by_it(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    load_tiers: list[object],
    served: int,
    verdict: str,
    limit: str | None,
    cause: str | None,
) -> None:
    """The overflow scenario above, the resend asking for its ``kv_load_tiers``: vLLM's
    tiered lookup consults only the secondary tiers the filter allows. Excluding the fs
    tier that holds the whole prefix, it serves 0; keytrace names it ``limited`` by
    ``kv_load_tiers`` (each missing chunk ``tier_excluded``), no warning, the tokens on the
    token account's ``by request: kv_load_tiers`` row; not the ``secondary_resident``
    mismatch it read before. A filter vLLM reads as every tier is a plain hit."""
    caplog.set_level(logging.WARNING, logger="keytrace")
    d, h, resend = _overflow_then_resend(tmp_path, {"kv_load_tiers": load_tiers})
    assert h.observations[resend].accepted[-1] == served
    report = diff(open_trace(d), all_episodes=True)
    assert report.verdict == "agree"
    (v,) = [v for v in report.episodes if v.req_id == resend and v.verdict != "deferred"]
    assert (v.verdict, v.external_tokens, v.limit) == (verdict, served, limit)
    if cause is not None:
        assert v.E == 384 and v.E_free == 384
        assert {c.cause for c in v.needed if c.cause != "resident"} == {cause}
        assert v.reason.startswith("by request: kv_load_tiers")
        assert report.lost is not None
        rows = {r.label: r.tokens for r in report.lost.rows if r.engine == "all"}
        assert rows["by request: kv_load_tiers"] == 384
    assert_alarm_agrees(d, alarms(), _warnings(caplog))
    assert _warnings(caplog) == []


RAW_FILTERS: list[object] = [
    None,
    "cpu",
    [],
    [{}],
    ["storage"],
    [{"medium": "storage"}],
    [{"medium": "Cpu", "locality": "remote"}],
    [{"locality": "LOCAL"}],
    [{"medium": "tape"}],
    [{"medium": "tape"}, {"locality": "remote"}],
    [{"medium": 3}],
    [{"medium": "cpu"}, {"medium": "storage", "locality": "local"}],
]


def test_the_tier_filter_is_read_as_vllm_reads_it() -> None:
    """keytrace's reading of ``kv_load_tiers`` (`rules.request_limits`, `excluded_tiers`)
    against vLLM's own ``_parse_tier_filter`` and ``TierFilter.allows``, for every medium
    and locality a tier can have (None included)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as vs
    from vllm.v1.kv_offload.base import Locality, Medium, TierFilter

    from keytrace.judge.rules import excluded_tiers, request_limits

    kinds = [(m, loc) for m in [None, *Medium] for loc in [None, *Locality]]
    tiers = [
        {"index": i, "medium": m and m.name, "locality": loc and loc.name}
        for i, (m, loc) in enumerate(kinds)
    ]
    for raw in RAW_FILTERS:
        vllm_filter = TierFilter.ALL if raw is None else vs._parse_tier_filter(raw)
        want = [i for i, (m, loc) in enumerate(kinds) if not vllm_filter.allows(m, loc)]
        asked = request_limits({"kv_load_tiers": raw})["kv_load_tiers"]
        assert excluded_tiers(asked, tiers) == want, raw


def test_a_reset_clears_the_primary_and_the_disk_keeps_its_data(tmp_path: Path) -> None:
    """With stores still in flight at a reset, vLLM holds promotions until its workers
    report them (a late DMA could land in a freed slot): a lookup then answers MISS for keys
    on disk (explained: promotions_held). Once released, the same keys are promoted and
    served."""
    d = str(tmp_path / "t")
    with recording(d, SETTINGS):
        h = _harness(tmp_path, 40, tier="example", store_delay=3)
        h.submit(tokens(6), chain=0)
        h.run_until_idle()
        h.submit(tokens(3), chain=1)
        h.step()  # its stores are in flight
        h.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        held = h.submit(tokens(6), chain=0)
        h.run_until_idle()
        h.reset_gpu_prefix_cache()
        later = h.submit(tokens(6), chain=0)
        h.run_until_idle()
    trace = open_trace(d)
    events = trace.collect("tier")["event"].cast(pl.String).to_list()
    assert "promotions_held" in events and "promotions_released" in events
    report = diff(trace, all_episodes=True)
    by_req = {v.req_id: v for v in report.episodes if v.verdict != "deferred"}
    first = by_req[held]
    assert first.verdict == "explained" and first.terminal is not None
    assert first.terminal.cause == "promotions_held"
    assert (by_req[later].verdict, by_req[later].external_tokens) == ("hit", 384)
    assert_alarm_agrees(d, alarms(), [])


def test_recording_a_tiered_manager_changes_no_decision(tmp_path: Path) -> None:
    """The same tiered traffic, recorded and not: every step schedules and transfers the
    same (the wrappers only observe; the primary's promotion aliases stay its own)."""

    def run(record: bool, where: Path) -> list[object]:
        h_dir = where / "t"
        with recording(str(h_dir)) if record else _nothing():
            h = _harness(where, 20, tier="example")
            for chain, n in ((0, 12), (1, 3), (2, 12)):
                h.submit(tokens(n), chain=chain)
                h.run_until_idle()
            h.reset_gpu_prefix_cache()
            h.submit(tokens(12), chain=0)
            h.submit(tokens(3), chain=1)
            _steps(h, 40)
            primary = h.cpu_tier
            assert vars(primary)["prepare_write"] == primary.prepare_store
        return h.digests

    assert run(True, tmp_path / "a") == run(False, tmp_path / "b")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("fix", [None, "promotion_pins_prefix"])
def test_the_livelock_under_the_candidate_fix(tmp_path: Path, fix: str | None) -> None:
    """promotion_pins_prefix (keytrace.vllm.mods.fixes): the 13-chunk resend against a
    12-chunk primary, which stock vLLM defers without end, is answered: the promotions
    cannot evict the request's own hits, vLLM answers MISS (no room) and the request runs
    with what it has: capacity, explained. The fix is scoped: vLLM's tiering class is left
    exactly as it was."""
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    from keytrace.vllm.hook.patches import fixed

    before = dict(vars(TieringOffloadingManager))
    d = str(tmp_path / "t")
    with fixed(fix), recording(d):
        h = _harness(tmp_path, 12, tier="example")
        h.submit(tokens(8), chain=0)
        h.run_until_idle()
        h.reset_gpu_prefix_cache()
        resend = h.submit(tokens(8), chain=0)
        h.run_until_idle(give_up=True)
    assert dict(vars(TieringOffloadingManager)) == before
    trace = open_trace(d)
    assert trace.header["vllm_modified"] == ([f"fix:{fix}"] if fix else [])
    served = [v for v in diff(trace, all_episodes=True).episodes if v.req_id == resend]
    if fix is None:
        assert served[-1].verdict == "stalled"
        assert h.observations[resend].lookups[-1] == (0, None)  # aborted, never answered
    else:
        assert [v.verdict for v in served][-1] == "explained"
        assert served[-1].terminal is not None
        assert served[-1].terminal.cause == "promotion_no_room"
        assert h.observations[resend].accepted[-1] == 0


def test_a_closed_harness_leaves_no_shared_memory_behind(tmp_path: Path) -> None:
    """A tiered manager maps its primary into /dev/shm (vllm_offload_<engine id>.mmap):
    the harness shuts vLLM's scheduler down when closed (or collected), which removes it.
    Left behind, the test suite once filled a 24 GiB /dev/shm."""
    h = _harness(tmp_path, 12, tier="example")
    engine = h.vllm_config.kv_transfer_config.engine_id
    region = Path("/dev/shm") / f"vllm_offload_{engine}.mmap"
    assert region.exists()
    h.close()
    assert not region.exists()
    h.close()  # idempotent
