"""Layer 6, reporters: render analysis results as text, JSON, pytest files, tables and plots.

Reporters write to a file object or path they are given; they import no vLLM and nothing
from ``keytrace.vllm``.
"""
