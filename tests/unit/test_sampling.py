"""Consistent sampling, row by row, on the recorder alone (no vLLM): what a sampled trace
keeps of each kind of call (keytrace.record.sampling). The end-to-end property, sampled
verdicts equal to full ones on the sampled chains, is tests/integration/test_sampling.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keytrace.format.keys import chain_sampled, make_key
from keytrace.format.reader import open_trace
from keytrace.format.schema import LookupResult, TierEvent
from keytrace.record.recorder import Recorder, env_sample
from keytrace.record.sampling import sample_fraction

IN = b"\x00" * 32  # a first block hash inside any sample
OUT = b"\xff" * 32  # and one outside every sample below 1
TPC = {0: 16, 1: 16}


def _recorder(d: Path, sample: float | None = 0.5) -> Recorder:
    return Recorder(str(d), {"g": 1}, engine_id="e", dp_rank=0, tokens_per_chunk=TPC, sample=sample)


def _episode(rec: Recorder, req: str, first: bytes | None) -> None:
    rec.episode_begin(req, 0, None, 64, 64, 4, None, first)
    rec.lookup(make_key(first or OUT, 0), req, 16, LookupResult.MISS, False)
    rec.episode_end(req, 0, False)


def _stores(d: Path) -> list[tuple[str, str | None, bytes]]:
    rows = open_trace(str(d)).collect("store")
    return [
        (e, r, k)
        for e, r, k in rows.select(
            pl.col("event").cast(pl.String), pl.col("req_id").cast(pl.String), "key"
        ).iter_rows()
    ]


def test_an_unsampled_chain_leaves_only_the_first_prepared_key_of_each_group(
    tmp_path: Path,
) -> None:
    rec = _recorder(tmp_path)
    _episode(rec, "in", IN)
    _episode(rec, "out", OUT)
    a0, a1, b0 = make_key(b"a" * 8, 0), make_key(b"a" * 8, 1), make_key(b"b" * 8, 0)
    c0, c1 = make_key(b"c" * 8, 0), make_key(b"c" * 8, 1)
    rec.store_prepared("out", [a0, a1], {a0: 16, a1: 16}, [a0, a1], [], 1)
    rec.store_prepared("out", [b0], {b0: 32}, [b0], [], 2)  # group 0 already seen
    rec.store_prepared("in", [c0, c1], {c0: 16, c1: 16}, [c0, c1], [], 3)
    rec.store_completed("out", [a0, a1], {}, 1, True)
    # a partly accepted call of the chain: its first *prepared* key of a new group, not
    # the first offered one (d2 was declined, and group 2 is new: e2 is its first)
    d2, e2, e0 = make_key(b"d" * 8, 2), make_key(b"e" * 8, 2), make_key(b"e" * 8, 0)
    rec.store_prepared("out", [d2, e2, e0], {d2: 16, e2: 32, e0: 32}, [e2, e0], [], 4)
    rec.store_prepared("out", [d2], {d2: 16}, None, [], None)  # failed: nothing
    rec.close()
    assert _stores(tmp_path) == [
        ("prepared", None, a0),  # the groups' first prepare, as no request's
        ("prepared", None, a1),
        ("prepared", "in", c0),
        ("prepared", "in", c1),
        ("prepared", None, e2),
    ]
    lookups = open_trace(str(tmp_path)).collect("lookup")
    assert set(lookups["req_id"].cast(pl.String).to_list()) == {"in"}


class _LeftOut:
    """A vLLM object of a request the sampler left out: the hooks may read its id and
    first block hash (what the sampler decides by), nothing else."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a hook read {name!r} of a request the sampler left out")


def test_the_hooks_read_nothing_more_of_a_request_the_sampler_left_out(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from keytrace.vllm.hook import hooks

    rec = _recorder(tmp_path)
    rec.identity_settled = True  # (no engine to read an identity from)
    request = _LeftOut(request_id="out", block_hashes=[OUT])
    hooks.episode_begin(rec, None, (request, 0, 64), {})
    assert rec.unfollowed == "out"
    hooks.episode_end(rec, None, (0, False), (request,), {})
    k = make_key(b"k" * 8, 0)
    ctx = SimpleNamespace(req_id="out", _offload_key_positions={k: 16})
    # a manager with a store_threshold filter, and a scheduler whose jobs are not to be read
    sched = SimpleNamespace(
        manager=_LeftOut(counts={}),
        _job_counter=1,
        _jobs=_LeftOut(),
        _req_status={"out": _LeftOut(), "new": SimpleNamespace(req=None)},
    )
    hooks.prepare_store(
        rec, sched, SimpleNamespace(keys_to_store=[], evicted_keys=[]), ([k], ctx), {}
    )
    hooks.complete_store(rec, sched, None, ([k], ctx, True), {})
    out = SimpleNamespace(
        num_scheduled_tokens={"out": 16, "new": 8},
        finished_req_ids={"out"},
        preempted_req_ids=set(),
        scheduled_cached_reqs=None,
    )
    hooks.step_begin(rec, sched, (out,), {})
    rec.close()
    assert rec.failures == 0
    trace = open_trace(str(tmp_path))
    # a request never looked up is kept (`ChainSampler.request`): its step row is written
    assert trace.collect("step")["req_id"].cast(pl.String).to_list() == ["new"]
    assert _stores(tmp_path) == []


def test_evictions_are_kept_by_key_whoever_made_room(tmp_path: Path) -> None:
    rec = _recorder(tmp_path)
    _episode(rec, "in", IN)
    _episode(rec, "out", OUT)
    mine, theirs = make_key(b"m" * 8, 0), make_key(b"t" * 8, 0)
    rec.store_prepared("in", [mine], {mine: 16}, [mine], [], 1)
    # the unsampled request's store evicts a key of each chain: the sampled one is kept
    rec.store_prepared("out", [theirs], {theirs: 16}, [theirs], [mine, theirs], 2)
    # and, its eviction written, the key is forgotten: a second eviction is another chain's
    rec.store_prepared("out", [theirs], {theirs: 16}, [theirs], [mine], 3)
    rec.close()
    assert ("evicted", "out", mine) in _stores(tmp_path)
    assert [r for r in _stores(tmp_path) if r[0] == "evicted"] == [("evicted", "out", mine)]


def test_tier_rows_in_flight_are_kept_for_every_chain_the_rest_by_request_or_key(
    tmp_path: Path,
) -> None:
    rec = _recorder(tmp_path)
    rec.sampler.tiered = True  # type: ignore[union-attr]
    _episode(rec, "in", IN)
    _episode(rec, "out", OUT)
    mine, theirs = make_key(b"m" * 8, 0), make_key(b"t" * 8, 0)
    rec.tier_event(TierEvent.PROMOTION_PREPARED, "in", 0, [mine])  # enters the primary by promotion
    rec.tier_event(TierEvent.CASCADE_SUBMITTED, "out", 0, [theirs], job_id=7)  # in flight: kept
    rec.tier_event(
        TierEvent.LOOKUP, "out", 0, [theirs], result=LookupResult.HIT
    )  # another chain's: dropped
    # an unsampled request's promotion evicts a key of each chain: the sampled one is kept
    rec.evicted_by_promotion("out", 0, [mine, theirs], {})
    rec.tier_event(TierEvent.TIER_EVICTED, None, 0, [theirs, mine])  # a tier's eviction: by key
    rec.tier_event(TierEvent.PROMOTIONS_HELD, None, None, [])  # keyless: kept
    rec.close()
    tiers = open_trace(str(tmp_path)).collect("tier")
    got = list(
        tiers.select(
            pl.col("event").cast(pl.String), pl.col("req_id").cast(pl.String), "key"
        ).iter_rows()
    )
    assert got == [
        ("promotion_prepared", "in", mine),
        ("cascade_submitted", "out", theirs),
        ("promotion_evicted", "out", mine),
        ("tier_evicted", None, mine),
        ("promotions_held", None, None),
    ]
    # a tiered sampler never forgets a key: the primary's eviction does not take it off a tier
    assert ("evicted", "out", mine) in _stores(tmp_path)


def test_the_alarm_is_fed_what_the_trace_keeps(tmp_path: Path) -> None:
    """Under sampling the listener (the live alarm) gets the rows the writer keeps: a
    sampled request's episode and stores; of an unsampled one only its first prepared key
    of each group, as no request's (as the trace holds it), and no episode, lookup or
    finish to judge."""
    fed: list[tuple[str, str | None, tuple[bytes, ...]]] = []

    class Listener:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            def told(inst: Any, *args: Any) -> None:
                call = args[0] if args else None
                keys = tuple(getattr(call, "keys", None) or ())
                fed.append((name, getattr(call, "req_id", None), keys))

            return told

    rec = Recorder(
        str(tmp_path), {}, engine_id=None, dp_rank=None, tokens_per_chunk=TPC,
        listener=Listener(), sample=0.5,
    )  # fmt: skip
    k_out, k_in = make_key(b"k" * 8, 0), make_key(b"i" * 8, 0)
    _episode(rec, "out", OUT)
    rec.store_prepared("out", [k_out], {k_out: 16}, [k_out], [], 1)
    rec.request_finished("out")  # (told: tier rows kept by key may name it)
    _episode(rec, "in", IN)
    rec.store_prepared("in", [k_in], {k_in: 16}, [k_in], [], 2)
    rec.request_finished("in")
    rec.close()
    assert [f for f in fed if f[0] not in ("instance_started", "recorder_closed")] == [
        ("store_called", None, (k_out,)),
        ("request_finished", None, ()),
        ("episode_began", "in", ()),
        ("episode_ended", "in", ()),
        ("episode_closed", "in", ()),
        ("store_called", "in", (k_in,)),
        ("request_finished", None, ()),
    ]
    assert _stores(tmp_path) == [("prepared", None, k_out), ("prepared", "in", k_in)]


def test_unsampled_traffic_leaves_the_alarm_nothing_to_keep(tmp_path: Path) -> None:
    """A promotion of an unsampled request that evicts a sampled chain's key is kept (by
    key), naming that request; the alarm forgets it when vLLM finishes the request, and no
    row names the unsampled episode (none is recorded)."""
    from keytrace.live.alarm import Alarm
    from tests import factories
    from tests.factories import TINY

    alarm = Alarm(factories.synthetic_header(TINY), interval=1e9)
    rec = Recorder(
        str(tmp_path), {}, engine_id=None, dp_rank=None, tokens_per_chunk=TPC,
        listener=alarm, sample=0.5,
    )  # fmt: skip
    assert rec.sampler is not None
    rec.sampler.tiered = True  # (as the hook sets it for a tiered manager: promotions)
    mine = make_key(IN, 0)
    _episode(rec, "in", IN)
    rec.store_prepared("in", [mine], {mine: 16}, [mine], [], 1)
    rec.store_completed("in", [mine], {mine: 16}, 1, True)
    rec.request_finished("in")
    for n in range(3):  # unsampled requests whose promotions evict the sampled key
        req = f"out{n}"
        rec.episode_begin(req, 0, None, 64, 64, 4, None, OUT)
        rec.evicted_by_promotion(req, 0, [mine], {mine: 16})
        rec.episode_end(req, 0, False)
        rec.request_finished(req)
    [st] = alarm._inst.values()
    assert st.promoted_out == {} and st.promoted_now == {}
    assert st.per_request_entries() == 0
    rec.close()
    tier = open_trace(str(tmp_path)).collect("tier")
    assert tier.height == 3 and tier["episode"].null_count() == 3  # kept, on no episode


def test_a_request_without_a_full_block_is_kept(tmp_path: Path) -> None:
    rec = _recorder(tmp_path)
    _episode(rec, "short", None)
    rec.close()
    assert open_trace(str(tmp_path)).collect("lookup").height == 2  # its scan and episode


@given(st.binary(min_size=1, max_size=40), st.floats(0.0, 1.0))
def test_chain_sampled_is_monotone_in_the_fraction(first: bytes, f: float) -> None:
    """A chain in a sample of f is in every larger sample: raising the fraction only adds
    chains (traces of 1% are a subset of traces of 10%)."""
    if chain_sampled(first, f):
        assert chain_sampled(first, min(1.0, f * 1.5 + 1e-9))
    assert chain_sampled(first, 1.0)
    assert not chain_sampled(first, 0.0)


def test_the_fraction_of_chains_sampled_is_the_fraction_asked() -> None:
    import hashlib

    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(20_000)]
    share = sum(chain_sampled(h, 0.01) for h in hashes) / len(hashes)
    assert 0.0075 < share < 0.0125  # 200 expected, binomial sd 14: beyond 3.5 sd


@pytest.mark.parametrize(
    ("raw", "want"),
    [(None, None), ("", None), ("0.01", 0.01), ("1", None), ("2", None), (" 0.5 ", 0.5)],
)
def test_sample_fraction(raw: str | None, want: float | None) -> None:
    assert sample_fraction(raw) == want


@pytest.mark.parametrize("raw", ["0", "-0.1", "half", "nan"])
def test_a_bad_sample_records_everything_with_one_warning(
    raw: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError):
        sample_fraction(raw)
    monkeypatch.setenv("KEYTRACE_SAMPLE", raw)
    assert env_sample() is None
    assert env_sample() is None
    said = [r for r in caplog.records if "KEYTRACE_SAMPLE" in r.getMessage()]
    assert len(said) == 1  # once per value, not per scheduler


def test_summary_says_a_trace_is_sampled(tmp_path: Path) -> None:
    import io

    from keytrace.analysis.summary import summarize
    from keytrace.report.text import render_summary

    rec = Recorder(
        str(tmp_path), {"sample": 0.01}, engine_id="e", dp_rank=0, tokens_per_chunk=TPC,
        sample=0.01,
    )  # fmt: skip
    _episode(rec, "short", None)
    rec.close()
    out = io.StringIO()
    render_summary(summarize(open_trace(str(tmp_path))), out)
    assert "sampled: every row of 1.00% of prefix chains" in out.getvalue()


def test_a_sampled_trace_without_a_sampled_chain_says_so(tmp_path: Path) -> None:
    from keytrace.analysis.diff import diff
    from keytrace.analysis.geometry import DSV4, synthetic_header
    from keytrace.errors import TraceError

    header = {**synthetic_header(DSV4), "sample": 0.01}
    rec = Recorder(
        str(tmp_path), header, engine_id="e", dp_rank=0, tokens_per_chunk=TPC, sample=0.01
    )
    _episode(rec, "out", OUT)  # not in the sample: only its group's first prepare is kept
    k = make_key(b"k" * 8, 0)
    rec.store_prepared("out", [k], {k: 16}, [k], [], 1)
    rec.close()
    with pytest.raises(TraceError, match="holds no sampled prefix chain yet"):
        diff(open_trace(str(tmp_path)))


def test_a_running_request_is_never_forgotten_a_finished_one_for_a_while() -> None:
    from keytrace.record.sampling import MAX_FINISHED, ChainSampler

    sm = ChainSampler(0.5)
    sm.decide("long", OUT)  # unsampled, and running while many others come and go
    for i in range(MAX_FINISHED + 10):
        sm.decide(f"r{i}", IN)
        sm.finished(f"r{i}")
    assert sm.request("long") is False
    sm.finished("long")  # its completions after it finished: still unsampled
    assert sm.request("long") is False
    for i in range(MAX_FINISHED):
        sm.decide(f"s{i}", IN)
        sm.finished(f"s{i}")
    assert sm.request("long") is True  # forgotten at last: kept, never cut
