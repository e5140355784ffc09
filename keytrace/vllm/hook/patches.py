"""Recording, injections and candidate fixes, switched on and off: the one API through which
keytrace patches vLLM.

Every patch is a row of one table (`keytrace.vllm.hook.table`), applied and undone by one
mechanism (`keytrace.vllm.hook.layers`); recording starts in a scheduler's ``__init__``
(`keytrace.vllm.hook.bootstrap`). Before anything is patched, `keytrace.vllm.hook.support`
checks every hook point, every parameter a row relies on, and for a replacement the source
it was written against: a failed check refuses with one warning and patches nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from keytrace.live.registry import AlarmSettings
from keytrace.record.recorder import Recorder
from keytrace.vllm.hook import layers, support
from keytrace.vllm.hook.bootstrap import SESSION, modifications
from keytrace.vllm.hook.compat import resolve
from keytrace.vllm.hook.layers import Patch, active, apply_instance, rows
from keytrace.vllm.hook.table import CHANGES, FEATURES, TABLE
from keytrace.vllm.mods import catalog

__all__ = [
    "FEATURES",
    "TABLE",
    "Patch",
    "active",
    "apply_instance",
    "modifications",
]

log = layers.log

ENV_INJECT = "KEYTRACE_INJECT"
ENV_FIX = "KEYTRACE_FIX"


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
    with layers.STATE.lock:
        if feature in layers.STATE.enabled:
            return True
        problems = missing_hooks(feature)
        if problems:
            from keytrace.vllm.hook.compat import vllm_version

            SESSION.warn_once(
                f"keytrace: cannot hook installed vLLM {vllm_version()} "
                f"({'; '.join(problems)}). Nothing is patched for {feature} and vLLM is "
                "left untouched; `keytrace doctor` lists every check."
            )
            return False
        cls, _ = scheduler_class()
        layers.STATE.enabled.add(feature)
        for target, owner in _class_owners(cls).items():
            for row in rows(feature, target):
                layers.apply(feature, owner(), row, None)
        if feature == "record":
            SESSION.exact_scans = all(
                resolve(cls, p.attr) is not None for p in rows(feature, "scheduler")
            )
        kind, _, name = feature.partition(":")
        if kind in CHANGES:
            verb, known = CHANGES[kind]
            log.warning(
                "keytrace: " + verb + " vLLM's offload path (%s); every trace recorded now says "
                "so in its header",
                name,
                known[name],
            )
        return True


def _class_owners(scheduler: Any) -> dict[layers.Target, Callable[[], Any]]:
    """The class-level targets (`keytrace.vllm.hook.table`), each with what finds its
    owner (called only for a feature that has rows there)."""
    from keytrace.vllm.hook import compat

    return {
        "scheduler": lambda: scheduler,
        "config": compat.config_module,
        "tiering_class": compat.tiering_class,
        "platform": compat.cpu_platform_class,
    }


def disable(feature: str) -> None:
    """Undo every patch of ``feature`` (class and instance rows); other features' layers on
    the same attributes stay, in their order."""
    layers.undo(feature)


# ------------------------------------------------------------------ public API
def install(directory: str | os.PathLike[str] | None, alarm: AlarmSettings | None = None) -> bool:
    """Record every OffloadingConnectorScheduler built from now on under ``directory``
    (None: write no trace), judging its episodes live when ``alarm`` is given.

    Idempotent. False (one warning, nothing patched) if this vLLM lacks a hook point.
    """
    from keytrace.live.registry import forget_alarms

    with SESSION.lock:
        SESSION.directory = None if directory is None else os.fspath(directory)
        SESSION.alarm = alarm
        if SESSION.directory is None and alarm is None:
            return False
        forget_alarms()
        if enable("record"):
            _say_unverified()
            return True
        SESSION.directory = None
        SESSION.alarm = None
        return False


def _say_unverified() -> None:
    """One INFO line when recording on code keytrace's CI never ran (it passed every check)."""
    from keytrace.vllm.hook.support import VERIFIED_RELEASES, vllm_info

    info = vllm_info()
    if not info.verified:
        SESSION.info_once(
            f"keytrace: vLLM {info.version} ({info.kind}): its offloading code passes "
            f"every hook check, so keytrace records it (releases its CI records on: "
            f"{', '.join(VERIFIED_RELEASES)}; traces say vllm_verified: false)"
        )


def uninstall() -> None:
    """Close every recorder (flushing its rows), then undo every recording patch."""
    with SESSION.lock:
        SESSION.directory = None
        SESSION.alarm = None
        recs, SESSION.recorders = SESSION.recorders, []
    for rec in recs:
        with contextlib.suppress(Exception):
            rec.close()
    disable("record")


def announce(line: Callable[[], str]) -> None:
    """Log ``line()`` once, at WARNING, when this process records its first scheduler (the
    plugin's start-up line: vLLM loads plugins in every process, only the engine core
    builds a scheduler)."""
    with SESSION.lock:
        if not SESSION.announced:
            SESSION.announced = True
            SESSION.announce = line


def retarget(directory: str | os.PathLike[str]) -> None:
    """Record the schedulers built from now on under ``directory`` (those built before keep
    theirs): `keytrace.vllm.hook.pytest_plugin` gives every test its own folder."""
    with SESSION.lock:
        SESSION.directory = os.fspath(directory)


def take_recorders() -> list[Recorder]:
    """The recorders started since the last call, handed over to the caller (who closes
    them); recording stays installed."""
    with SESSION.lock:
        recs, SESSION.recorders = SESSION.recorders, []
    return recs


def installed() -> bool:
    return active("record")


def recorders() -> list[Recorder]:
    with SESSION.lock:
        return list(SESSION.recorders)


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
        yield SESSION.recorders
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
    if not name or f"{kind}:{name}" in layers.STATE.enabled:
        yield
        return
    apply(name)
    try:
        yield
    finally:
        disable(f"{kind}:{name}")


@contextlib.contextmanager
def lab_platform() -> Iterator[None]:
    """The lab's own rows (feature ``lab``: vLLM's CPU platform check runs as if Triton
    were installed, `keytrace.vllm.hook.wrappers.with_triton_seen`) inside the block, undone
    after it unless they were on before. Only the CPU lab enters it, around the
    ``VllmConfig`` it builds (`keytrace.vllm.lab.config.build_vllm_config`); nothing a
    server runs does (`install` enables ``record`` alone)."""
    from keytrace.errors import VllmUnavailableError

    if support.LAB in layers.STATE.enabled:
        yield
        return
    if not enable(support.LAB):
        raise VllmUnavailableError(
            "keytrace's lab cannot build a vLLM config on this CPU: "
            + "; ".join(missing_hooks(support.LAB))
        )
    try:
        yield
    finally:
        disable(support.LAB)


def inject_from_env() -> str | None:
    """Apply ``KEYTRACE_INJECT`` if set (a generated regression's red run, a test server)."""
    name = os.environ.get(ENV_INJECT)
    if name:
        apply_injection(name)
    return name or None
