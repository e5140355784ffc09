"""Stands in for the GPU worker: acknowledges the connector's transfer jobs, moves no
bytes (`AckWorker`). The one piece of a scheduler step a CPU cannot run."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput


class AckWorker:
    """Stands in for the GPU worker: acknowledges transfer jobs, moves no bytes.

    Timing follows ``OffloadingConnectorWorker``: stores issued at step t are submitted at
    the start of step t+1 and reported complete in t+1's output (``store_delay`` 1; a
    larger delay models slow transfers, so later lookups see the keys HIT_PENDING);
    flushed jobs are waited for (complete at once); loads complete in the step they are
    issued, asynchronous ones (every load before 0.33.0) also report their request in
    ``finished_recving``.

    ``workers``: the engine's ranks (``parallel_config.world_size``, more than one under
    decode context parallelism); each job is reported done by every one of them in the
    same step, as ``OffloadingWorkerMetadata.aggregate`` sums their reports, and the
    scheduler completes it once the count reaches its ``num_workers``.
    """

    def __init__(self, store_delay: int = 1, workers: int = 1) -> None:
        self.store_delay = max(1, store_delay)
        self.workers = workers
        self.deferred_stores: list[tuple[int, int]] = []  # (job, steps left)
        self.acked: set[int] = set()
        self.stores_issued = 0
        self.loads_issued = 0

    def run(self, meta: OffloadingConnectorMetadata) -> KVConnectorOutput:
        completed: dict[int, int] = {}
        flush = set(meta.jobs_to_flush or ())
        waiting = []
        for job, left in self.deferred_stores:
            if left <= 1 or job in flush:
                completed[job] = 1
            else:
                waiting.append((job, left - 1))
        self.deferred_stores = waiting
        for job in meta.store_jobs:
            self.stores_issued += 1
            if job in flush:
                completed[job] = 1
            else:
                self.deferred_stores.append((job, self.store_delay))
        recving: set[str] = set()
        for job, entry in meta.load_jobs.items():
            self.loads_issued += 1
            completed[job] = 1
            if not is_sync(entry):
                recving.add(entry.req_id)
        completed = {j: self.workers for j in completed if j not in self.acked}
        self.acked.update(completed)
        return KVConnectorOutput(
            finished_sending=set(),
            finished_recving=recving,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed),
        )

    @property
    def idle(self) -> bool:
        return not self.deferred_stores


def is_sync(job: object) -> bool:
    """A load job the worker completes inside the step (``TransferJob.sync``, 0.33.0+);
    older releases have no such field and report every load in ``finished_recving``."""
    return bool(getattr(job, "sync", False))
