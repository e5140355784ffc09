"""What starts a recording: the wrapper of ``OffloadingConnectorScheduler.__init__``
(`record_init`) builds a scheduler's recorder and puts the recording rows on its manager,
and the session (`SESSION`: where to write, the alarm, the recorders started) that the
on/off API of `keytrace.vllm.hook.patches` sets."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from keytrace.live.registry import AlarmSettings
from keytrace.record.recorder import Recorder
from keytrace.vllm.hook import hooks, support
from keytrace.vllm.hook.layers import Binding, Wrapper, apply_instance, rows, table

log = logging.getLogger("keytrace")


class _Session:
    """Where recording goes in this process, and what it started."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.RLock()
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


SESSION = _Session()


def modifications() -> list[str]:
    """Active features that change vLLM's behaviour (injections, fixes), for the trace
    header."""
    from keytrace.vllm.hook.layers import STATE

    with STATE.lock:
        return sorted(f for f in STATE.enabled if f.startswith(("inject:", "fix:")))


def record_init(binding: Binding) -> Wrapper:
    """``OffloadingConnectorScheduler.__init__``: start recording this scheduler.

    A scheduler built from stand-ins (vLLM's unit tests use SimpleNamespace configs) is
    skipped with one debug line; a real one that cannot be recorded gets one WARNING.
    """

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        directory, alarm = SESSION.directory, SESSION.alarm
        if directory is not None or alarm is not None:
            start_recording(instance, directory, alarm, args, kwargs)
        return result

    return wrapper


def start_recording(
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
        problems = support.manager_problems(sched.manager, rows("record", "manager"))
        if not problems and hooks.is_tiered(sched.manager):
            problems = [c.problem for c in support.capability("record:tiered", table()).failed]
        if problems:
            SESSION.warn_once(
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
            exact_scans=SESSION.exact_scans,
            alarm=alarm,
        )
    except Exception as exc:
        SESSION.warn_once(f"keytrace: not recording this scheduler ({type(exc).__name__}: {exc})")
        return
    apply_instance("record", "manager", sched.manager, (rec, sched))
    if hooks.is_tiered(sched.manager):
        apply_instance("record", "tiering", sched.manager, (rec, sched))
        apply_instance("record", "primary", sched.manager.primary_tier, (rec, sched))
        for i, tier in enumerate(sched.manager.secondary_tiers):
            apply_instance("record", "tier", tier, (rec, (sched, i)))
    hooks.RECORDERS[sched] = rec
    with SESSION.lock:
        SESSION.recorders.append(rec)
        say, SESSION.announce = SESSION.announce, None
    if say is not None:
        with contextlib.suppress(Exception):
            log.warning(say())
