"""The differ judges a fleet trace engine by engine (`keytrace.analysis.partition`): each
recorder instance from its own rows and the cross-engine facts. Checked here: the facts'
rule equals the rule read from every instance's rows (property test), a routed fleet trace
gets every other_engine cause and no other cause that another engine's offer would have
changed (checked against the raw store rows, not the differ), any runner gives the same
bytes, and instance views hold just their instance's rows."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.analysis import frames, partition
from keytrace.analysis.diff import diff
from keytrace.analysis.history import _offered_elsewhere_in, offered_elsewhere
from keytrace.analysis.lost import Partial, summarize
from keytrace.analysis.partition import FirstOffers, first_offers, plan
from keytrace.analysis.results import DiffReport
from keytrace.analysis.runners import LocalRunner
from keytrace.format.compact import compact
from keytrace.format.reader import Trace, open_trace
from keytrace.judge.rules import OFFER_EVENTS
from keytrace.report.jsonout import write_json
from tests.generated import fleet_trace

ENGINES = 4


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated fleet trace with routing between its engines (misrouted and split
    requests: cold_routing and other_engine)."""
    return fleet_trace(
        tmp_path_factory.mktemp("routed") / "trace",
        rows=150_000,
        engines=ENGINES,
        planted=2,
        seed=7,
        misroute=0.3,
    )


def _json(report: DiffReport) -> str:
    buf = io.StringIO()
    write_json(report, buf)
    return buf.getvalue()


EVENTS = [*OFFER_EVENTS, "completed", "evicted"]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(0, 3), st.integers(0, 40), st.sampled_from(EVENTS)
        ),
        max_size=30,
    ),
    probes=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(0, 45)), max_size=20
    ),
)
def test_first_offers_give_the_rule_read_from_every_row(
    rows: list[tuple[int, int, int, str]], probes: list[tuple[int, int, int]]
) -> None:
    """``(inst1 != X and ts1 < t) or ts2 < t`` over the per-key first offers says what
    reading every instance's store rows says: another instance offered the key before t."""
    stores = pl.DataFrame(
        [(i, bytes([k]), ts, ev) for i, k, ts, ev in rows],
        schema={"inst": pl.Int64, "key": pl.Binary, "ts": pl.Int64, "event": pl.String},
        orient="row",
    )
    base = pl.DataFrame(
        [(n, i, t, bytes([k])) for n, (i, k, t) in enumerate(probes)],
        schema={"pid": pl.Int64, "inst": pl.Int64, "t": pl.Int64, "key": pl.Binary},
        orient="row",
    )
    asked = base.select("key").unique()
    per_instance = [
        stores.filter((pl.col("inst") == i) & pl.col("event").is_in(OFFER_EVENTS))
        .join(asked, on="key", how="semi")
        .group_by("key", "inst")
        .agg(pl.col("ts").min())
        for i in range(3)
    ]
    facts = FirstOffers(first_offers(per_instance), asked)
    want = set(_offered_elsewhere_in(base, stores)["pid"].to_list())
    assert set(offered_elsewhere(base, facts)["pid"].to_list()) == want


def test_routing_between_engines_is_judged_from_the_cross_engine_facts(routed: Path) -> None:
    """Every needed chunk's other_engine cause is an offer another instance made before the
    episode (read from the raw store rows); every chunk another instance had offered before
    it and that the episode's own instance never held is called other_engine (the cause
    ranks above store_failed, rejected and the rest)."""
    trace = open_trace(str(routed))
    report = diff(trace, all_episodes=True, partitions=ENGINES)  # one engine per partition
    assert len(trace.instances()) == ENGINES
    t_of = {
        (i, s): t
        for i, s, t in frames.collect(frames.episodes(trace).select("inst", "s", "t")).iter_rows()
    }
    offers = frames.collect(
        frames.stores(trace)
        .filter(pl.col("event").is_in(OFFER_EVENTS))
        .select("inst", "ts", "key", pl.col("event").cast(pl.String))
    )
    first_elsewhere: dict[tuple[int, bytes], int] = {}
    for inst, ts, key, _ in offers.iter_rows():
        for other in trace.instances():
            if other != inst:
                k = (other, key)
                first_elsewhere[k] = min(ts, first_elsewhere.get(k, ts))
    seen = {"other_engine": 0, "elsewhere_first": 0}
    completed: dict[tuple[int, bytes], int] = {}  # first completion on each instance
    for i, k, ts in frames.collect(
        frames.stores(trace).filter(pl.col("event") == "completed").select("inst", "key", "ts")
    ).iter_rows():
        completed[(i, k)] = min(ts, completed.get((i, k), ts))
    for ep in report.episodes:
        t = t_of[(ep.instance_id, ep.episode)]
        for c in ep.needed or []:
            if c.key is None or c.lookup_result == "HIT":
                continue
            k = bytes.fromhex(c.key)
            before = first_elsewhere.get((ep.instance_id, k))
            if c.cause == "other_engine":
                seen["other_engine"] += 1
                assert before is not None and before < t, (ep.req_id, c)
            elif (
                before is not None
                and before < t
                and completed.get((ep.instance_id, k), t) >= t  # never held here before
            ):
                seen["elsewhere_first"] += 1
                # never held here before t: only a store still in flight ranks above
                assert c.cause == "in_flight", (ep.req_id, c)
    assert seen["other_engine"] > 0
    rows = report.lost.rows if report.lost else []
    assert any(r.category == "cold_routing" and r.tokens > 0 for r in rows)


def test_any_partitioning_and_runner_gives_the_same_report(routed: Path) -> None:
    """One partition is the whole trace at once (no cross-engine facts at all); every other
    cut reads the facts instead: the same bytes."""
    trace = open_trace(str(routed))
    here = _json(diff(trace, all_episodes=True))
    for k in (2, 3, ENGINES):
        assert _json(diff(trace, all_episodes=True, partitions=k)) == here, k
    pooled = _json(diff(trace, all_episodes=True, runner=LocalRunner(jobs=2)))
    assert pooled == here
    assert _json(diff(trace, partitions=3)) == _json(diff(trace))
    with pytest.raises(Exception, match="at least 1"):
        LocalRunner(jobs=0)


def test_plan_packs_instances_by_rows() -> None:
    rows = {10: 100, 11: 90, 12: 10, 13: 5, 14: 1}
    assert plan(rows, 1) == [(10, 11, 12, 13, 14)]
    assert plan(rows, 2) == [(10, 13), (11, 12, 14)]  # each next to the lightest set
    assert plan(rows, 9) == [(10,), (11,), (12,), (13,), (14,)]
    assert plan(rows, 3) == [(10,), (11,), (12, 13, 14)]


def test_an_instance_view_holds_its_rows_only(routed: Path, tmp_path: Path) -> None:
    trace = open_trace(str(routed))
    ids = trace.instances()
    view = trace.of_instances([ids[0]])
    assert view.parts and len(view.parts) < len(trace.parts)
    assert set(view.collect("store")["instance_id"].unique().to_list()) == {ids[0]}
    # a compacted file holds every instance: the view filters its rows instead
    out = tmp_path / "compacted"
    compact([str(routed)], str(out))
    whole = open_trace(str(out))
    assert whole.instances() == ids
    mixed = whole.of_instances([ids[1]])
    assert len(mixed.parts) == len(whole.parts)
    assert set(mixed.collect("lookup")["instance_id"].unique().to_list()) == {ids[1]}
    assert mixed.rows("lookup") == whole.rows("lookup")  # part metadata, not the view
    assert whole.instance_rows() == trace.instance_rows()
    assert _json(diff(whole, all_episodes=True, partitions=ENGINES)) == _json(
        diff(trace, all_episodes=True)
    )


def test_views_are_traces(routed: Path) -> None:
    trace = open_trace(str(routed))
    absent = max(trace.instances()) + 1
    view = trace.of_instances([absent])
    assert isinstance(view, Trace) and view.only == {absent}
    assert view.collect("store").height == 0 and view.instance_rows() == {}


def test_probe_keys_outside_the_asked_set_are_read_from_the_whole_trace(
    routed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asked set sets the cost only: with none asked, every probe key is read from the
    whole trace (`offered_elsewhere`'s fallback), and the report is the same."""
    trace = open_trace(str(routed))
    want = _json(diff(trace, all_episodes=True))
    monkeypatch.setattr(
        partition, "asked_keys", lambda view: pl.DataFrame(schema={"key": pl.Binary})
    )
    assert _json(diff(trace, all_episodes=True, partitions=ENGINES)) == want


def test_token_accounts_of_partitions_with_different_tiers_add_up() -> None:
    """A tiered trace's partition whose engines never promoted has no promoted_<tier>
    column: the partials still add up (as if it had one of zeros)."""
    by = {"engine": ["e0"], "cause": [None], "bind_gid": [None], "limit": [None]}
    promoted = Partial(
        pl.DataFrame(
            {**by, "offload": [5], "promoted_1": [3], "n_offload": [1], "n_promoted_1": [1]}
        ),
        pl.DataFrame({"engine": ["e0"], "N": [10], "episodes": [1]}),
    )
    plain = Partial(
        pl.DataFrame({**by, "engine": ["e1"], "offload": [4], "n_offload": [1]}),
        pl.DataFrame({"engine": ["e1"], "N": [7], "episodes": [1]}),
    )
    zeros = Partial(
        plain.per_cause.with_columns(
            pl.lit(0, pl.Int64).alias("promoted_1"), pl.lit(0, pl.Int64).alias("n_promoted_1")
        ),
        plain.prompts,
    )
    assert summarize([promoted, plain]) == summarize([promoted, zeros])


def test_ray_option_takes_an_address_and_hands_a_trace_back() -> None:
    from keytrace.cli.diff import _trace_after_ray

    assert _trace_after_ray(("t",), None) == (("t",), None)
    assert _trace_after_ray(("t",), "") == (("t",), "")
    assert _trace_after_ray(("t",), "auto") == (("t",), "auto")
    assert _trace_after_ray(("t",), "head:6379") == (("t",), "head:6379")
    assert _trace_after_ray(("t",), "ray://head:10001") == (("t",), "ray://head:10001")
    assert _trace_after_ray((), "/data/trace") == (("/data/trace",), "")
    assert _trace_after_ray(("b",), "s3://bucket/t") == (("s3://bucket/t", "b"), "")


def test_ray_missing_is_one_line_and_exit_2(
    routed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from keytrace.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["diff", "--ray", str(routed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'keytrace[ray]'" in err
    assert main(["diff", "--jobs", "2"]) == 2
    assert "missing TRACE" in capsys.readouterr().err
