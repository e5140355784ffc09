"""Live verdicts while serving: the write-only alarm and its Prometheus metrics.

A layer above `keytrace.analysis` (it judges with the same rules) and below the vLLM
adapter (which feeds it through the recorder). Imports neither vLLM nor polars: it runs in
every engine process that sets ``KEYTRACE_DIR`` or ``KEYTRACE_ALARM``.
"""
