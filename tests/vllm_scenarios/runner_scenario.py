"""A scenario in vLLM's own test style: the offloading suite's ``RequestRunner`` (real
``Scheduler`` and ``OffloadingConnector`` scheduler side, its mock worker), with its mock
manager answering as a real ``CPUOffloadingManager``. Copied into a pytest run inside vLLM's
test tree by tests/integration/test_pytest_plugin.py and recorded there with
``pytest --keytrace``; the same prompts on keytrace's harness must diff alike.

Not collected by keytrace's own suite (no ``test_`` prefix in the file name)."""

import functools

import pytest
import torch
from tests.v1.kv_connector.unit.offloading_connector import utils
from tests.v1.kv_connector.unit.offloading_connector.utils import (
    RequestRunner,
    generate_store_output,
)
from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

# keytrace's SMALL geometry: full attention (block 64), a sliding-window group and an
# EAGLE/MTP sliding-window group (block 16, window 32)
GROUPS = [
    ("fa", FullAttentionSpec, 64, None, False),
    ("swa", SlidingWindowSpec, 16, 32, False),
    ("swa_mtp", SlidingWindowSpec, 16, 32, True),
]


def _groups():
    out = []
    for i, (name, cls, block_size, window, eagle) in enumerate(GROUPS):
        kw = dict(block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float16)
        if window is not None:
            kw["sliding_window"] = window
        out.append(KVCacheGroupSpec([f"layer.{i}.{name}"], cls(**kw), is_eagle_group=eagle))
    return out


def _answer_as(mock, real):
    """The runner's mock manager answers what ``real`` answers (store and load specs in the
    mock worker's form, which is all the worker reads)."""
    mock.lookup.side_effect = real.lookup

    def prepare_store(keys, req_context):
        out = real.prepare_store(keys, req_context)
        return None if out is None else generate_store_output(out.keys_to_store)

    mock.prepare_store.side_effect = prepare_store
    mock.complete_store.side_effect = real.complete_store
    load = mock.prepare_load  # the mock spec's lambda: the load spec the worker reads

    def prepare_load(keys, req_context):
        real.prepare_load(keys, req_context)
        return load(keys, req_context)

    mock.prepare_load = prepare_load
    mock.complete_load.side_effect = real.complete_load
    mock.touch.side_effect = real.touch


ALIGNMENT = 64
"""The cache-hit alignment EngineCore resolves for these groups after KV planning (the
lowest common multiple of their block sizes); RequestRunner leaves it unset."""


@pytest.mark.parametrize("num_tokens", [970, 1000])
def test_store_then_look_up_again(num_tokens, monkeypatch):
    # configured as an engine is: EngineCore's alignment, no prefix-cache retention interval
    engine_kv_config = functools.partial(KVCacheConfig, cache_hit_alignment_tokens=ALIGNMENT)
    monkeypatch.setattr(utils, "KVCacheConfig", engine_kv_config)
    runner = RequestRunner(
        block_size=16,
        num_gpu_blocks=400,
        async_scheduling=False,
        kv_cache_groups=_groups(),
        retention_interval=0,
    )
    _answer_as(runner.manager, CPUOffloadingManager(num_chunks=20_000))
    tokens = [(i * 7919) % 30_000 + 1 for i in range(num_tokens)]
    for _ in range(2):  # prime, then the same prompt after a GPU prefix-cache reset
        runner.new_request(token_ids=tokens)
        runner._run(decoded_tokens=[EOS_TOKEN_ID], complete_transfers=True)
        runner.completed_stores.clear()
        runner.completed_loads.clear()
        assert runner.scheduler.reset_prefix_cache()
