"""Modifications of vLLM's offload path: historical store bugs reintroduced (`inject`) and
candidate fixes (`fixes`), with the proof keys one fix adds (`proof`) and a vLLM-free
catalog of their names (`catalog`). Applied only through the patch table
(`keytrace.vllm.hook.patches`); never imports the hook or the lab."""
