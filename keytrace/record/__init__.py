"""Layer 3, the recorder: plain values from the hooks in, trace rows out. Imports no vLLM.

This is what runs inside vLLM's scheduler; it must stay light (no polars, no click) because
the plugin loads it in every serving process that sets ``KEYTRACE_DIR``.
"""
