"""The live alarm (keytrace.live) on hand-built traces: the same verdicts as the offline
differ for every scenario the differ's own tests build, one warning per new problem,
metrics that parse, bounded state, and failures that never reach vLLM.

The scenarios are the differ's unit tests themselves (`tests/unit/test_diff.py`,
`tests/unit/test_lost.py`), run again with every `TraceBuilder` feeding one alarm per
trace directory; after each, every field of every episode's online verdict (`tests.
alarm_checks.FIELDS`: verdict, E, cause, decisive causes, binding group, terminal chunk,
result and cause, tokens short of E) must equal the differ's.
(On the real scheduler the same comparison runs inside the oracle tests.)
"""

from __future__ import annotations

import inspect
import logging
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.analysis.diff import diff
from keytrace.format.reader import open_trace
from keytrace.format.schema import StoreEvent, TierEvent
from keytrace.judge import definitions as d
from keytrace.live import metrics
from keytrace.live.alarm import BYTES_PER_RECORD, Alarm
from keytrace.live.registry import AlarmSettings
from keytrace.live.state import InstanceState, KeyStore
from keytrace.record.chain import ChainBook
from keytrace.record.events import InstanceInfo, StoreCall, TierCall
from tests import factories
from tests.alarm_checks import field_differences
from tests.factories import TINY, new_builder
from tests.unit import test_diff, test_lost
from tests.unit.test_diff import FA_ALL, _swa_scan

GEO = TINY.with_(groups=TINY.groups[:2])


FIXTURES = ("tmp_path", "monkeypatch", "capsys")
"""Fixtures a differ scenario may take; the harvester hands it the same ones."""


def _scenarios() -> list[Any]:
    """Every test of the differ's unit suites that builds a trace, each parametrisation
    of it as a scenario of its own: (function, its parametrised arguments)."""
    found = []
    for mod in (test_diff, test_lost):
        for name, fn in sorted(vars(mod).items()):
            if not name.startswith("test_") or not callable(fn):
                continue
            params = list(inspect.signature(fn).parameters)
            if "tmp_path" not in params:
                continue  # a rule's arithmetic alone: no trace to judge
            cases: list[dict[str, Any]] = [{}]
            for mark in getattr(fn, "pytestmark", []):
                if mark.name != "parametrize":
                    continue
                names = (
                    [n.strip() for n in mark.args[0].split(",")]
                    if isinstance(mark.args[0], str)
                    else list(mark.args[0])
                )
                values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
                cases = [{**c, **dict(zip(names, v, strict=True))} for c in cases for v in values]
            assert set(params) <= {*FIXTURES, *cases[0]}, (name, params)
            short = mod.__name__.rsplit(".", 1)[1]
            for c in cases:
                label = "-".join(str(v) for v in c.values())
                found.append(
                    pytest.param(fn, c, id=f"{short}.{name}" + (f"[{label}]" if label else ""))
                )
    return found


def _run(scenario: Any, bound: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """Run a scenario with its parametrised arguments and the fixtures it asks for."""
    wants = inspect.signature(scenario).parameters
    kwargs = {**bound, **{f: request.getfixturevalue(f) for f in FIXTURES if f in wants}}
    scenario(**kwargs)


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> dict[str, Alarm]:
    """Every TraceBuilder created in the test feeds the alarm of its trace directory."""
    made: dict[str, Alarm] = {}
    original = factories.TraceBuilder.__init__

    def init(self: Any, directory: Any, geometry: Any = TINY, **kw: Any) -> None:
        header = kw.get("header") or factories.synthetic_header(geometry)
        alarm = made.setdefault(str(directory), Alarm(header, keep_judged=True, interval=1e9))
        original(self, directory, geometry, alarm=alarm, **kw)

    monkeypatch.setattr(factories.TraceBuilder, "__init__", init)
    return made


UNKNOWN_KEYS = {
    "test_a_rule_miss_behind_an_eviction_is_a_mismatch",
    "test_keys_of_groups_the_scan_never_reached_are_derived",
    "test_a_request_that_only_evicted_a_key_does_not_share_its_prefix",
}
"""Scenarios of a recording that did not list the keys a hit needs (``listed=False``: what a
schema-1 trace holds, or a recorder whose chain book forgot the boundary): the differ
derives a needed key from the whole trace and finds a rule cause; live, the alarm sees no
other request's records, so the key's chunk counts as not looked up. A missed cause (a
shortfall explained, or one decisive cause fewer), never a false one. Every other scenario
lists the keys as the real recorder does, and the alarm must say what the differ says."""


@pytest.mark.parametrize(("scenario", "bound"), _scenarios())
def test_each_differ_scenario_gets_the_differs_verdicts_live(
    scenario: Any, bound: dict[str, Any], live: dict[str, Alarm], request: pytest.FixtureRequest
) -> None:
    _run(scenario, bound, request)
    assert live, "the scenario built no trace"
    wrong = []
    for directory, alarm in live.items():
        trace = open_trace(directory)
        report = diff(trace, all_episodes=True)
        offline = {(v.instance, v.episode) for v in report.episodes}
        assert {(j.instance, j.episode) for j in alarm.judged or []} == offline
        wrong += field_differences(trace, report, [alarm])
    if scenario.__name__ not in UNKNOWN_KEYS:
        assert wrong == []
        return
    assert wrong, "the scenario no longer needs a key only the whole trace names"
    explained = {e for e, field, *_ in wrong if field == "verdict"}
    for episode, field, offline_value, online_value in wrong:
        # what a key unknown here can change, and only towards knowing less: a rule
        # mismatch explained (by what was known), or one decisive cause fewer
        assert field in ("verdict", "cause", "decisive"), wrong
        if field == "verdict":
            assert (offline_value, online_value) == ("mismatch", "explained"), wrong
        if field == "decisive" and episode not in explained:
            assert not Counter(online_value) - Counter(offline_value), wrong


def test_the_scenarios_cover_every_verdict_and_cause(
    live: dict[str, Alarm], tmp_path: Path
) -> None:
    """The comparison above is only as good as what the scenarios exercise."""
    verdicts: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    for n, param in enumerate(_scenarios()):
        fn, bound = param.values
        wants = inspect.signature(fn).parameters
        if set(wants) - {"tmp_path", *bound}:
            continue  # a fixture of its own: run by the test above
        fn(**{**bound, "tmp_path": tmp_path / str(n)})
    for alarm in live.values():
        for j in alarm.judged or []:
            verdicts[j.verdict] += 1
            causes.update(j.decisive)
    assert {"deferred", "cold", "hit", "explained", "mismatch"} <= set(verdicts)
    assert {"in_flight", "evicted", "other_engine", "rejected", "never_offered"} <= set(causes)


# ------------------------------------------------------------------- warnings
def _mismatches(d: Path, n: int, alarm: Alarm) -> factories.TraceBuilder:
    """``n`` conversations, each a never-offered SWA chunk 4 (group 1) on engine-a."""
    b = new_builder(d, geometry=GEO, alarm=alarm)
    for i in range(n):
        b.prime(f"p{i}", f"c{i}", 100, swa_chunks={1: [5]})
        scans = [(0, FA_ALL), (1, _swa_scan({5: "HIT"}))]
        b.episode(f"r{i}", 100, external=0, chain=f"c{i}", scans=scans)
    b.close()
    return b


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "keytrace"]


def test_one_warning_names_request_group_chunk_key_cause_and_command(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="keytrace")
    alarm = Alarm(factories.synthetic_header(GEO), interval=1e9)
    _mismatches(tmp_path / "t", 3, alarm)
    warning, summary = _warnings(caplog)  # the two repeats are summarised at close
    assert summary.startswith("keytrace: 2 more write-only mismatch(es)")
    b = new_builder(tmp_path / "keys", geometry=GEO)
    key = b.key("c0", 1, 4).hex()
    assert warning.startswith("keytrace: write-only offload: request r0 on engine engine-a")
    assert "got 0 external tokens, expected E=96 from S=0" in warning
    assert "group 1 (SWA) ended the match at chunk 4 (tokens 64-80)" in warning
    assert f"key {key} (MISS, never_offered); cause never_offered" in warning
    assert f"keytrace diff {tmp_path / 't'} --request r0" in warning
    assert alarm.counts() == {"cold": 3, "mismatch": 3}


def test_repeats_are_summarised_at_most_once_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="keytrace")
    _mismatches(tmp_path / "t", 4, Alarm(factories.synthetic_header(GEO), interval=0.0))
    lines = _warnings(caplog)
    assert len(lines) == 4 and "write-only offload: request r0" in lines[0]
    assert all("1 more write-only mismatch(es) on engine engine-a, group 1" in x for x in lines[1:])


def test_repeats_left_inside_an_interval_are_summarised_when_the_recorder_closes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="keytrace")
    _mismatches(tmp_path / "t", 3, Alarm(factories.synthetic_header(GEO), interval=1e9))
    lines = _warnings(caplog)
    assert len(lines) == 2 and "write-only offload: request r0" in lines[0]
    assert lines[1].startswith("keytrace: 2 more write-only mismatch(es) on engine engine-a")


def test_no_warning_for_cold_explained_or_hit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="keytrace")
    alarm = Alarm(factories.synthetic_header(GEO), keep_judged=True)
    b = new_builder(tmp_path / "t", geometry=GEO, alarm=alarm)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    b.episode(
        "r2", 100, external=96, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({4: "HIT", 5: "HIT"}))]
    )
    b.evict("r9", "c", 1, [4])
    b.episode("r3", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.close()
    assert [j.verdict for j in alarm.judged or []] == ["cold", "hit", "explained"]
    assert _warnings(caplog) == []


# -------------------------------------------------------------------- metrics
def test_metrics_parse_and_equal_the_differs_counts(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from keytrace.live import registry as alarm_mod

    alarm_mod.forget_alarms()
    live = alarm_mod.alarm_for(factories.synthetic_header(GEO), AlarmSettings(warn=False))
    builder = _mismatches(tmp_path / "t", 2, live)  # alive: its recorder's counters show
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    episodes = {s.labels["verdict"]: s.value for s in families["keytrace_episodes"].samples}
    report = diff(open_trace(str(tmp_path / "t")), all_episodes=True)
    assert episodes == {k: float(v) for k, v in report.counts.items()}
    short = {
        (s.labels["cause"], s.labels["group"]): s.value
        for s in families["keytrace_short_of_expected_tokens"].samples
    }
    assert report.lost is not None
    assert short == {
        (r.cause, str(r.group)): float(r.tokens)
        for r in report.lost.rows
        if r.category == "short" and r.engine != "all"
    }
    stored = {
        (s.labels["group"], s.labels["event"]): s.value
        for s in families["keytrace_keys_stored"].samples
    }
    assert stored[("1", "completed")] == 2.0  # one SWA chunk per conversation
    looked = {
        (s.labels["group"], s.labels["result"]): s.value
        for s in families["keytrace_keys_looked_up"].samples
    }
    assert looked[("1", "MISS")] >= 2.0
    assert [s.value for s in families["keytrace_recorder_failures"].samples] == [0.0]
    assert builder.rec.failures == 0
    assert all(
        s.name.endswith("_total")
        for f in families.values()
        if f.type == "counter"
        for s in f.samples
    )
    alarm_mod.forget_alarms()


# ------------------------------------------------------------- bounded, safe
def test_state_stays_under_its_cap_and_forgetting_never_cries_wolf(tmp_path: Path) -> None:
    alarm = Alarm(
        factories.synthetic_header(GEO), max_bytes=1024 * BYTES_PER_RECORD, keep_judged=True
    )
    b = new_builder(tmp_path / "t", geometry=GEO, alarm=alarm)
    b.prime("r1", "c", 100, swa_chunks={1: [4, 5]})
    for i in range(400):  # 400 prompts x 6 keys: far more than 1,024 records
        b.store(f"f{i}", f"filler{i}", 0, list(range(6)))
    b.store("r1", "c", 0, list(range(6)))  # the boundary key is fresh again, chunk 4 is not
    b.store("r1", "c", 1, [5])
    # The lookup misses SWA chunk 4, which is resident: the differ (the whole trace) says
    # mismatch. Live, chunk 4's record was forgotten; it must not guess.
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.close()
    assert alarm.forgotten > 0 and alarm.state_records() <= alarm.max_records
    assert [j.verdict for j in alarm.judged or []] == ["cold", "undetermined"]
    offline = diff(open_trace(str(tmp_path / "t")), all_episodes=True)
    assert [v.verdict for v in offline.episodes] == ["cold", "mismatch"]


def test_a_record_costs_what_the_cap_assumes() -> None:
    """`BYTES_PER_RECORD` turns the byte cap into a record count: measured through the
    alarm's own store path. A record holds vLLM's key object, which may outlive vLLM's
    own use of it: the keys are counted too, as if the alarm alone kept them alive."""
    alarm = Alarm(factories.synthetic_header(GEO))
    alarm.instance_started(InstanceInfo(7, "i", "e", 0, None, lambda: None), ChainBook([]))
    n = 50_000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keys = [i.to_bytes(32, "big") + (1).to_bytes(4, "big") for i in range(n)]
    for i in range(0, n, 100):
        call = StoreCall(i, i, StoreEvent.COMPLETED, None, keys[i : i + 100], [None] * 100)
        alarm.store_called(7, call)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert alarm.state_records() == n
    assert used / n <= BYTES_PER_RECORD


def test_an_alarm_failure_is_counted_and_recording_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alarm = Alarm(factories.synthetic_header(GEO))

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(alarm, "episode_ended", broken)
    b = new_builder(tmp_path / "t", geometry=GEO, alarm=alarm)
    b.prime("r1", "c", 100, swa_chunks={1: [5]})
    b.episode("r2", 100, external=0, chain="c", scans=[(0, FA_ALL), (1, _swa_scan({5: "HIT"}))])
    b.close()
    assert b.rec.failures == 2  # two episodes judged, two failures counted
    assert diff(open_trace(str(tmp_path / "t"))).counts["mismatch"] == 1  # the trace is whole


def test_settings_from_the_environment() -> None:
    assert AlarmSettings.from_env({}, recording=False) is None
    assert AlarmSettings.from_env({}, recording=True) == AlarmSettings()
    assert AlarmSettings.from_env({"KEYTRACE_ALARM": "0"}, recording=True) is None
    s = AlarmSettings.from_env(
        {"KEYTRACE_ALARM": "1", "KEYTRACE_METRICS_PORT": "9400", "KEYTRACE_ALARM_INTERVAL": "5"},
        recording=False,
    )
    assert s is not None and (s.metrics_port, s.interval) == (9400, 5.0)


# ------------------------------------------- a busy primary: the differ's count, the alarm's
TIER_WORK = (
    "cascade_submitted",
    "cascade_completed",
    "cascade_failed",
    "promotion_prepared",
    "promotion_completed",
    "promotion_failed",
    "promotion_deferred",
    "deferred_released",
    "promotion_no_room",
    "lookup",
)
TIER_CALLS = st.lists(
    st.tuples(
        st.sampled_from(TIER_WORK),
        st.sampled_from(["a", "b", None]),
        st.lists(
            st.one_of(st.none(), st.sampled_from([b"k0", b"k1", b"k2", b"k3"])),
            min_size=1,
            max_size=3,
        ),
        st.sampled_from([None, 1, 2]),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(TIER_CALLS)
def test_the_slots_other_work_held_are_counted_alike_offline_and_live(calls: list) -> None:  # type: ignore[type-arg]
    """`history.crowding` (over a trace's tier rows, one per key) and the alarm (as each
    call arrives) give every episode the same slots held by others: keyless rows, several
    keys a call, several tiers writing one key, rows without a request."""
    from keytrace.analysis.history import crowding

    rows = [
        {"inst": 1, "seq": seq, "event": ev, "req_id": req, "key": key, "ep": ep}
        for seq, (ev, req, keys, ep) in enumerate(calls)
        for key in keys
    ]
    schema = {
        "inst": pl.Int64,
        "seq": pl.Int64,
        "event": pl.Categorical,
        "req_id": pl.String,
        "key": pl.Binary,
        "ep": pl.Int64,
    }
    offline = {r["s"]: r["held"] for r in crowding(pl.LazyFrame(rows, schema=schema)).to_dicts()}
    st_ = _state()
    for seq, (ev, req, keys, ep) in enumerate(calls):
        KeyStore.in_flight(st_, _tier_call(seq, ev, req, keys, ep))
    assert st_.crowd == offline


def _crowding_both_ways(
    calls: list[tuple[str, str | None, list[bytes], int | None]],
) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """The slots held by others at each promotion that found no room, as the alarm counts
    them call by call (episode -> held) and as `history.crowding` reads them from the same
    calls' tier rows (one per key, in episode order)."""
    from keytrace.analysis.history import crowding

    st_ = _state()
    for seq, (ev, req, keys, ep) in enumerate(calls):
        KeyStore.in_flight(st_, _tier_call(seq, ev, req, keys, ep))
    rows = [
        {"inst": 1, "seq": n, "event": ev, "req_id": req, "key": k, "ep": ep}
        for n, (ev, req, keys, ep) in enumerate(calls)
        for k in keys
    ]
    frame = pl.LazyFrame(rows, schema_overrides={"event": pl.Categorical, "key": pl.Binary})
    offline = sorted(crowding(frame).to_dicts(), key=lambda r: r["s"])
    return st_.crowd, offline


def test_a_key_written_to_two_tiers_holds_one_slot() -> None:
    calls = [
        ("cascade_submitted", "a", [b"k0", b"k1"], None),  # tier 0
        ("cascade_submitted", "a", [b"k0", b"k1"], None),  # tier 1: the same two slots
        ("cascade_completed", "a", [b"k0"], None),  # tier 0 done with k0; tier 1 is not
        ("promotion_prepared", "b", [b"k5"], 7),
        ("promotion_no_room", "c", [b"k6"], 9),
    ]
    live, offline = _crowding_both_ways(calls)
    assert live == {9: 3}  # k0 and k1 still being written, b's promotion of k5
    assert offline == [{"inst": 1, "s": 9, "held": 3}]


def test_a_deferred_failure_holds_its_slot_until_released() -> None:
    """vLLM 0.34.0 fails a promotion at once but frees its primary slot only when the tier
    can no longer write it (`promotion_deferred`, then `deferred_released`): a promotion
    that finds no room in between is crowded by it, one after the release is not."""
    calls = [
        ("promotion_prepared", "b", [b"k5", b"k6"], 7),
        ("promotion_deferred", "b", [b"k5", b"k6"], None),
        ("promotion_no_room", "c", [b"k7"], 9),  # b's two slots are still held
        # b itself, promoting again: its failed promotion's slots are no longer its own
        # promotion in flight, they crowd it as anyone's would
        ("promotion_no_room", "b", [b"k5"], 10),
        ("deferred_released", "b", [b"k5", b"k6"], None),
        ("promotion_no_room", "c", [b"k8"], 11),  # free again
    ]
    live, offline = _crowding_both_ways(calls)
    assert live == {9: 2, 10: 2, 11: 0}
    assert offline == [
        {"inst": 1, "s": 9, "held": 2},
        {"inst": 1, "s": 10, "held": 2},
        {"inst": 1, "s": 11, "held": 0},
    ]


@pytest.mark.parametrize("settled", ["promotion_failed", "promotion_deferred", None])
def test_a_deferred_failure_is_no_promotion_in_flight(settled: str | None) -> None:
    """A key whose promotion failed with a deferred release left the primary at once: a
    lookup after it finds no store in flight (as after ``promotion_failed``), though its
    slot is still held; before the failure it is being promoted."""
    keys = KeyStore(1_000)
    st_ = _state()
    keys.tier(st_, _tier_call(1, "promotion_prepared", "b", [b"k5"], None))
    if settled is not None:
        keys.tier(st_, _tier_call(2, settled, "b", [b"k5"], None))
    rec = keys.get(st_, b"k5")
    assert rec is not None
    removed = d.removal(rec.evicted, None)
    assert not d.resident(rec.completed, removed)
    assert bool(d.in_flight(rec.prepared, removed, rec.failed)) is (settled is None)


def _state() -> InstanceState:
    return InstanceState("i", "e", None, None, lambda: None, ChainBook([]))


def _tier_call(seq: int, event: str, req: Any, keys: list[Any], ep: Any) -> TierCall:
    return TierCall(seq, seq, TierEvent(event), req, None, keys, [None] * len(keys), ep)


def test_the_cap_forgets_each_instances_least_recently_touched_records() -> None:
    """Over the cap, a tenth of it goes: each instance's least recently touched records,
    in proportion to its share; a key touched again moves to the back; the call that went
    over keeps its own keys."""
    keys = KeyStore(1_024)
    a, b = _state(), _state()
    a.tag, b.tag = b"\x00\x00", b"\x00\x01"

    def stored(st: InstanceState, seq: int, ks: list[bytes]) -> None:
        call = StoreCall(seq, seq, StoreEvent.COMPLETED, None, ks, [None] * len(ks))
        keys.store(st, call)

    a_keys = [i.to_bytes(4, "big") for i in range(768)]
    b_keys = [i.to_bytes(4, "big") for i in range(256)]  # the same bytes: other records
    stored(a, 1, a_keys)
    stored(b, 2, b_keys)
    stored(a, 3, a_keys[:10])  # touched again: the back of a's order
    assert len(keys) == 1_024 and keys.forgotten == 0
    stored(b, 4, [b"new!"])  # one over the cap: first 102 go, 77 of a's, 26 of b's (rounded up)
    assert keys.forgotten == 77 + 26 and len(keys) == 1_025 - 103
    assert all(keys.get(a, k) is not None for k in a_keys[:10])
    assert [keys.get(a, k) is None for k in a_keys[10:88]] == [True] * 77 + [False]
    assert [keys.get(b, k) is None for k in b_keys[:27]] == [True] * 26 + [False]
    assert keys.get(b, b"new!") is not None
    rec = keys.get(b, b_keys[26])
    assert rec is not None and rec.completed == 2


def test_stored_counts_every_key_by_group_and_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KeyStore.stored` counts in batches (Arrow, off the per-key path): what it reports,
    whether a batch was counted as it filled or when read, is each call's keys by group."""
    from collections import Counter

    from keytrace.live import state

    monkeypatch.setattr(state, "COUNT_BATCH", 7)
    keys = KeyStore(1_024, group_ids=[0, 1, 300])
    st_ = _state()
    expected: Counter[tuple[str, str, str]] = Counter()
    for seq in range(1, 13):  # the last call's key is left for the read to count
        event = (StoreEvent.PREPARED, StoreEvent.COMPLETED, StoreEvent.EVICTED)[seq % 3]
        gids = [seq % 2, 1, 300, 300][: 1 + seq % 4]
        ks = [seq.to_bytes(32, "big") + g.to_bytes(4, "big") for g in gids]
        keys.store(st_, StoreCall(seq, seq, event, None, ks, [None] * len(ks)))
        for g in gids:
            expected[("e", str(g), event)] += 1
    assert keys.stored == expected
    assert st_.first_prep == {0: 6, 1: 3, 300: 3}  # each group's first prepared call


def test_a_touch_at_the_cap_keeps_the_record_it_returns() -> None:
    """At the cap, the record a tier call touches is made after the forgetting: a new
    instance's first record is never its own tenth."""
    keys = KeyStore(1_024)
    a, b = _state(), _state()
    a.tag, b.tag = b"\x00\x00", b"\x00\x01"
    ks = [i.to_bytes(4, "big") for i in range(1_024)]
    keys.store(a, StoreCall(1, 1, StoreEvent.COMPLETED, None, ks, [None] * len(ks)))
    keys.tier(b, _tier_call(2, "promotion_prepared", "r", [b"k5"], None))
    assert keys.forgotten == 102 and keys.get(a, ks[101]) is None and keys.get(a, ks[102])
    rec = keys.get(b, b"k5")
    assert rec is not None and rec.prepared == 2
