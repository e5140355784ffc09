"""What the CPU lab needs from the process environment, set in one place.

The lab drives vLLM's real scheduler on a machine that may have no GPU. vLLM reads two
settings from the environment before any lab code runs: which platform it is on (resolved
once, the first time anything imports ``vllm.config``) and whether the Hugging Face hub may
be asked about a model. A user who never heard of either must still get a working
``keytrace demo``, so the lab sets them itself (`LAB_ENVIRONMENT`):

- ``VLLM_TARGET_DEVICE=cpu``: without it vLLM infers its platform from the hardware; with
  no GPU it finds none ("Failed to infer device type") and, where it falls back to its
  unspecified platform, turns the hybrid KV-cache manager off, which every hybrid geometry
  of the lab needs. The lab runs no kernel, so the CPU platform serves on a GPU machine too.
- ``HF_HUB_OFFLINE=1``: the lab's model is a ``config.json`` it writes to a local folder; a
  lookup on the hub would only wait for network retries on a closed network.

`prepare` runs when the lab package is imported (``keytrace/vllm/lab/__init__.py``), so
every path into the lab has them before vLLM resolves its platform: a CLI command, a
``keytrace.vllm.lab`` module imported from Python, a tool, the tests. A value the user set
is never overridden (``VLLM_TARGET_DEVICE=cuda`` on a GPU machine stays cuda). Never
imported inside a server: the plugin (`keytrace.vllm.hook`) leaves vLLM's environment
alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

LAB_ENVIRONMENT: Mapping[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
}
"""Variable -> the value the lab uses when the user set none (the module docstring says
why each)."""


def prepare(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every `LAB_ENVIRONMENT` variable the user did not set; returns what it set."""
    env = os.environ if environ is None else environ
    added = {}
    for name, value in LAB_ENVIRONMENT.items():
        if name not in env:
            env[name] = value
            added[name] = value
    return added


def resolved_too_early() -> str | None:
    """Why the lab cannot run in this process, or None.

    vLLM resolves its platform once per process. If something resolved it before the lab
    set ``VLLM_TARGET_DEVICE`` (a program that imported and used vLLM before importing
    ``keytrace.vllm.lab``) and found no device, no setting can change it any more: say so
    in one line rather than fail deep inside vLLM's config."""
    platforms = sys.modules.get("vllm.platforms")
    platform = getattr(platforms, "_current_platform", None) if platforms else None
    if platform is None or getattr(platform, "device_type", "") not in ("", None):
        return None
    return (
        "vLLM resolved its platform before keytrace's lab could set VLLM_TARGET_DEVICE=cpu "
        "(it found no device: vLLM was imported and used first); set VLLM_TARGET_DEVICE=cpu, "
        "or import keytrace.vllm.lab before vLLM"
    )
