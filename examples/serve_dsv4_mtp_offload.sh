#!/usr/bin/env bash
# Record a DeepSeek-V4-Flash + MTP server with native CPU offload, then diff the trace.
#
# Needs a GPU host that can serve the model (this cannot run on a CPU-only machine; for a
# CPU-only run of the same scheduler code use `keytrace demo`). keytrace is a
# vllm.general_plugins entry point: installing it is enough, KEYTRACE_DIR switches it on.
set -euo pipefail

export KEYTRACE_DIR=${KEYTRACE_DIR:-/tmp/keytrace-dsv4}
# If you restrict plugins with VLLM_PLUGINS, keep keytrace in the list:
# export VLLM_PLUGINS=keytrace

vllm serve deepseek-ai/DeepSeek-V4-Flash \
    --tensor-parallel-size 2 \
    --kv-offloading-backend native \
    --kv-offloading-size 64 \
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT

# ... send traffic: e.g. a 17,975-token prompt, a different prompt to evict the GPU prefix
# cache (or POST /reset_prefix_cache), then the first prompt again ...

kill -TERM "$server"; wait "$server" || true   # SIGTERM flushes the last parts
keytrace summary "$KEYTRACE_DIR"
keytrace diff "$KEYTRACE_DIR"                  # exit 1 names the first group/key mismatch
