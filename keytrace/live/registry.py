"""The alarms of this process: how they run (`AlarmSettings`, from the ``KEYTRACE_*``
variables) and one `keytrace.live.alarm.Alarm` per geometry, shared by every recorder of
that geometry (two engines in one process, as in the lab, share one: a key offered by one
is ``other_engine`` for the other, as in the offline differ)."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keytrace.live.alarm import DEFAULT_INTERVAL, DEFAULT_MAX_BYTES, Alarm

log = logging.getLogger("keytrace")


@dataclass(frozen=True)
class AlarmSettings:
    """How the alarm runs in this process (`from_env` reads the ``KEYTRACE_*`` variables)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    interval: float = DEFAULT_INTERVAL
    warn: bool = True
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    keep_judged: bool = False
    """Keep every `Judged` (tests compare them with the offline differ, episode by episode)."""

    @staticmethod
    def from_env(environ: Mapping[str, str], recording: bool) -> AlarmSettings | None:
        """None when the alarm is off: ``KEYTRACE_ALARM=0``, or neither ``KEYTRACE_ALARM=1``
        nor recording (``KEYTRACE_DIR``) asked for it."""
        flag = environ.get("KEYTRACE_ALARM", "").strip().lower()
        if flag in ("0", "false", "no", "off") or (
            not recording and flag not in ("1", "true", "yes", "on")
        ):
            return None

        def number(name: str, default: float) -> float:
            try:
                return float(environ[name]) if environ.get(name) else default
            except ValueError:
                log.warning("keytrace: ignoring %s=%r (not a number)", name, environ[name])
                return default

        port = environ.get("KEYTRACE_METRICS_PORT", "").strip()
        return AlarmSettings(
            max_bytes=int(number("KEYTRACE_ALARM_MAX_BYTES", DEFAULT_MAX_BYTES)),
            interval=number("KEYTRACE_ALARM_INTERVAL", DEFAULT_INTERVAL),
            metrics_port=int(port) if port.isdigit() else None,
            metrics_addr=environ.get("KEYTRACE_METRICS_ADDR") or "0.0.0.0",
        )


_ALARMS: dict[str, Alarm] = {}
"""One alarm per geometry in this process: schedulers of one deployment (two engines in one
process, as in the harness) share it, so a key offered by one is ``other_engine`` for the
other, as in the offline differ."""
_ALARMS_LOCK = threading.Lock()


def alarm_for(header: Mapping[str, Any], settings: AlarmSettings) -> Alarm:
    """The process's alarm for this geometry (created on first use)."""

    geometry = json.dumps(
        {
            k: v
            for k, v in header.items()
            if k in ("groups", "tokens_per_hash", "retention_interval")
        },
        sort_keys=True,
    )
    with _ALARMS_LOCK:
        alarm = _ALARMS.get(geometry)
        if alarm is None:
            alarm = _ALARMS[geometry] = Alarm(
                header,
                max_bytes=settings.max_bytes,
                interval=settings.interval,
                warn=settings.warn,
                keep_judged=settings.keep_judged,
            )
        return alarm


def alarms() -> list[Alarm]:
    with _ALARMS_LOCK:
        return list(_ALARMS.values())


def live_totals() -> tuple[dict[str, int], int]:
    """Over every alarm of this process: episodes by verdict, and warnings raised."""
    counts: Counter[str] = Counter()
    warnings = 0
    for alarm in alarms():
        counts.update(alarm.counts())
        warnings += len(alarm.first)
    return dict(counts), warnings


_UNJUDGED_SAID: list[bool] = [False]
"""Whether this process said that an engine is not judged (`say_unjudged`)."""


def say_unjudged(gaps: tuple[str, ...]) -> None:
    """Once per process (until `forget_alarms`): the live alarm does not judge an engine
    whose configuration keytrace's rules do not describe."""
    with _ALARMS_LOCK:
        if _UNJUDGED_SAID[0]:
            return
        _UNJUDGED_SAID[0] = True
    log.warning(
        "keytrace: the live alarm does not judge this engine: keytrace has no rules for %s "
        "yet; recording goes on",
        "; ".join(gaps),
    )


def forget_alarms() -> None:
    """Drop every alarm (a new recording session starts from nothing)."""
    with _ALARMS_LOCK:
        _ALARMS.clear()
        _ENGINES.clear()
        _UNJUDGED_SAID[0] = False


_ENGINES: list[dict[str, Any]] = []
"""The headers of the engines this process has started (their hash identity settled)."""


def identity_at_startup(header: Mapping[str, Any], directory: str | None) -> str | None:
    """Once per engine, at its first lookup: does it hash differently from an engine it
    shares a tier with (`keytrace.judge.identity.disagreeing`)? The engines it can know of:
    those of this process, and those whose parts are already in its trace folder. Logs
    the finding once (a WARNING) and returns it, else None."""
    from keytrace.format.headers import folder_headers
    from keytrace.judge.identity import disagreeing

    with _ALARMS_LOCK:
        known = list(_ENGINES)
        _ENGINES.append(dict(header))
    found = disagreeing(header, known + folder_headers(directory))
    if found is None:
        return None
    message = f"keytrace: {found.text}"
    log.warning(message)
    return message
