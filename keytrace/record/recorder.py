"""The recorder: turns plain values from the hooks into trace rows. Imports no vLLM.

One `Recorder` per ``OffloadingConnectorScheduler`` instance (one per EngineCore process in
serving). It owns a `TraceWriter` and the context the manager calls lack on their own: the
current step, the current lookup episode and scan, and the job id of a store.

Every public method is called from inside a hook wrapper that has already run vLLM's own
code; the wrappers catch anything raised here (`Recorder.fail`), so vLLM never sees it.

Step numbering: ``step`` is the number of ``build_connector_meta`` calls this scheduler has
finished. Lookups and allocations made while scheduling engine step k, and the store rows
produced by that step's ``build_connector_meta``, carry ``step == k``; completions reported
after it carry ``k + 1``.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from keytrace.format.writer import TraceWriter

log = logging.getLogger("keytrace")

_SEQ = itertools.count()
"""One sequence shared by every recorder and kind in this process: total order of calls."""

_FAILURES_LOGGED: set[str] = set()
"""Where a failure was already logged in this process: one line per place, not per row or
per scheduler (a test suite builds thousands of schedulers)."""


class Recorder:
    """Builds rows for one scheduler instance. See the module docstring."""

    def __init__(
        self,
        directory: str,
        header: Mapping[str, Any],
        *,
        engine_id: str | None,
        dp_rank: int | None,
        tokens_per_chunk: Mapping[int, int],
        max_rows: int | None = None,
        max_seconds: float | None = None,
    ) -> None:
        kw: dict[str, Any] = {}
        if max_rows is not None:
            kw["max_rows"] = max_rows
        if max_seconds is not None:
            kw["max_seconds"] = max_seconds
        self.writer = TraceWriter(
            directory,
            header,
            engine_id=engine_id,
            dp_rank=dp_rank,
            tokens_per_chunk=tokens_per_chunk,
            **kw,
        )
        w = self.writer
        self._common_tail = (w.instance, w.instance_id, w.engine_id, w.dp_rank, w.pid)
        self.step = 0
        self.episode = -1
        self.scan = -1
        self.exact_scans = False
        self._last_lookup_gid: bytes | None = None
        self._pending_episode: dict[str, list[Any]] = {}
        self.failures = 0

    # ------------------------------------------------------------------ errors
    def fail(self, where: str, exc: BaseException) -> None:
        """Count a recorder failure; log it once per place and process. vLLM goes on untouched."""
        self.failures += 1
        if where not in _FAILURES_LOGGED:
            _FAILURES_LOGGED.add(where)
            log.warning(
                "keytrace: recording failed in %s (%s: %s); vLLM is unaffected, this row "
                "and later failures are dropped and counted",
                where,
                type(exc).__name__,
                exc,
            )

    # --------------------------------------------------------------- episodes
    def episode_begin(
        self,
        req_id: str,
        local_tokens: int,
        max_new_tokens: int | None,
        num_prompt_tokens: int,
        num_tokens: int,
        num_hashes: int,
    ) -> None:
        self.close_episode(req_id)
        self.episode = next(_SEQ)
        self.scan = -1
        self._last_lookup_gid = None
        self._pending_episode[req_id] = [
            self.episode,
            time.time_ns(),
            self.step,
            req_id,
            local_tokens,
            None,  # external
            None,  # load_async
            None,  # accepted
            num_prompt_tokens,
            num_tokens,
            num_hashes,
            max_new_tokens,
        ]

    def episode_end(self, req_id: str, external: int | None, load_async: bool | None) -> None:
        row = self._pending_episode.get(req_id)
        if row is not None:
            row[5] = external
            row[6] = load_async
            if not external:
                # Nothing will be allocated from the tier; the row is final now, except
                # that a 0 result can still be followed by an allocation of 0.
                row[7] = 0 if external == 0 else None
                self.close_episode(req_id)
        self.scan = -1

    def accepted(self, req_id: str, num_external_tokens: int) -> None:
        row = self._pending_episode.get(req_id)
        if row is not None and row[7] is None:
            row[7] = num_external_tokens
            self.close_episode(req_id)

    def close_episode(self, req_id: str) -> None:
        row = self._pending_episode.pop(req_id, None)
        if row is None:
            return
        episode, ts, step = row[0], row[1], row[2]
        self.writer.append("episode", 1, (episode, ts, *self._common_tail, step, episode, *row[3:]))

    def close_all_episodes(self) -> None:
        for req_id in list(self._pending_episode):
            self.close_episode(req_id)

    # ----------------------------------------------------------------- lookups
    def begin_scan(self) -> None:
        self.scan += 1

    def lookup(
        self, key: bytes, req_id: str, end_token: int | None, result: str, secondary: bool
    ) -> None:
        if not self.exact_scans:
            gid = key[-4:]
            if gid != self._last_lookup_gid:
                self._last_lookup_gid = gid
                self.scan += 1
        self.writer.append(
            "lookup",
            1,
            (
                next(_SEQ),
                time.time_ns(),
                *self._common_tail,
                self.step,
                self.episode,
                max(self.scan, 0),
                req_id,
                end_token,
                key,
                result,
                secondary,
            ),
        )

    # ------------------------------------------------------------------ stores
    def _keyed(
        self,
        kind: str,
        event: str,
        req_id: str | None,
        keys: Sequence[bytes],
        positions: Sequence[int | None],
        job_id: int | None = None,
    ) -> None:
        if not keys:
            return
        seq = next(_SEQ)
        ts = time.time_ns()
        if kind == "store":
            call: tuple[Any, ...] = (seq, ts, *self._common_tail, self.step, event, req_id, job_id)
        else:
            call = (seq, ts, *self._common_tail, self.step, event, req_id)
        self.writer.append(kind, len(keys), call, key=list(keys), end_token=list(positions))

    def store_prepared(
        self,
        req_id: str,
        offered: Sequence[bytes],
        positions: Mapping[bytes, int],
        keys_to_store: Iterable[bytes] | None,
        evicted: Sequence[bytes],
        job_id: int | None,
    ) -> None:
        """One ``prepare_store`` call: an outcome row per offered key, plus evictions."""
        pos = positions.get
        if evicted:
            self._keyed("store", "evicted", req_id, evicted, [pos(k) for k in evicted])
        if keys_to_store is None:
            self._keyed("store", "failed", req_id, offered, [pos(k) for k in offered])
            return
        chosen = (
            keys_to_store if isinstance(keys_to_store, (set, frozenset)) else set(keys_to_store)
        )
        if len(chosen) == len(offered):
            self._keyed("store", "prepared", req_id, offered, [pos(k) for k in offered], job_id)
            return
        prepared = [k for k in offered if k in chosen]
        rejected = [k for k in offered if k not in chosen]
        self._keyed("store", "prepared", req_id, prepared, [pos(k) for k in prepared], job_id)
        self._keyed("store", "rejected", req_id, rejected, [pos(k) for k in rejected])

    def store_completed(
        self,
        req_id: str,
        keys: Iterable[bytes],
        positions: Mapping[bytes, int],
        job_id: int | None,
        success: bool,
    ) -> None:
        ks = list(keys)
        pos = positions.get
        self._keyed(
            "store", "completed" if success else "failed", req_id, ks, [pos(k) for k in ks], job_id
        )

    def reset(self) -> None:
        """``manager.reset_cache()``: every stored key left the tier."""
        self.writer.append(
            "store",
            1,
            (next(_SEQ), time.time_ns(), *self._common_tail, self.step, "reset", None, None),
            key=[None],
            end_token=[None],
        )

    # ------------------------------------------------------------------- loads
    def load(
        self, event: str, req_id: str, keys: Iterable[bytes], positions: Mapping[bytes, int]
    ) -> None:
        ks = list(keys)
        pos = positions.get
        self._keyed("load", event, req_id, ks, [pos(k) for k in ks])

    # ------------------------------------------------------------------- steps
    def step_rows(
        self, rows: Iterable[tuple[str, int, int, int | None, int | None, bool, bool, bool]]
    ) -> None:
        """Per-request rows of one ``build_connector_meta`` call (pre-step values)."""
        ts = time.time_ns()
        for row in rows:
            self.writer.append("step", 1, (next(_SEQ), ts, *self._common_tail, self.step, *row))

    def end_step(self) -> None:
        self.step += 1

    def close(self) -> None:
        self.close_all_episodes()
        self.writer.close()


def env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw and raw.strip().isdigit() else None


def env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None
