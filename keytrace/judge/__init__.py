"""Layer 2, the judgement: every rule keytrace judges by, written once.

``rules`` holds vLLM's lookup and store arithmetic (the lookup cap, load windows, the chunks
a lookup needs, the store path's boundaries), ``definitions`` keytrace's own (F, E, the
cause table, the binding scan, the terminal key, verdicts, shortfall tokens), both over
``ops``: plain values and polars expressions alike. The differ (`keytrace.analysis`)
evaluates them over columns, the recorder (`keytrace.record`) and the live alarm
(`keytrace.live`) over the values they keep, the hooks and reporters call them too.

Imports nothing but `keytrace.format` (and polars lazily, only for an expression): it runs
in every serving process that records.
"""
