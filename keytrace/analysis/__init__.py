"""Layer 4, analysis: pure functions of a trace (diff, replay plan, summary, geometry).

Returns data and never prints; imports no vLLM, no reporter and no CLI code. The rules it
judges by are `keytrace.judge`'s, evaluated here over polars columns.
"""
