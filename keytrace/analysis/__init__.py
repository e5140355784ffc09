"""Layer 3, analysis: pure functions of a trace (diff, replay plan, summary, geometry, rules).

Returns data and never prints; imports no vLLM, no reporter and no CLI code.
``rules`` holds vLLM 0.33.0's lookup/store arithmetic, once.
"""
