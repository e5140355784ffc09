"""vLLM plugin entry point: ``KEYTRACE_DIR=/dir vllm serve ...`` records OffloadKeys.

vLLM calls `register` in every process it starts, possibly more than once. It returns at
once unless ``KEYTRACE_DIR`` is set, and importing this module imports neither vLLM nor
polars nor click, so an unset variable costs nothing. If ``VLLM_PLUGINS`` is set as an
allowlist it must include ``keytrace``. keytrace never changes vLLM's logging here.
"""

from __future__ import annotations

import logging
import os

ENV_DIR = "KEYTRACE_DIR"
ENV_ALARM = "KEYTRACE_ALARM"
_ON = ("1", "true", "yes", "on")

log = logging.getLogger("keytrace")


def register() -> None:
    """Install the recording hooks when ``KEYTRACE_DIR`` (record, with the live alarm unless
    ``KEYTRACE_ALARM=0``) or ``KEYTRACE_ALARM=1`` (the alarm alone) is set; otherwise do
    nothing."""
    directory = os.environ.get(ENV_DIR) or None
    if not directory and os.environ.get(ENV_ALARM, "").strip().lower() not in _ON:
        return
    try:
        from keytrace.live.registry import AlarmSettings
        from keytrace.vllm.hook.patches import announce, fix_from_env, inject_from_env, install

        alarm = AlarmSettings.from_env(os.environ, recording=directory is not None)
        inject_from_env()  # testing only: KEYTRACE_INJECT reintroduces a historical bug
        fix_from_env()  # testing only: KEYTRACE_FIX applies a candidate fix
        if install(directory, alarm):
            # said by the process that records (the engine core, when it builds its
            # scheduler), once: not by every process vLLM loads its plugins in
            announce(lambda: startup_line(directory, alarm))
    except Exception as exc:  # never break vLLM start-up
        log.warning(
            "keytrace: hooks not installed (%s: %s); vLLM is unaffected", type(exc).__name__, exc
        )


def startup_line(directory: str | None, alarm: object) -> str:
    """The one WARNING an operator sees in the engine log when keytrace is on (vLLM's
    logging shows WARNING, not keytrace's INFO): where, the disk cap, alarm, metrics, and
    whether this vLLM is a release keytrace's CI ran."""
    from keytrace.format.remote import shown
    from keytrace.format.writer import process_budget
    from keytrace.record.recorder import env_sample
    from keytrace.vllm.hook.support import vllm_info

    port = getattr(alarm, "metrics_port", None)
    sample = env_sample() if directory else None
    what = [
        f"cap {process_budget().max_bytes / (1 << 30):g} GiB" if directory else "no trace",
        *([f"sampling {sample:.4g} of prefix chains"] if sample is not None else []),
        "alarm on" if alarm is not None else "alarm off",
        f"metrics :{port}" if port else "no metrics",
    ]
    info = vllm_info()
    if not info.verified:
        what.append(f"vLLM {info.version} ({info.kind}): traces say vllm_verified false")
    where = f"recording offload keys to {shown(directory)}" if directory else "live alarm only"
    return f"keytrace: {where} ({', '.join(what)})"


__all__ = ["ENV_ALARM", "ENV_DIR", "register", "startup_line"]
