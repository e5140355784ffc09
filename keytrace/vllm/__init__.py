"""Everything that imports vLLM: the plugin and its hooks, the patch table, injections, the
CPU harness, replay, the sweep runner and the demo.

Importing this package (or ``keytrace.vllm.plugin``) does not import vLLM: vLLM loads the
plugin in every process it starts, and an unset ``KEYTRACE_DIR`` must cost nothing. The
modules that need vLLM import it themselves.
"""
