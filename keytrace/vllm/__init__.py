"""Everything that imports vLLM: the plugin and its hooks, the patch table, injections, the
CPU harness, replay, the sweep runner and the demo.

Importing this package (or ``keytrace.vllm.hook.plugin``) does not import vLLM: vLLM loads the
plugin in every process it starts, and an unset ``KEYTRACE_DIR`` must cost nothing. The
modules that need vLLM import it themselves.

What works on the installed vLLM is decided by its code (`keytrace.vllm.hook.support`), not
by a version allowlist: a release or source build that passes every check of a capability
has it. ``keytrace doctor`` prints them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keytrace.errors import install_hint

if TYPE_CHECKING:
    from keytrace.vllm.hook.support import Capability

INSTALL_HINT = f"install it with: {install_hint('vllm')}"


def require_vllm(capability: str = "harness") -> None:
    """Raise `VllmUnavailableError` (exit 2, one line) unless the installed vLLM has
    ``capability`` (`keytrace.vllm.hook.support.CAPABILITIES`; the lab's commands need
    ``harness``). Every vLLM-driven entry point calls this first, so a missing or
    unsuitable vLLM is one clear line naming the failed check, never an ImportError
    traceback."""
    from keytrace.errors import VllmUnavailableError
    from keytrace.vllm.hook.support import vllm_info

    info = vllm_info()
    if info.version is None:
        raise VllmUnavailableError(
            f"this needs vLLM, which is not importable ({info.error}); {INSTALL_HINT}"
        )
    found = evaluate(capability)
    if not found.ok:
        raise VllmUnavailableError(
            f"keytrace's {capability} cannot run on vLLM {info.version} ({found.reason}); "
            "`keytrace doctor` lists every check"
        )


def evaluate(name: str) -> Capability:
    """Capability ``name`` on the installed vLLM: an in-server one
    (`keytrace.vllm.hook.support`) or the lab's ``harness`` (`keytrace.vllm.lab.checks`)."""
    if name == "harness":
        from keytrace.vllm.lab.checks import harness_capability

        return harness_capability()
    from keytrace.vllm.hook.patches import capability

    return capability(name)
