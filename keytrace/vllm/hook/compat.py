"""Feature detection for the vLLM internals keytrace hooks. Imports vLLM lazily.

keytrace records nothing rather than guess: if any essential hook point is missing, the
caller gets a list of what is missing and installs no patch at all.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
SCHEDULER_CLASS = "OffloadingConnectorScheduler"
BASE_MODULE = "vllm.v1.kv_offload.base"
CONFIG_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"
"""Where the offloading config is built (module functions; a candidate fix patches one)."""
TIERING_MODULE = "vllm.v1.kv_offload.tiering.manager"
TIERING_CLASS = "TieringOffloadingManager"
"""vLLM's tiered manager (a candidate fix patches its class; recording wraps instances)."""
CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
CPU_PLATFORM_CLASS = "CpuPlatform"
"""vLLM's CPU platform (the lab's own row wraps its config check; never in a server)."""


def config_module() -> Any:
    """The offloading config module, or None when this vLLM has none."""
    try:
        return importlib.import_module(CONFIG_MODULE)
    except Exception:
        return None


def tiering_class() -> Any:
    """``TieringOffloadingManager``, or None when this vLLM has no tiered offloading."""
    try:
        return getattr(importlib.import_module(TIERING_MODULE), TIERING_CLASS, None)
    except Exception:
        return None


def cpu_platform_class() -> Any:
    """``CpuPlatform``, or None when this vLLM has no CPU platform module."""
    try:
        return getattr(importlib.import_module(CPU_PLATFORM_MODULE), CPU_PLATFORM_CLASS, None)
    except Exception:
        return None


def load_targets() -> tuple[Any, Any, list[str]]:
    """Return (scheduler class, base module, problems). Problems empty means usable."""
    problems: list[str] = []
    try:
        import vllm
    except Exception as exc:  # vLLM absent or broken: nothing to hook
        return None, None, [f"vllm is not importable ({type(exc).__name__}: {exc})"]
    version = getattr(vllm, "__version__", "?")
    try:
        sched_mod = importlib.import_module(SCHEDULER_MODULE)
        base = importlib.import_module(BASE_MODULE)
    except Exception as exc:
        return None, None, [f"vllm {version} has no offloading scheduler ({exc})"]
    cls = getattr(sched_mod, SCHEDULER_CLASS, None)
    if cls is None:
        problems.append(f"{SCHEDULER_MODULE}.{SCHEDULER_CLASS} is missing")
    for name in ("make_offload_key", "LookupResult", "ReqContext", "OffloadingManager"):
        if not hasattr(base, name):
            problems.append(f"{BASE_MODULE}.{name} is missing")
    rc = getattr(base, "ReqContext", None)
    if rc is not None and not hasattr(rc, "get_offload_key_position"):
        # added in 0.31.0; keytrace reads each looked-up key's end token from it
        problems.append("ReqContext.get_offload_key_position (vLLM 0.31.0+) is missing")
    return cls, base, problems


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "?"


def resolve(owner: Any, attr: str) -> Any:
    """What ``owner.attr`` is, for the presence check and the wrap alike (None: absent).

    A class attribute is looked up statically along the MRO (an inherited method counts and
    descriptors are not triggered); an instance attribute dynamically, as vLLM will call it
    (a bound method, or a ``MagicMock`` child).
    """
    if isinstance(owner, type):
        return inspect.getattr_static(owner, attr, None)
    return getattr(owner, attr, None)
