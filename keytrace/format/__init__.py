"""Layer 1, the trace format: Arrow schemas, the crash-safe part writer, the reader, compaction.

Imports nothing from the other keytrace layers, and never vLLM or torch.
"""
