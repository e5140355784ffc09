"""Every patch keytrace makes on vLLM: one table (`TABLE`), one mechanism to apply and undo it.

A row (`Patch`) names

- its *feature*: ``record`` (the recorder's observers), ``inject:<name>`` (a historical store
  bug, `keytrace.vllm.mods.inject`), ``fix:<name>`` (a candidate fix, `keytrace.vllm.mods.fixes`),
  ``harness`` (the CPU harness's own observers);
- its *target*: ``scheduler`` is a class attribute of ``OffloadingConnectorScheduler``,
  applied when the feature is enabled; ``config`` a function of vLLM's offloading config
  module (read when a connector is built), and ``tiering_class`` an attribute of the class
  ``TieringOffloadingManager`` (a candidate fix: managers built afterwards have it), applied
  the same way; ``manager`` and
  ``connector`` are attributes of one
  *instance*, applied as each instance appears (the manager when a recorded scheduler is
  built, the connector when a harness is built). The manager is never patched at class
  level: tiering managers alias ``prepare_write = self.prepare_store`` on their primary
  tier, and a class patch would record tier promotions as stores. A tiered manager also
  gets its ``tiering`` rows (what it does below its public methods), its primary tier the
  ``primary`` rows (the promotion aliases) and each secondary tier the ``tier`` rows;
- the attribute, and a factory that makes the wrapper (given the instance's binding).

Transparency: every wrapper is a ``wrapt.FunctionWrapper``. Identity-visible behaviour goes
to the original: ``isinstance`` (a wrapped ``MagicMock`` still is one), attribute reads and
writes (``side_effect``, ``return_value``, ``call_args``), ``__wrapped__``, names and
signatures. The recorder only observes calls, with the arguments exactly as vLLM passed
them; its failures are caught by `observe`, counted and logged once.

One lookup rule (`_resolve`) decides both whether a hook point exists and what is wrapped,
so an inherited method is wrapped like an own one. Each wrapped attribute is one `_Slot`:
what was there, and the layers on it in a fixed order (`LAYER_RANK`: recording always
outermost), rebuilt when a feature comes or goes; the last one gone restores precisely what
was there, and only while the attribute still holds keytrace's wrapper.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import wrapt

from keytrace.live.registry import AlarmSettings
from keytrace.record.recorder import Recorder
from keytrace.vllm.hook import hooks, support
from keytrace.vllm.hook.compat import resolve
from keytrace.vllm.mods import catalog, fixes, inject

log = logging.getLogger("keytrace")

Target = Literal[
    "scheduler", "config", "tiering_class", "manager", "tiering", "primary", "tier", "connector"
]
Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
Binding = Any  # None for class rows; what the instance rows need, e.g. (recorder, scheduler)
Observer = Callable[..., Any]

ENV_INJECT = "KEYTRACE_INJECT"
ENV_FIX = "KEYTRACE_FIX"


@dataclass(frozen=True)
class Patch:
    """One row of the patch table. ``make(binding)`` returns a wrapt wrapper function."""

    feature: str
    target: Target
    attr: str
    make: Callable[[Binding], Wrapper]
    essential: bool = True
    params: tuple[str | None, ...] = ()
    """The parameters of vLLM's function (after ``self``) this row relies on, by position:
    those its observer reads (None: a position it does not read), or, for a row that
    replaces the function, all of them. `keytrace.vllm.hook.support` checks them against
    the installed vLLM before anything is patched."""


# ----------------------------------------------------------------- observers
def _observed(
    rec: Recorder,
    sched: Any,
    where: str,
    before: Observer | None,
    after: Observer | None,
    always: bool,
    wrapped: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The only place recording code runs around a vLLM call.

    vLLM's call runs exactly as it would without keytrace; ``before``/``after`` failures
    are counted and logged once (`Recorder.fail`) and never reach vLLM. With ``always``,
    ``after`` runs (with result None) even when vLLM's call raises.
    """
    if before is not None:
        try:
            before(rec, sched, args, kwargs)
        except Exception as exc:
            rec.fail(where, exc)
    if after is None:
        return wrapped(*args, **kwargs)
    result = None
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        if not always:
            raise
        _after(rec, sched, where, after, None, args, kwargs)
        raise
    _after(rec, sched, where, after, result, args, kwargs)
    return result


def _after(
    rec: Recorder,
    sched: Any,
    where: str,
    after: Observer,
    result: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    try:
        after(rec, sched, result, args, kwargs)
    except Exception as exc:
        rec.fail(where, exc)


def observe_hot(where: str, after: Observer) -> Callable[[Binding], Wrapper]:
    """`observe` for an instance row on the per-key hot path (``manager.lookup``, called
    once per chunk of every scan): the same semantics as ``observe(where, after=after)``
    without `_observed`'s and `_after`'s frames."""

    def make(binding: Binding) -> Wrapper:
        if binding is None:
            raise TypeError(f"{where}: observe_hot is for instance rows only")
        rec, sched = binding

        def hot(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            try:
                after(rec, sched, result, args, kwargs)
            except Exception as exc:
                rec.fail(where, exc)
            return result

        return hot

    return make


def observe(
    where: str,
    *,
    before: Observer | None = None,
    after: Observer | None = None,
    always: bool = False,
) -> Callable[[Binding], Wrapper]:
    """A recording row's wrapper factory: ``before(rec, sched, args, kwargs)`` and
    ``after(rec, sched, result, args, kwargs)`` around vLLM's call (see `_observed`).

    Class rows find the recorder from the scheduler instance (unrecorded schedulers pass
    straight through); instance rows are bound to ``(recorder, scheduler)`` up front.
    """

    def make(binding: Binding) -> Wrapper:
        if binding is not None:
            rec, sched = binding

            def bound(
                wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                return _observed(rec, sched, where, before, after, always, wrapped, args, kwargs)

            return bound

        def unbound(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            rec = hooks.recorder_of(instance)
            if rec is None:
                return wrapped(*args, **kwargs)
            return _observed(rec, instance, where, before, after, always, wrapped, args, kwargs)

        return unbound

    return make


def observe_iter(
    where: str, over: Callable[[Recorder, Any, Any], Any]
) -> Callable[[Binding], Wrapper]:
    """An instance row whose observer hands vLLM's returned iterable on item by item:
    ``over(rec, at, result)`` is a generator yielding every item of ``result`` unchanged
    (it records as it goes; its own failures are counted, never raised)."""

    def make(binding: Binding) -> Wrapper:
        rec, at = binding

        def wrapper(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            result = wrapped(*args, **kwargs)
            try:
                return over(rec, at, result)
            except Exception as exc:
                rec.fail(where, exc)
                return result

        return wrapper

    return make


def _record_init(binding: Binding) -> Wrapper:
    """``OffloadingConnectorScheduler.__init__``: start recording this scheduler.

    A scheduler built from stand-ins (vLLM's unit tests use SimpleNamespace configs) is
    skipped with one debug line; a real one that cannot be recorded gets one WARNING.
    """

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        directory, alarm = _STATE.directory, _STATE.alarm
        if directory is not None or alarm is not None:
            _start_recording(instance, directory, alarm, args, kwargs)
        return result

    return wrapper


def _start_recording(
    sched: Any,
    directory: str | None,
    alarm: AlarmSettings | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    try:
        spec = hooks.arg(args, kwargs, 0, "spec")
        vllm_config = hooks.arg(args, kwargs, 1, "vllm_config")
        kv_cache_config = hooks.arg(args, kwargs, 2, "kv_cache_config")
        if hooks.is_stand_in(vllm_config, kv_cache_config):
            log.debug("keytrace: not recording a scheduler built from stand-in configs")
            return
        problems = support.manager_problems(sched.manager, _rows("record", "manager"))
        if not problems and hooks.is_tiered(sched.manager):
            problems = [c.problem for c in capability("record:tiered").failed]
        if problems:
            _STATE.warn_once(
                f"keytrace: not recording a scheduler with the offloading manager "
                f"{type(sched.manager).__name__} ({'; '.join(problems)})"
            )
            return
        rec = hooks.start_recording(
            sched,
            directory,
            spec,
            vllm_config,
            kv_cache_config,
            modified=modifications(),
            exact_scans=_STATE.exact_scans,
            alarm=alarm,
        )
    except Exception as exc:
        _STATE.warn_once(f"keytrace: not recording this scheduler ({type(exc).__name__}: {exc})")
        return
    apply_instance("record", "manager", sched.manager, (rec, sched))
    if hooks.is_tiered(sched.manager):
        apply_instance("record", "tiering", sched.manager, (rec, sched))
        apply_instance("record", "primary", sched.manager.primary_tier, (rec, sched))
        for i, tier in enumerate(sched.manager.secondary_tiers):
            apply_instance("record", "tier", tier, (rec, (sched, i)))
    hooks.RECORDERS[sched] = rec
    with _STATE.lock:
        _STATE.recorders.append(rec)
        say, _STATE.announce = _STATE.announce, None
    if say is not None:
        with contextlib.suppress(Exception):
            log.warning(say())


def _replace(fn: Wrapper) -> Callable[[Binding], Wrapper]:
    """A row that replaces vLLM's function (an injection): the wrapper decides everything."""
    return lambda _binding: fn


def _notify(method: str) -> Callable[[Binding], Wrapper]:
    """A harness row: after vLLM's call, ``binding.<method>(result, args, kwargs)``."""

    def make(binding: Binding) -> Wrapper:
        def wrapper(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            result = wrapped(*args, **kwargs)
            getattr(binding, method)(result, args, kwargs)
            return result

        return wrapper

    return make


# --------------------------------------------------------------------- table
def _store_mask_rows(
    kind: str, fns: dict[str, Wrapper], known: Mapping[str, str]
) -> tuple[Patch, ...]:
    """Rows that replace the store path's mask (``kind`` "inject" or "fix"), one a name."""
    assert set(fns) == set(known)
    return tuple(
        Patch(
            f"{kind}:{name}",
            "scheduler",
            "_reachable_store_block_mask",
            _replace(fn),
            params=inject.MASK_ARGS,
        )
        for name, fn in fns.items()
    )


# What an active store-path change logs, and where its description lives.
_CHANGES: dict[str, tuple[str, Mapping[str, str]]] = {
    "inject": ("injected historical bug %r into", catalog.INJECTIONS),
    "fix": ("applied candidate fix %r to", catalog.FIXES),
}


TABLE: tuple[Patch, ...] = (
    # recording: scheduler class (episode, allocation, step, finish, reset context)
    Patch(
        "record",
        "scheduler",
        "__init__",
        _record_init,
        params=("spec", "vllm_config", "kv_cache_config"),
    ),
    Patch(
        "record",
        "scheduler",
        "get_num_new_matched_tokens",
        observe("get_num_new_matched_tokens", before=hooks.episode_begin, after=hooks.episode_end),
        params=("request", "num_computed_tokens"),
    ),
    Patch(
        "record",
        "scheduler",
        "update_state_after_alloc",
        observe("update_state_after_alloc", after=hooks.accepted),
        params=("request", None, "num_external_tokens"),
    ),
    Patch(
        "record",
        "scheduler",
        "build_connector_meta",
        observe("build_connector_meta", before=hooks.step_begin, after=hooks.step_end, always=True),
        params=("scheduler_output",),
    ),
    Patch(
        "record",
        "scheduler",
        "request_finished",
        observe("request_finished", after=hooks.request_finished),
        params=("request",),
    ),
    Patch("record", "scheduler", "reset_cache", observe("reset_cache", after=hooks.flush)),
    # optional private helpers: exact scan boundaries (inferred from group changes without)
    Patch(
        "record",
        "scheduler",
        "_maximal_prefix_lookup",
        observe("scan", before=hooks.scan_begin),
        essential=False,
    ),
    Patch(
        "record",
        "scheduler",
        "_sliding_window_lookup",
        observe("scan", before=hooks.scan_begin),
        essential=False,
    ),
    # recording: the manager instance each recorded scheduler creates
    Patch(
        "record",
        "manager",
        "lookup",
        observe_hot("manager.lookup", hooks.lookup),
        params=("key", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "prepare_store",
        observe("manager.prepare_store", after=hooks.prepare_store),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "complete_store",
        observe("manager.complete_store", after=hooks.complete_store),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "prepare_load",
        observe("manager.prepare_load", after=hooks.prepare_load),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "manager",
        "complete_load",
        observe("manager.complete_load", after=hooks.complete_load),
        params=("keys", "req_context"),
    ),
    Patch("record", "manager", "reset_cache", observe("manager.reset_cache", after=hooks.reset)),
    # recording: below a tiered manager's public methods (vLLM 0.33.0's tiering manager)
    Patch(
        "record",
        "tiering",
        "_initiate_promotion",
        observe(
            "tiering.promotion",
            before=hooks.promotion_begin,
            after=hooks.promotion_end,
            always=True,
        ),
        essential=False,
        params=("tier_idx",),
    ),
    Patch(
        "record",
        "tiering",
        "complete_store",
        observe(
            "tiering.complete_store", before=hooks.store_begin, after=hooks.store_end, always=True
        ),
        params=("keys", "req_context"),
    ),
    Patch(
        "record",
        "tiering",
        "_should_store_to_tier",
        observe("tiering.backpressure", after=hooks.backpressure),
        essential=False,
        params=("tier",),
    ),
    Patch("record", "tiering", "reset_cache", observe("tiering.reset", after=hooks.reset_tiers)),
    Patch(
        "record",
        "tiering",
        "on_reset_flushed",
        observe("tiering.reset_flushed", after=hooks.reset_flushed),
        essential=False,
    ),
    Patch(
        "record",
        "primary",
        "prepare_write",
        observe("primary.prepare_write", after=hooks.prepare_write),
    ),
    Patch(
        "record",
        "primary",
        "complete_write",
        observe("primary.complete_write", after=hooks.complete_write),
    ),
    Patch("record", "tier", "lookup", observe("tier.lookup", after=hooks.tier_lookup)),
    Patch(
        "record",
        "tier",
        "submit_store",
        observe("tier.submit_store", after=hooks.tier_submit_store),
    ),
    Patch(
        "record",
        "tier",
        "get_finished_jobs",
        observe("tier.get_finished_jobs", after=hooks.tier_finished),
    ),
    Patch("record", "tier", "take_events", observe_iter("tier.take_events", hooks.tier_events)),
    # historical store-side bugs (testing only)
    *_store_mask_rows(
        "inject",
        {
            "pre48911": inject.pre48911,
            "no_eagle_plus1": inject.no_eagle_plus1,
            "short_window_tail": inject.short_window_tail,
        },
        catalog.INJECTIONS,
    ),
    *_store_mask_rows(
        "fix",
        {
            "mtp_left_chunk": fixes.mtp_left_chunk,
            "unkeyable_peek_fallback": fixes.unkeyable_peek_fallback,
        },
        {k: v for k, v in catalog.FIXES.items() if k in catalog.STORE_MASK_FIXES},
    ),
    # a fix on both sides: lookup accepts a proof key for a peek, store writes it
    Patch(
        "fix:eagle_proof_key",
        "scheduler",
        "_lookup_complete_chunks",
        _replace(fixes.lookup_with_unkeyable_peek),
        params=("req_status", "max_num_new_tokens"),
    ),
    Patch(
        "fix:eagle_proof_key",
        "scheduler",
        "_sliding_window_lookup",
        _replace(fixes.scan_with_proof),
        params=("keys", "sliding_window_size", "req_context", "initial_window_size"),
    ),
    Patch(
        "fix:eagle_proof_key",
        "scheduler",
        "_build_store_jobs",
        _replace(fixes.store_peek_proofs),
        params=("scheduler_output",),
    ),
    # a lookup-side fix of the window in chunks, where vLLM computes it for every group
    Patch(
        "fix:window_minus_one",
        "config",
        "get_sliding_window_size_in_chunks",
        _replace(fixes.window_minus_one),
        params=("kv_cache_spec", "tokens_per_chunk"),
    ),
    # a tiered manager's promotions pin the keys their own request found in the primary
    Patch(
        "fix:promotion_pins_prefix",
        "tiering_class",
        "lookup",
        _replace(fixes.note_primary_hits),
        params=("key", "req_context", "exclude_tier_idx"),
    ),
    Patch(
        "fix:promotion_pins_prefix",
        "tiering_class",
        "_initiate_promotion",
        _replace(fixes.promote_pinning_prefix),
        params=("tier_idx", "key", "req_context"),
    ),
    Patch(
        "fix:promotion_pins_prefix",
        "tiering_class",
        "on_schedule_end",
        _replace(fixes.forget_primary_hits),
        params=("context",),
    ),
    # the CPU harness's own observers on the connector instance it builds
    Patch("harness", "connector", "get_num_new_matched_tokens", _notify("on_lookup")),
    Patch("harness", "connector", "update_state_after_alloc", _notify("on_alloc")),
)
"""Every patch keytrace makes on vLLM, in the order it is applied."""


FEATURES: tuple[str, ...] = tuple(dict.fromkeys(p.feature for p in TABLE))


def _rows(feature: str, target: Target | None = None) -> list[Patch]:
    return [p for p in TABLE if p.feature == feature and (target is None or p.target == target)]


# ------------------------------------------------------------------ mechanism
_resolve = resolve  # one lookup rule for the checks and the wrap (`compat.resolve`)


LAYER_RANK = {"fix": 0, "inject": 1, "record": 3}
"""Where a feature's wrapper sits when several wrap one attribute, innermost first: a
candidate fix next to vLLM's code, an injection (a store bug) over the fixed path, the
harness's and tests' own rows (rank 2), recording outermost, so the recorder observes
whatever the modified vLLM does, once, in whatever order the features were switched on."""


def _rank(feature: str) -> int:
    return LAYER_RANK.get(feature.partition(":")[0], 2)


@dataclass
class _Layer:
    """One row applied to one attribute: its feature, the row and its binding."""

    feature: str
    row: Patch
    binding: Binding
    order: int
    """Application order: breaks ties between layers of one rank."""


@dataclass
class _Slot:
    """One attribute keytrace wraps: what was there before, and every layer on it.

    The attribute holds ``original`` wrapped by every layer in `LAYER_RANK` order,
    rebuilt whenever a layer comes or goes (`install`), so undoing one feature never
    disturbs another, in any order. Restored exactly (own attribute put back, or deleted
    so an inherited one shows again) when the last layer goes, and only while the
    attribute still holds keytrace's wrapper: what someone else put there later stays."""

    owner: Callable[[], Any]  # the owner (a weak reference for instances)
    attr: str
    had_own: bool  # the owner's own __dict__ held the attribute before
    original: Any
    layers: list[_Layer]
    proxy: Any = None  # what keytrace last set (None: nothing set)

    def current(self, owner: Any) -> Any:
        return (owner.__dict__ if isinstance(owner, type) else vars(owner)).get(self.attr)

    def stale(self, owner: Any) -> bool:
        """Someone else replaced keytrace's wrapper since it was set."""
        return self.proxy is not None and self.current(owner) is not self.proxy

    def install(self) -> None:
        owner = self.owner()
        if owner is None:
            return
        if self.stale(owner):
            log.debug("keytrace: %s was replaced by someone else; left as is", self.attr)
            self.layers, self.proxy = [], None
            return
        if not self.layers:
            self._set(owner, self.original if self.had_own else _ABSENT)
            self.proxy = None
            return
        fn = self.original
        for layer in sorted(self.layers, key=lambda x: (_rank(x.feature), x.order)):
            fn = wrapt.FunctionWrapper(fn, layer.row.make(layer.binding))
        # the wrapper holds its slot (`_State.slots` only weakly): what an instance's
        # slot holds (the bound original, bindings naming the scheduler or the harness)
        # then lives exactly as long as the instance, not as long as the process
        fn._self_keytrace_slot = self
        self._set(owner, fn)
        self.proxy = fn

    def _set(self, owner: Any, value: Any) -> None:
        # vars(): bypass a custom __setattr__ (a MagicMock's child bookkeeping, say), so an
        # instance is touched in exactly one place and restored exactly
        if isinstance(owner, type):
            if value is _ABSENT:
                if self.attr in owner.__dict__:
                    delattr(owner, self.attr)
            else:
                setattr(owner, self.attr, value)
        elif value is _ABSENT:
            vars(owner).pop(self.attr, None)
        else:
            vars(owner)[self.attr] = value


_ABSENT = object()
"""`_Slot._set`'s value for "no own attribute": delete it."""


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _apply(feature: str, owner: Any, row: Patch, binding: Binding) -> None:
    """Add ``row`` of ``feature`` as a layer on ``owner.<attr>`` (nothing if absent)."""
    with _STATE.lock:
        key = (id(owner), row.attr)
        slot = _STATE.slots.get(key)
        if slot is not None and slot.stale(owner):
            slot = None  # someone else's value is there now: start from it
        if slot is None:
            original = _resolve(owner, row.attr)
            if original is None:
                return
            own = owner.__dict__ if isinstance(owner, type) else vars(owner)
            had_own = row.attr in own
            stored = own.get(row.attr) if had_own else original
            slot = _Slot(_ref(owner), row.attr, had_own, stored, [])
            _STATE.slots[key] = slot
        _STATE.order += 1
        slot.layers.append(_Layer(feature, row, binding, _STATE.order))
        slot.install()


def apply_instance(feature: str, target: Target, obj: Any, binding: Binding) -> None:
    """Apply ``feature``'s rows for ``target`` to the instance ``obj``."""
    for row in _rows(feature, target):
        _apply(feature, obj, row, binding)


class _State:
    """Process-wide patch state, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.enabled: set[str] = set()
        """Features whose class-level rows are applied (`enable`)."""
        self.slots: weakref.WeakValueDictionary[tuple[int, str], _Slot] = (
            weakref.WeakValueDictionary()
        )
        """(id of the owner, attribute) -> what keytrace wraps there. Weak: a slot lives
        as long as the wrapper keytrace set, which holds it (`_Slot.install`), so the slots
        of a collected instance go with it (thousands of harnesses and recorded schedulers
        in a process were otherwise kept alive for good)."""
        self.order = 0
        self.directory: str | None = None
        self.alarm: AlarmSettings | None = None
        self.exact_scans = False
        self.recorders: list[Recorder] = []
        self.announce: Callable[[], str] | None = None
        self.announced = False
        """The start-up line to log when the first scheduler is recorded (`announce`)."""
        self._warned: set[str] = set()

    def info_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.info(message)

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)


_STATE = _State()


def scheduler_class() -> tuple[Any, list[str]]:
    """``OffloadingConnectorScheduler`` and what is missing for recording (empty: usable)."""
    from keytrace.vllm.hook.compat import load_targets

    cls, _base, problems = load_targets()
    return cls, problems


def capability(name: str) -> support.Capability:
    """Capability ``name`` (`keytrace.vllm.hook.support`) over this table."""
    return support.capability(name, TABLE)


def capabilities() -> list[support.Capability]:
    """Every in-server capability over this table (what ``keytrace doctor`` lists)."""
    return support.capabilities(TABLE)


def missing_hooks(feature: str) -> list[str]:
    """Why ``feature`` cannot be patched on the installed vLLM: its capability's failed
    checks, empty when every check passes."""
    return [c.problem for c in capability(support.capability_of(feature)).failed]


def enable(feature: str) -> bool:
    """Apply ``feature``'s class-level rows (idempotent). False: a hook point is missing;
    then nothing is patched and one warning says what."""
    if feature not in FEATURES:
        raise ValueError(f"unknown patch feature {feature!r}; known: {', '.join(FEATURES)}")
    with _STATE.lock:
        if feature in _STATE.enabled:
            return True
        problems = missing_hooks(feature)
        if problems:
            from keytrace.vllm.hook.compat import vllm_version

            _STATE.warn_once(
                f"keytrace: cannot hook installed vLLM {vllm_version()} "
                f"({'; '.join(problems)}). Nothing is patched for {feature} and vLLM is "
                "left untouched; `keytrace doctor` lists every check."
            )
            return False
        cls, _ = scheduler_class()
        _STATE.enabled.add(feature)
        for row in _rows(feature, "scheduler"):
            _apply(feature, cls, row, None)
        if _rows(feature, "config"):
            from keytrace.vllm.hook.compat import config_module

            for row in _rows(feature, "config"):
                _apply(feature, config_module(), row, None)
        if _rows(feature, "tiering_class"):
            from keytrace.vllm.hook.compat import tiering_class

            for row in _rows(feature, "tiering_class"):
                _apply(feature, tiering_class(), row, None)
        if feature == "record":
            _STATE.exact_scans = all(
                _resolve(cls, p.attr) is not None for p in _rows(feature, "scheduler")
            )
        kind, _, name = feature.partition(":")
        if kind in _CHANGES:
            verb, known = _CHANGES[kind]
            log.warning(
                "keytrace: " + verb + " vLLM's offload path (%s); every trace recorded now says "
                "so in its header",
                name,
                known[name],
            )
        return True


def disable(feature: str) -> None:
    """Undo every patch of ``feature`` (class and instance rows); other features' layers on
    the same attributes stay, in their order."""
    with _STATE.lock:
        _STATE.enabled.discard(feature)
        for key, slot in list(_STATE.slots.items()):
            if any(x.feature == feature for x in slot.layers):
                slot.layers = [x for x in slot.layers if x.feature != feature]
                slot.install()
            if not slot.layers:
                del _STATE.slots[key]


def active(feature: str) -> bool:
    """``feature`` is switched on, or has a layer on some instance."""
    with _STATE.lock:
        return feature in _STATE.enabled or any(
            x.feature == feature for slot in _STATE.slots.values() for x in slot.layers
        )


def modifications() -> list[str]:
    """Active features that change vLLM's behaviour (injections, fixes), for the trace
    header."""
    with _STATE.lock:
        return sorted(f for f in _STATE.enabled if f.startswith(("inject:", "fix:")))


# ------------------------------------------------------------------ public API
def install(directory: str | os.PathLike[str] | None, alarm: AlarmSettings | None = None) -> bool:
    """Record every OffloadingConnectorScheduler built from now on under ``directory``
    (None: write no trace), judging its episodes live when ``alarm`` is given.

    Idempotent. False (one warning, nothing patched) if this vLLM lacks a hook point.
    """
    from keytrace.live.registry import forget_alarms

    with _STATE.lock:
        _STATE.directory = None if directory is None else os.fspath(directory)
        _STATE.alarm = alarm
        if _STATE.directory is None and alarm is None:
            return False
        forget_alarms()
        if enable("record"):
            _say_unverified()
            return True
        _STATE.directory = None
        _STATE.alarm = None
        return False


def _say_unverified() -> None:
    """One INFO line when recording on code keytrace's CI never ran (it passed every check)."""
    from keytrace.vllm.hook.support import VERIFIED_RELEASES, vllm_info

    info = vllm_info()
    if not info.verified:
        _STATE.info_once(
            f"keytrace: vLLM {info.version} ({info.kind}): its offloading code passes "
            f"every hook check, so keytrace records it (verified releases: "
            f"{', '.join(VERIFIED_RELEASES)}; traces say vllm_verified: false)"
        )


def uninstall() -> None:
    """Close every recorder (flushing its rows), then undo every recording patch."""
    with _STATE.lock:
        _STATE.directory = None
        _STATE.alarm = None
        recs, _STATE.recorders = _STATE.recorders, []
    for rec in recs:
        with contextlib.suppress(Exception):
            rec.close()
    disable("record")


def announce(line: Callable[[], str]) -> None:
    """Log ``line()`` once, at WARNING, when this process records its first scheduler (the
    plugin's start-up line: vLLM loads plugins in every process, only the engine core
    builds a scheduler)."""
    with _STATE.lock:
        if not _STATE.announced:
            _STATE.announced = True
            _STATE.announce = line


def retarget(directory: str | os.PathLike[str]) -> None:
    """Record the schedulers built from now on under ``directory`` (those built before keep
    theirs): `keytrace.vllm.hook.pytest_plugin` gives every test its own folder."""
    with _STATE.lock:
        _STATE.directory = os.fspath(directory)


def take_recorders() -> list[Recorder]:
    """The recorders started since the last call, handed over to the caller (who closes
    them); recording stays installed."""
    with _STATE.lock:
        recs, _STATE.recorders = _STATE.recorders, []
    return recs


def installed() -> bool:
    return active("record")


def recorders() -> list[Recorder]:
    with _STATE.lock:
        return list(_STATE.recorders)


@contextlib.contextmanager
def recording(
    directory: str | os.PathLike[str] | None, alarm: AlarmSettings | None = None
) -> Iterator[list[Recorder]]:
    """Record every scheduler built inside the block; flush and unpatch on exit.

    Yields the live list of recorders created so far (tests read their stats, and each
    recorder's ``alarm``).
    """
    from keytrace.errors import VllmUnavailableError

    if not install(directory, alarm):
        raise VllmUnavailableError(
            "keytrace could not install its hooks on this vLLM (see the warning above)"
        )
    try:
        yield _STATE.recorders
    finally:
        uninstall()


def apply_injection(name: str) -> None:
    """Switch injection ``name`` on for the rest of the process (one at a time)."""
    from keytrace.errors import UsageError, VllmUnavailableError

    feature = f"inject:{catalog.check_injection(name)}"
    others = [f for f in modifications() if f != feature and f.startswith("inject:")]
    if others:
        raise UsageError(f"{others[0]} is already active; one injection at a time")
    if not enable(feature):
        raise VllmUnavailableError(f"cannot inject {name}: this vLLM lacks the hook point")


def remove_injections() -> None:
    """Undo every injection and fix."""
    for feature in modifications():
        disable(feature)


def apply_fix(name: str) -> None:
    """Switch candidate fix ``name`` on for the rest of the process.

    A fix and an injection may both be active: the injection (a store bug) then wraps the
    fixed store path, as a bug reintroduced on top of a fix would."""
    from keytrace.errors import VllmUnavailableError

    if not enable(f"fix:{catalog.check_fix(name)}"):
        raise VllmUnavailableError(f"cannot apply fix {name}: this vLLM lacks the hook point")


@contextlib.contextmanager
def fixed(spec: str | None) -> Iterator[None]:
    """Apply the candidate fixes of ``spec`` (`keytrace.vllm.mods.catalog.fix_names`) inside the block (no-op for
    None)."""
    with contextlib.ExitStack() as stack:
        for name in catalog.fix_names(spec):
            stack.enter_context(_scoped("fix", apply_fix, name))
        yield


def fix_from_env() -> str | None:
    """Apply ``KEYTRACE_FIX`` if set (a generated regression's green run with the fix; one
    name or several joined by commas)."""
    spec = os.environ.get(ENV_FIX)
    for name in catalog.fix_names(spec):
        apply_fix(name)
    return spec or None


def injected(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Apply injection ``name`` inside the block (no-op for None)."""
    return _scoped("inject", apply_injection, name)


@contextlib.contextmanager
def _scoped(kind: str, apply: Callable[[str], None], name: str | None) -> Iterator[None]:
    """``apply(name)`` inside the block; undone after it unless it was on before."""
    if not name or f"{kind}:{name}" in _STATE.enabled:
        yield
        return
    apply(name)
    try:
        yield
    finally:
        disable(f"{kind}:{name}")


def inject_from_env() -> str | None:
    """Apply ``KEYTRACE_INJECT`` if set (a generated regression's red run, a test server)."""
    name = os.environ.get(ENV_INJECT)
    if name:
        apply_injection(name)
    return name or None
