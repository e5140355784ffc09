"""A CPU-memory offloading spec for tests: vLLM's own `CPUOffloadingSpec` (its real
`CPUOffloadingManager`, the real connector on both sides), with only the transfer worker
replaced by one that copies between the CPU KV cache and the CPU tier, as a GPU's DMA
engine would between device and host memory.

vLLM refuses CPU offloading on a CPU platform in ``CPUOffloadingSpec.get_worker`` ("only
supported on CUDA-alike and XPU GPUs"): its worker drives CUDA streams and a copy kernel.
Nothing else about offloading depends on the platform, so this spec is what lets a real
``vllm serve`` on a CPU exercise the store and lookup paths keytrace records. Load it with
the connector's documented config::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
      "spec_module_path": "tests.serve.cpu_offload_spec", "cpu_bytes_to_use": ...}}'

Copies are synchronous and follow the layout vLLM's descriptors describe
(``gpu_worker.SingleDirectionOffloadingHandler``, direct layout): a chunk holds
``blocks_per_chunk`` device blocks; the first chunk of each group may start part-way, at
``block_index % blocks_per_chunk``; each layer reference copies its un-padded page.

`TieringCPUCopyOffloadingSpec` does the same for vLLM's tiered manager (``spec_name``
``TieringCPUCopyOffloadingSpec`` with ``secondary_tiers``), copying into the shared-memory
region the tiers read and write.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CPUCopyWorker(OffloadingWorker):
    """Store: device blocks -> CPU chunks; load: the reverse. Done when submitted."""

    def __init__(
        self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int, region: Any = None
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self.device: list[torch.Tensor] = []
        self.tier: list[torch.Tensor] = []
        self.region = region
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            self.device.append(t.tensor.view(torch.int8).view(-1, page))
            if region is None:
                tier = torch.zeros(num_chunks, blocks_per_chunk, page, dtype=torch.int8)
            else:  # this worker's slot of each chunk row of vLLM's shared region
                view = region.create_next_worker_view(blocks_per_chunk * page)
                tier = view.view(num_chunks, blocks_per_chunk, page)
            self.tier.append(tier)
        self.finished: list[TransferResult] = []

    def _slots(self, gpu_spec: Any, chunk_ids: Any) -> Iterator[tuple[int, int, int, int]]:
        """(group, device block, chunk, block within the chunk) for every device block."""
        bpc = self.blocks_per_chunk
        gpu_at = chunk_at = 0
        blocks = [int(b) for b in gpu_spec.block_ids]
        chunks = [int(c) for c in chunk_ids]
        for g, (size, first) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            size, skip = int(size), int(first) % bpc
            if size == 0:
                continue
            for i, block in enumerate(blocks[gpu_at : gpu_at + size]):
                pos = skip + i
                yield g, block, chunks[chunk_at + pos // bpc], pos % bpc
            gpu_at += size
            chunk_at += _cdiv(size + skip, bpc)
        assert gpu_at == len(blocks) and chunk_at == len(chunks)

    def _copy(self, job_id: int, gpu_spec: Any, cpu_spec: Any, store: bool) -> bool:
        moved = 0
        for g, block, chunk, sub in self._slots(gpu_spec, cpu_spec.block_ids):
            for ref in self.refs[g]:
                n = ref.page_size_bytes
                dev = self.device[ref.tensor_idx][block, :n]
                host = self.tier[ref.tensor_idx][chunk, sub, :n]
                (host if store else dev).copy_(dev if store else host)
                moved += n
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished when it was submitted


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """`CPUOffloadingSpec` with the copy worker above; manager and connector unchanged."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if not self._worker:
            self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


class TieringCPUCopyOffloadingSpec(TieringOffloadingSpec):
    """vLLM's `TieringOffloadingSpec` (its real tiered manager: a CPU primary tier in a
    shared-memory region over the configured secondary tiers, e.g. ``fs``), with the copy
    worker above writing into that region as vLLM's GPU worker does (``create_worker``: a
    `SharedOffloadRegion` joined by rank), so what the fs tier writes to disk and promotes
    back are the very bytes the worker stored and loads."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if not self._worker:
            from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = CPUCopyWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks, region=region
            )
        return self._worker
