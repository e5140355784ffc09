"""keytrace: record, diff and replay vLLM KV-offload OffloadKeys per KV-cache group.

Importing ``keytrace`` is cheap and never imports vLLM or torch; the vLLM-facing parts
(``keytrace.vllm.hook.plugin``, ``keytrace.vllm.lab.harness``, ``keytrace.replay``) import vLLM lazily.
"""

from keytrace._version import __version__

__all__ = ["__version__"]
