"""For ``tools/bench_serve.py`` only (on ``PYTHONPATH`` of the servers it starts, with
``KEYTRACE_BENCH_WAIT_METER`` naming a folder): counts the CPU time each process of the
server spends in vLLM's ``MessageQueue.dequeue``, in ``<folder>/<pid>`` (8 bytes, an
int64 of nanoseconds, rewritten on every call).

On a CPU server the engine core waits for its worker there by spinning on ``sched_yield``
for up to a second after each read: 73% of the engine-core process's CPU samples in a
py-spy profile, lasting as long as the worker computes. Its CPU time minus this is the work
the engine core does itself (vLLM's scheduler, keytrace's hooks and writer, and the
decoding of the worker's answers), which a wall clock on a shared machine cannot resolve.
The same in every mode of a run; never part of keytrace. The module is wrapped when vLLM
imports it (nothing of vLLM is imported here: every process of the server runs this)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import mmap
import os
import struct
import sys
import time
from typing import Any

TARGET = "vllm.distributed.device_communicators.shm_broadcast"


def _meter(module: Any, folder: str) -> None:
    cls = getattr(module, "MessageQueue", None)
    if cls is None or not hasattr(cls, "dequeue"):
        print("bench_wait_meter: no MessageQueue.dequeue in this vLLM", file=sys.stderr)
        return
    fd = os.open(os.path.join(folder, str(os.getpid())), os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8)
    cell = mmap.mmap(fd, 8)
    spent = [0]
    dequeue = cls.dequeue

    def metered(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return dequeue(self, *args, **kwargs)
        finally:
            spent[0] += time.thread_time_ns() - t0
            struct.pack_into("q", cell, 0, spent[0])

    cls.dequeue = metered


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        folder = self.folder

        def exec_module(module: Any) -> None:
            run(module)
            _meter(module, folder)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("KEYTRACE_BENCH_WAIT_METER"):
    sys.meta_path.insert(0, _WrapOnImport(os.environ["KEYTRACE_BENCH_WAIT_METER"]))
