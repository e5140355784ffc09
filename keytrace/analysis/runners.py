"""Who runs the differ's per-engine steps (`keytrace.analysis.partition`): this process, a
pool of local processes, or a Ray cluster. Each runner maps a top-level function over a
list of argument tuples, handing every call the same ``shared`` object (broadcast once to a
cluster) and returning the results in the order of the arguments, so the merged report is
the same bytes whoever ran it. Ray is imported only by `RayRunner` (``keytrace[ray]``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from keytrace.errors import UsageError, install_hint

DoneFn = Callable[[int], None]
"""Called with the index of each argument tuple whose call finished (for progress)."""


class Runner(Protocol):
    """Maps ``fn(*args, shared)`` over ``calls``; results in the order of ``calls``.
    ``partitions``: into how many sets of engines it would have a trace cut (enough to keep
    its workers busy; one: the whole trace at once, in this process)."""

    name: str
    partitions: int

    def map(
        self,
        fn: Callable[..., Any],
        calls: Sequence[tuple[Any, ...]],
        shared: Any,
        done: DoneFn | None = None,
    ) -> list[Any]: ...


class LocalRunner:
    """This process (``jobs=1``: polars already uses every core within each step) or a
    pool of ``jobs`` processes, each with its share of the cores (spawned: polars' thread
    pool does not survive a fork)."""

    def __init__(self, jobs: int = 1) -> None:
        if jobs < 1:
            raise UsageError(f"--jobs must be at least 1, not {jobs}")
        self.jobs = jobs
        self.name = "local" if jobs == 1 else f"{jobs} local processes"
        # polars uses every core within one query: one process judges the whole trace at
        # once; a pool gets a few partitions per process, so the last ones even out
        self.partitions = 1 if jobs == 1 else 2 * jobs

    def map(
        self,
        fn: Callable[..., Any],
        calls: Sequence[tuple[Any, ...]],
        shared: Any,
        done: DoneFn | None = None,
    ) -> list[Any]:
        if self.jobs == 1 or len(calls) <= 1:
            out = []
            for i, args in enumerate(calls):
                out.append(fn(*args, shared))
                if done is not None:
                    done(i)
            return out
        with _threads_each(max(1, (os.cpu_count() or 1) // self.jobs)):
            pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=min(self.jobs, len(calls)),
                mp_context=multiprocessing.get_context("spawn"),
            )
            with pool:
                futures = {pool.submit(fn, *args, shared): i for i, args in enumerate(calls)}
                results: dict[int, Any] = {}
                for f in concurrent.futures.as_completed(futures):
                    results[futures[f]] = f.result()
                    if done is not None:
                        done(futures[f])
        return [results[i] for i in range(len(calls))]


@contextlib.contextmanager
def _threads_each(n: int) -> Iterator[None]:
    """Worker processes started inside get ``n`` polars threads each (read at import)."""
    before = os.environ.get("POLARS_MAX_THREADS")
    os.environ["POLARS_MAX_THREADS"] = str(n)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("POLARS_MAX_THREADS", None)
        else:
            os.environ["POLARS_MAX_THREADS"] = before


class RayRunner:
    """Ray tasks on an existing cluster (``address``: as ``ray.init`` takes it; None: the
    cluster ``RAY_ADDRESS`` names, else a local one started here). ``shared`` is put in the
    object store once and every task reads it from there. A task whose worker dies is
    retried by Ray (``max_retries``); the steps are pure functions of the trace, so a
    retry returns the same result. ``before_each``: called first in every task (tests use
    it to kill a worker)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        max_retries: int = 3,
        before_each: Callable[[], None] | None = None,
        init_args: dict[str, Any] | None = None,
    ) -> None:
        try:
            import ray
        except ImportError as exc:
            raise UsageError(
                f"--ray needs Ray: {install_hint('ray')} (or pip install ray)"
            ) from exc
        self._ray = ray
        if not ray.is_initialized():
            try:
                ray.init(
                    address=address,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    **(init_args or {}),
                )
            except Exception as exc:  # Ray's own: ConnectionError, ValueError, RuntimeError
                where = address or "RAY_ADDRESS or a local cluster"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UsageError(f"cannot start or reach Ray ({where}): {first}") from exc
        self.name = f"Ray ({address or 'local'})"
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.partitions = 2 * max(1, cpus)
        self._max_retries = max_retries
        self._before_each = before_each

    def map(
        self,
        fn: Callable[..., Any],
        calls: Sequence[tuple[Any, ...]],
        shared: Any,
        done: DoneFn | None = None,
    ) -> list[Any]:
        ray = self._ray
        # one CPU per task, so one polars thread: Ray packs tasks by the CPUs they ask for,
        # and a polars pool of every core in each would oversubscribe the node
        task = ray.remote(
            num_cpus=1,
            max_retries=self._max_retries,
            retry_exceptions=False,
            runtime_env={"env_vars": {"POLARS_MAX_THREADS": "1"}},
        )(_call)
        ref = ray.put(shared)
        pending = {task.remote(fn, args, ref, self._before_each): i for i, args in enumerate(calls)}
        results: dict[int, Any] = {}
        waiting = list(pending)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            for r in ready:
                try:
                    results[pending[r]] = ray.get(r)
                except ray.exceptions.RayTaskError as exc:
                    # the task's own exception, not Ray's wrapper with its remote traceback:
                    # a trace problem stays one line (keytrace.errors)
                    raise exc.cause from None
                if done is not None:
                    done(pending[r])
        return [results[i] for i in range(len(calls))]


def _call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    shared: Any,
    before_each: Callable[[], None] | None,
) -> Any:
    """One Ray task: ``shared`` arrives resolved from the object store (a top-level
    argument)."""
    if before_each is not None:
        before_each()
    return fn(*args, shared)
