"""The one patch mechanism, without vLLM: transparent wrappers, exact undo, one lookup rule.

vLLM's own unit tests build the scheduler around a ``MagicMock`` manager and then write
``manager.prepare_store.side_effect`` and read ``call_args`` through it; recording must not
change what they see. These tests drive the real table rows against such a mock.
"""

from __future__ import annotations

import enum
import inspect
import types
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import wrapt

from keytrace.vllm.hook import layers, patches
from keytrace.vllm.hook.compat import resolve
from keytrace.vllm.hook.patches import TABLE, Patch, apply_instance, disable
from keytrace.vllm.hook.wrappers import observe, observe_hot


class FakeRecorder:
    """Counts what the observers report; `fail` mirrors `Recorder.fail`'s contract."""

    def __init__(self) -> None:
        self.stores: list[tuple[Any, ...]] = []
        self.failures: list[str] = []

    def store_prepared(self, *a: Any) -> None:
        self.stores.append(a)

    def follows(self, req_id: str | None) -> bool:
        return True  # (`Recorder.follows` without sampling)

    def fail(self, where: str, exc: BaseException) -> None:
        self.failures.append(where)


@pytest.fixture
def manager() -> Any:
    m = MagicMock()
    m.prepare_store.return_value = SimpleNamespace(
        keys_to_store=[b"k1"], evicted_keys=[], store_spec=None
    )
    yield m
    disable("test")


def _record_manager(m: Any, rec: FakeRecorder) -> None:
    sched = SimpleNamespace(_job_counter=7, _jobs={})
    apply_instance("record", "manager", m, (rec, sched))


def test_wrapped_mock_stays_a_mock(manager: Any) -> None:
    child = manager.prepare_store
    rec = FakeRecorder()
    _record_manager(manager, rec)
    wrapped = manager.prepare_store
    assert wrapped is not child  # it is wrapped ...
    assert isinstance(wrapped, MagicMock)  # ... and still passes vLLM's _as_mock check
    assert wrapped.__wrapped__ is child
    # attribute writes reach the mock: side_effect set through the wrapper is honoured
    wrapped.side_effect = lambda keys, req_context: SimpleNamespace(
        keys_to_store=keys[:1], evicted_keys=[], store_spec="spec"
    )
    ctx = SimpleNamespace(req_id="r1", _offload_key_positions={b"a": 16, b"b": 32})
    keys = [b"a", b"b"]
    out = manager.prepare_store(keys, ctx)
    assert out.store_spec == "spec" and child.side_effect is wrapped.side_effect
    # the mock saw exactly what the caller passed: the same list object, not a copy
    assert child.call_args.args[0] is keys and wrapped.call_args.args[0] is keys
    # and the observer recorded the outcome
    # (the scheduler names no manager with a store_threshold filter: nothing filtered)
    assert rec.stores == [("r1", keys, ctx._offload_key_positions, [b"a"], (), 7, [])]
    disable("record")
    assert manager.prepare_store is child


def test_observer_failure_is_contained(manager: Any) -> None:
    rec = FakeRecorder()
    _record_manager(manager, rec)
    manager.prepare_store.return_value = "not an output"  # the observer cannot read it
    assert manager.prepare_store([b"a"], SimpleNamespace(req_id="r")) == "not an output"
    assert rec.failures == ["manager.prepare_store"]
    # a generator of keys is never consumed or copied by keytrace: passed through as is
    gen = iter([b"a"])
    manager.prepare_store(gen, SimpleNamespace(req_id="r"))
    assert manager.prepare_store.call_args.args[0] is gen
    assert rec.failures == ["manager.prepare_store"] * 2
    disable("record")


def test_vllm_exceptions_pass_through(manager: Any) -> None:
    rec = FakeRecorder()
    _record_manager(manager, rec)
    manager.prepare_store.side_effect = KeyError("from vLLM")
    with pytest.raises(KeyError, match="from vLLM"):
        manager.prepare_store([b"a"], SimpleNamespace(req_id="r"))
    assert rec.failures == [] and rec.stores == []
    disable("record")


def test_undo_leaves_a_later_replacement_alone(manager: Any) -> None:
    store_child = manager.prepare_store
    _record_manager(manager, FakeRecorder())

    def mine(keys: Any, req_context: Any) -> str:
        return "test's own"

    manager.prepare_load = mine  # what vLLM's RequestRunner does
    disable("record")
    assert manager.prepare_load is mine  # not clobbered by the undo
    assert manager.prepare_store is store_child  # while what keytrace wrapped is restored


class Base:
    def hook(self, x: int) -> int:
        return x + 1


class Sub(Base):
    pass


def test_inherited_methods_are_found_and_wrapped_like_own_ones() -> None:
    seen: list[int] = []
    row = Patch("test", "scheduler", "hook", lambda _b: _note(seen))
    # the presence check and the wrap use the same lookup: an inherited method counts
    assert resolve(Sub, "hook") is Base.__dict__["hook"]
    layers.apply("test", Sub, row, None)
    try:
        assert Sub().hook(1) == 2 and seen == [1]
        assert Base().hook(1) == 2 and seen == [1]  # the base class is untouched
        assert "hook" in Sub.__dict__
    finally:
        disable("test")
    assert "hook" not in Sub.__dict__ and Sub.hook is Base.hook  # inheritance restored


def test_own_method_restored_to_the_identical_function() -> None:
    original = Base.__dict__["hook"]
    layers.apply("test", Base, Patch("test", "scheduler", "hook", lambda _b: _note([])), None)
    assert Base.__dict__["hook"] is not original
    disable("test")
    assert Base.__dict__["hook"] is original


def _note(seen: list[int]) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seen.append(args[0])
        return wrapped(*args, **kwargs)

    return wrapper


def test_observe_runs_after_and_reports_failures() -> None:
    rec = FakeRecorder()

    def after(r: Any, sched: Any, result: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("recorder bug")

    wrapper = observe("where", after=after)((rec, None))
    assert wrapper(lambda x: x * 2, None, (21,), {}) == 42
    assert rec.failures == ["where"]


@pytest.mark.parametrize("factory", [observe_hot, lambda w, a: observe(w, after=a)])
def test_the_hot_path_wrapper_keeps_observes_contract(factory: Any) -> None:
    """`observe_hot` (manager.lookup) behaves exactly like `observe` with ``after``: the
    result passes through, an observer failure is counted, a vLLM exception propagates
    without the observer running."""
    rec = FakeRecorder()
    seen: list[Any] = []

    def after(r: Any, sched: Any, result: Any, args: Any, kwargs: Any) -> None:
        seen.append((result, args, kwargs))
        if result == "bad":
            raise RuntimeError("recorder bug")

    wrapper = factory("manager.lookup", after)((rec, None))
    assert wrapper(lambda k, c: "HIT", None, (b"k", "ctx"), {}) == "HIT"
    assert seen == [("HIT", (b"k", "ctx"), {})] and rec.failures == []
    assert wrapper(lambda k, c: "bad", None, (b"k", "ctx"), {}) == "bad"
    assert rec.failures == ["manager.lookup"]

    def vllm_raises(k: Any, c: Any) -> Any:
        raise KeyError("from vLLM")

    with pytest.raises(KeyError, match="from vLLM"):
        wrapper(vllm_raises, None, (b"k", "ctx"), {})
    assert len(seen) == 2


class _VllmResult(enum.Enum):
    """Stands for vLLM's ``LookupResult`` (an ``Enum``: keytrace maps it by name)."""

    HIT = 1
    MISS = 2


class RealManager:
    """A manager whose ``lookup`` is a real method (not a mock's child)."""

    def lookup(self, key: bytes, req_context: Any, **kw: Any) -> _VllmResult:
        if key == b"boom":
            raise KeyError("from vLLM")
        return _VllmResult.HIT if key.startswith(b"h") else _VllmResult.MISS


class LookupRecorder(FakeRecorder):
    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[tuple[bytes, str, str, bool]] = []
        # what the two-argument row reads of a real recorder before it calls `lookup`
        # (no open scan: every call comes here)
        self.open_scan = None
        self.unfollowed: str | None = None

    def lookup(
        self, key: bytes, req_id: str, position: Any, result: Any, secondary: bool = False
    ) -> None:
        if key == b"bad":
            raise RuntimeError("recorder bug")
        self.lookups.append((key, req_id, str(result), secondary))


def test_a_real_managers_lookup_gets_the_plain_form_with_observes_contract() -> None:
    """On a real manager the per-key row is a plain function, not a wrapt proxy (about half
    its cost per call), with the method's identity and `observe`'s contract: the result
    passes through, an observer failure is counted, vLLM's exception propagates with
    nothing recorded, any other call form takes the generic observer, and the undo puts
    the method back."""
    m, rec = RealManager(), LookupRecorder()
    ctx = SimpleNamespace(req_id="r1", get_offload_key_position=lambda k: 16)
    apply_instance("record", "manager", m, (rec, SimpleNamespace()))
    try:
        plain = m.lookup
        assert type(plain) is types.FunctionType and not isinstance(plain, wrapt.ObjectProxy)
        assert plain.__wrapped__.__func__ is RealManager.lookup and plain.__self__ is m
        assert plain.__func__ is RealManager.lookup and plain.__name__ == "lookup"
        assert inspect.signature(plain) == inspect.signature(RealManager().lookup)
        assert m.lookup(b"hk", ctx) is _VllmResult.HIT
        assert m.lookup(b"mk", req_context=ctx) is _VllmResult.MISS  # the generic observer
        assert rec.lookups == [(b"hk", "r1", "HIT", False), (b"mk", "r1", "MISS", False)]
        assert m.lookup(b"bad", ctx) is _VllmResult.MISS and rec.failures == ["manager.lookup"]
        with pytest.raises(KeyError, match="from vLLM"):
            m.lookup(b"boom", ctx)
        assert len(rec.lookups) == 2 and rec.failures == ["manager.lookup"]
    finally:
        disable("record")
    assert "lookup" not in vars(m) and m.lookup.__func__ is RealManager.lookup


class PairManager:
    """A manager whose ``lookup`` has the CPU manager's exact signature."""

    def lookup(self, key: bytes, req_context: Any) -> _VllmResult:
        return RealManager().lookup(key, req_context)


@pytest.mark.parametrize("cls", [PairManager, RealManager])
def test_the_cpu_managers_signature_gets_a_two_argument_row(cls: type) -> None:
    """``lookup(key, req_context)`` (the CPU manager's) gets a two-argument function, with
    no per-call packing of ``*args, **kwargs``; any other signature keeps the generic form.
    Either way the contract holds: positional and keyword calls are recorded alike, an
    observer failure is counted, vLLM's exception propagates with nothing recorded."""
    m, rec = cls(), LookupRecorder()
    ctx = SimpleNamespace(req_id="r1", get_offload_key_position=lambda k: 16)
    apply_instance("record", "manager", m, (rec, SimpleNamespace()))
    try:
        code = m.lookup.__code__
        packs = bool(code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS))
        assert packs is (cls is RealManager)
        assert code.co_argcount == (0 if cls is RealManager else 2)
        assert m.lookup(b"hk", ctx) is _VllmResult.HIT
        assert m.lookup(key=b"mk", req_context=ctx) is _VllmResult.MISS
        assert rec.lookups == [(b"hk", "r1", "HIT", False), (b"mk", "r1", "MISS", False)]
        assert m.lookup(b"bad", ctx) is _VllmResult.MISS and rec.failures == ["manager.lookup"]
        with pytest.raises(KeyError, match="from vLLM"):
            m.lookup(b"boom", ctx)
        assert len(rec.lookups) == 2
    finally:
        disable("record")
    assert m.lookup.__func__ is cls.lookup


def test_a_mock_managers_lookup_stays_a_proxied_mock(manager: Any) -> None:
    """vLLM's tests set ``side_effect``/``return_value`` on a mock manager's ``lookup`` and
    read its calls: the per-key row keeps the proxy there, whose writes reach the mock."""
    child = manager.lookup
    rec = LookupRecorder()
    _record_manager(manager, rec)
    try:
        assert isinstance(manager.lookup, MagicMock) and manager.lookup.__wrapped__ is child
        manager.lookup.return_value = _VllmResult.HIT
        ctx = SimpleNamespace(req_id="r1", get_offload_key_position=lambda k: 16)
        assert manager.lookup(b"k", ctx) is _VllmResult.HIT and child.call_count == 1
        assert rec.lookups == [(b"k", "r1", "HIT", False)]
    finally:
        disable("record")
    assert manager.lookup is child


def test_table_is_well_formed() -> None:
    rows = [(p.feature, p.target, p.attr) for p in TABLE]
    assert len(rows) == len(set(rows))
    # the manager is wrapped per instance only (tiering aliases prepare_write to it); the
    # one class-level row on a manager's lookup is a candidate fix's, on the tiering
    # manager's own class, which no tier aliases
    assert {p.target for p in TABLE if p.attr in ("lookup", "prepare_store")} == {
        "manager",
        "tier",
        "tiering_class",
    }
    assert {p.feature for p in TABLE if p.target == "tiering_class"} == {
        "fix:promotion_pins_prefix"
    }
    # and so are a tiered manager's primary tier (its prepare_write is its prepare_store)
    assert {p.target for p in TABLE if p.attr in ("prepare_write", "complete_write")} == {"primary"}
    assert {f for f in patches.FEATURES if f.startswith("inject:")} == {
        f"inject:{name}" for name in patches.catalog.INJECTIONS
    }


class _Episodes:
    """A recorder's listener that keeps the episodes it is told have ended."""

    def __init__(self) -> None:
        self.ended: list[Any] = []

    def episode_ended(self, inst: int, ep: Any) -> None:
        self.ended.append(ep)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def _gkey(name: str, gid: int) -> bytes:
    return name.encode().ljust(32, b".") + gid.to_bytes(4, "big")


def test_the_two_argument_row_appends_to_the_open_scan_as_the_recorder_would() -> None:
    """The row's own appends (a call that continues the open scan) and the recorder's
    `lookup` (any other) make the same scans: one per request and group, every call in
    order, each result its own; a request the sampler left out records nothing."""
    from keytrace.analysis.geometry import synthetic_header
    from keytrace.format.schema import LookupResult
    from keytrace.record.recorder import Recorder
    from tests.factories import TINY

    class CountingRecorder(Recorder):
        """The recorder, counting the calls that reach its `lookup`."""

        calls = 0

        def lookup(self, *args: Any, **kwargs: Any) -> None:
            CountingRecorder.calls += 1
            super().lookup(*args, **kwargs)

    episodes = _Episodes()
    rec = CountingRecorder(
        None,
        synthetic_header(TINY),
        engine_id="e",
        dp_rank=0,
        tokens_per_chunk={0: 16, 1: 16, 2: 16},
        listener=episodes,
    )
    m = PairManager()
    apply_instance("record", "manager", m, (rec, SimpleNamespace()))
    ends = {_gkey(f"h{c}", g): 16 * (c + 1) for c in range(3) for g in (0, 1)}
    ends[_gkey("miss", 0)] = 64

    def ctx(req_id: str) -> Any:
        return SimpleNamespace(req_id=req_id, get_offload_key_position=ends.get)

    try:
        rec.episode_begin("r1", 0, None, 64, 64, 4)
        calls = [("h0", 0), ("h1", 0), ("h2", 0), ("h0", 1), ("h1", 1), ("miss", 0)]
        for name, g in calls:
            m.lookup(_gkey(name, g), ctx("r1"))
        rec.episode_end("r1", 0, False)
        assert rec.failures == 0
        (ep,) = episodes.ended
        scans = [(sc.gid, sc.keys, [str(r) for r in sc.results], sc.ends) for sc in ep.scans]
        hit = ["HIT"] * 3
        assert scans == [
            (0, [_gkey(f"h{c}", 0) for c in range(3)], hit, [16, 32, 48]),
            (1, [_gkey("h0", 1), _gkey("h1", 1)], hit[:2], [16, 32]),
            (0, [_gkey("miss", 0)], ["MISS"], [64]),
        ]
        seqs = [s for sc in ep.scans for s in sc.seqs]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(calls)
        # only the calls that open a scan reached the recorder: the rest were appended
        assert CountingRecorder.calls == 3
        # another request's call ends r1's scan even with the same group's key
        rec.episode_begin("r2", 0, None, 64, 64, 4)
        m.lookup(_gkey("h0", 0), ctx("r2"))
        m.lookup(_gkey("h1", 0), ctx("r3"))
        assert rec.open_scan is not None and rec.open_scan.req_id == "r3"
        rec.episode_end("r2", 0, False)
        assert [[k for k in sc.keys] for sc in episodes.ended[-1].scans] == [[_gkey("h0", 0)]]
        # a secondary tier's scan of the request is not continued by its primary lookup
        rec.episode_begin("r5", 0, None, 64, 64, 4)
        rec.lookup(_gkey("h0", 0), "r5", ends.get, LookupResult.HIT, secondary=True)
        m.lookup(_gkey("h1", 0), ctx("r5"))
        rec.episode_end("r5", 0, False)
        assert [sc.secondary for sc in episodes.ended[-1].scans] == [True, False]
        # a request the sampler left out: nothing recorded, nothing open, and its calls
        # never reach the recorder
        rec.episode_begin("r4", 0, None, 64, 64, 4)
        rec.unfollowed = "r4"
        before = CountingRecorder.calls
        m.lookup(_gkey("h0", 0), ctx("r4"))
        m.lookup(_gkey("h1", 0), ctx("r4"))
        assert rec.open_scan is None and rec.failures == 0
        assert CountingRecorder.calls == before
    finally:
        disable("record")
