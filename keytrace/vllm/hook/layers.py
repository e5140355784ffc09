"""How keytrace patches vLLM: a patch is a row (`Patch`) of the one table
(`keytrace.vllm.hook.table`), applied to an attribute as a *layer* and undone in one place.

Each wrapped attribute is one `_Slot`: what was there, and the layers on it in a fixed order
(`LAYER_RANK`: recording always outermost), rebuilt when a feature comes or goes; the last
one gone restores precisely what was there, and only while the attribute still holds
keytrace's wrapper. One lookup rule (`keytrace.vllm.hook.compat.resolve`) decides both
whether a hook point exists and what is wrapped, so an inherited method is wrapped like an
own one. Every wrapper is a ``wrapt.FunctionWrapper``: identity-visible behaviour
(``isinstance``, attribute reads and writes, ``__wrapped__``, names, signatures) goes to the
original.

This module knows no row: the table registers itself (`register_table`), so the mechanism,
the table and what starts a recording import each other in one direction only.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import wrapt

from keytrace.vllm.hook.compat import resolve

log = logging.getLogger("keytrace")

Target = Literal[
    "scheduler",
    "config",
    "tiering_class",
    "platform",
    "manager",
    "tiering",
    "primary",
    "tier",
    "connector",
]
Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
Binding = Any  # None for class rows; what the instance rows need, e.g. (recorder, scheduler)


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


_TABLE: list[tuple[Patch, ...]] = []


def register_table(table: tuple[Patch, ...]) -> None:
    """The table of every patch (`keytrace.vllm.hook.table` registers it when imported)."""
    _TABLE[:] = [table]


def table() -> tuple[Patch, ...]:
    """Every row of the patch table (`keytrace.vllm.hook.patches` loads it)."""
    if not _TABLE:
        raise RuntimeError("the patch table is not loaded: import keytrace.vllm.hook.patches")
    return _TABLE[0]


def rows(feature: str, target: Target | None = None) -> list[Patch]:
    """``feature``'s rows (for ``target`` only, if given), in the table's order."""
    return [p for p in table() if p.feature == feature and (target is None or p.target == target)]


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
            fn = _wrap(fn, layer.row.make(layer.binding))
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


def _wrap(fn: Any, wrapper: Wrapper) -> Any:
    """``fn`` wrapped by one layer: a ``wrapt`` proxy, or, for a hot row's plain form
    (`keytrace.vllm.hook.wrappers.observe_hot`) over a real bound method, a plain function
    carrying the method's names, ``__wrapped__``, ``__self__`` and ``__func__``. A proxy
    also forwards attribute writes and ``isinstance``, which only a stand-in (a test's
    ``MagicMock`` child) needs; a real method gets the plain form, whose call costs about
    half of the proxy's (`tools/bench_recorder.py`)."""
    direct = getattr(wrapper, "direct", None)
    if direct is None or not isinstance(fn, types.MethodType):
        return wrapt.FunctionWrapper(fn, wrapper)
    plain: Any = functools.update_wrapper(direct(fn), fn)
    plain.__self__, plain.__func__ = fn.__self__, fn.__func__
    return plain


_ABSENT = object()
"""`_Slot._set`'s value for "no own attribute": delete it."""


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def apply(feature: str, owner: Any, row: Patch, binding: Binding) -> None:
    """Add ``row`` of ``feature`` as a layer on ``owner.<attr>`` (nothing if absent)."""
    with STATE.lock:
        key = (id(owner), row.attr)
        slot = STATE.slots.get(key)
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
            STATE.slots[key] = slot
        STATE.order += 1
        slot.layers.append(_Layer(feature, row, binding, STATE.order))
        slot.install()


class _State:
    """Process-wide patch state, guarded by one lock: which features' class rows are applied
    and every slot keytrace wraps."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.enabled: set[str] = set()
        """Features whose class-level rows are applied (`keytrace.vllm.hook.patches.enable`)."""
        self.slots: weakref.WeakValueDictionary[tuple[int, str], _Slot] = (
            weakref.WeakValueDictionary()
        )
        """(id of the owner, attribute) -> what keytrace wraps there. Weak: a slot lives
        as long as the wrapper keytrace set, which holds it (`_Slot.install`), so the slots
        of a collected instance go with it (thousands of harnesses and recorded schedulers
        in a process were otherwise kept alive for good)."""
        self.order = 0


STATE = _State()


def apply_instance(feature: str, target: Target, obj: Any, binding: Binding) -> None:
    """Apply ``feature``'s rows for ``target`` to the instance ``obj``."""
    for row in rows(feature, target):
        apply(feature, obj, row, binding)


def undo(feature: str) -> None:
    """Take every layer of ``feature`` off (class and instance rows); other features' layers
    on the same attributes stay, in their order."""
    with STATE.lock:
        STATE.enabled.discard(feature)
        for key, slot in list(STATE.slots.items()):
            if any(x.feature == feature for x in slot.layers):
                slot.layers = [x for x in slot.layers if x.feature != feature]
                slot.install()
            if not slot.layers:
                del STATE.slots[key]


def active(feature: str) -> bool:
    """``feature`` is switched on, or has a layer on some instance."""
    with STATE.lock:
        return feature in STATE.enabled or any(
            x.feature == feature for slot in STATE.slots.values() for x in slot.layers
        )
