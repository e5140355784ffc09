"""What runs inside a vLLM server: the plugin entry point, the one patch table and its
mechanism (`patches`), the recording observers (`hooks`), the trace header (`header`) and
feature detection (`compat`). Never imports the CPU lab (`keytrace.vllm.lab`); the
modifications it can apply (``KEYTRACE_INJECT``/``KEYTRACE_FIX``) come from
`keytrace.vllm.mods`."""
