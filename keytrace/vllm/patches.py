"""Every patch keytrace makes on vLLM, declared as data and applied in one place.

Class-level wraps (table `CLASS_PATCHES`) on ``OffloadingConnectorScheduler``: its
``__init__`` (creates a `Recorder` and instance-wraps the manager) and the public connector
methods that give episode, allocation, step, finish and reset context. Two private lookup
helpers are *optional* rows: they make scan boundaries exact and are skipped (with a debug
log) when absent.

The manager is wrapped per *instance* (`MANAGER_METHODS`), never at class level: tiering
managers alias ``prepare_write = self.prepare_store`` on their primary tier, and a class
patch would record tier promotions as stores.

Rules every wrapper follows: vLLM's own call runs first and its result or exception passes
through untouched; recording runs after it inside ``try`` and reports failures to
`Recorder.fail`; the recorder never calls manager methods.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from keytrace.record.recorder import Recorder, env_float, env_int

log = logging.getLogger("keytrace")

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True)
class ClassPatch:
    """Wrap ``OffloadingConnectorScheduler.<attr>`` with ``factory(original)``."""

    attr: str
    factory: Wrapper
    essential: bool = True


def _rec(sched: Any) -> Recorder | None:
    return sched.__dict__.get("_keytrace_recorder")


# --------------------------------------------------------------- class wrappers
def _wrap_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __init__(
        self: Any, spec: Any, vllm_config: Any, kv_cache_config: Any, *a: Any, **k: Any
    ) -> None:
        orig(self, spec, vllm_config, kv_cache_config, *a, **k)
        directory = _STATE.directory
        if directory is None:
            return
        try:
            from keytrace.vllm.header import build_header, engine_identity

            header = build_header(self, spec, vllm_config, kv_cache_config)
            engine_id, rank = engine_identity(vllm_config)
            rec = Recorder(
                directory,
                header,
                engine_id=engine_id,
                dp_rank=rank,
                tokens_per_chunk={
                    c.group_idx: c.tokens_per_chunk for c in self.config.kv_group_configs
                },
                max_rows=env_int("KEYTRACE_MAX_ROWS"),
                max_seconds=env_float("KEYTRACE_MAX_SECONDS"),
            )
            rec.exact_scans = _STATE.exact_scans
            _wrap_manager(self, rec)
            self.__dict__["_keytrace_recorder"] = rec
            _STATE.recorders.append(rec)
        except Exception as exc:
            _STATE.warn_once(
                f"keytrace: not recording this scheduler ({type(exc).__name__}: {exc})"
            )

    return __init__


def _wrap_episode(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def get_num_new_matched_tokens(
        self: Any,
        request: Any,
        num_computed_tokens: int,
        max_num_new_tokens: int | None = None,
        *a: Any,
        **k: Any,
    ) -> Any:
        rec = _rec(self)
        if rec is not None:
            try:
                rec.episode_begin(
                    request.request_id,
                    int(num_computed_tokens),
                    max_num_new_tokens,
                    int(request.num_prompt_tokens),
                    int(request.num_tokens),
                    len(request.block_hashes),
                )
            except Exception as exc:
                rec.fail("get_num_new_matched_tokens", exc)
        result = orig(self, request, num_computed_tokens, max_num_new_tokens, *a, **k)
        if rec is not None:
            try:
                rec.episode_end(request.request_id, result[0], result[1])
            except Exception as exc:
                rec.fail("get_num_new_matched_tokens", exc)
        return result

    return get_num_new_matched_tokens


def _wrap_alloc(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def update_state_after_alloc(
        self: Any, request: Any, blocks: Any, num_external_tokens: int, *a: Any, **k: Any
    ) -> Any:
        result = orig(self, request, blocks, num_external_tokens, *a, **k)
        rec = _rec(self)
        if rec is not None:
            try:
                rec.accepted(request.request_id, int(num_external_tokens))
            except Exception as exc:
                rec.fail("update_state_after_alloc", exc)
        return result

    return update_state_after_alloc


def _step_rows(sched: Any, out: Any) -> list[tuple[Any, ...]]:
    """Pre-step per-request values, read before vLLM mutates them in this call.

    One row per scheduled request, per finished request and per preempted request that
    was not scheduled: (req_id, computed, scheduled, prompt, num_tokens, finished,
    preempted, resumed).
    """
    statuses = sched._req_status
    preempted = set(out.preempted_req_ids or ())
    resumed = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", None) or ())

    def row(rid: str, scheduled: int, finished: bool) -> tuple[Any, ...]:
        st = statuses.get(rid)
        req = st.req if st is not None else None
        return (
            rid,
            int(req.num_computed_tokens) if req is not None else -1,
            scheduled,
            int(req.num_prompt_tokens) if req is not None else None,
            int(req.num_tokens) if req is not None else None,
            finished,
            rid in preempted,
            rid in resumed and not finished,
        )

    rows = [row(rid, int(n), False) for rid, n in out.num_scheduled_tokens.items()]
    rows += [row(rid, 0, True) for rid in out.finished_req_ids or ()]
    rows += [row(rid, 0, False) for rid in preempted - set(out.num_scheduled_tokens)]
    return rows


def _wrap_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def build_connector_meta(self: Any, scheduler_output: Any, *a: Any, **k: Any) -> Any:
        rec = _rec(self)
        if rec is not None:
            try:
                rec.step_rows(_step_rows(self, scheduler_output))
            except Exception as exc:
                rec.fail("build_connector_meta", exc)
        try:
            return orig(self, scheduler_output, *a, **k)
        finally:
            if rec is not None:
                rec.end_step()

    return build_connector_meta


def _wrap_finished(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def request_finished(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        result = orig(self, request, *a, **k)
        rec = _rec(self)
        if rec is not None:
            try:
                rec._close_episode(request.request_id)
            except Exception as exc:
                rec.fail("request_finished", exc)
        return result

    return request_finished


def _wrap_reset(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def reset_cache(self: Any, *a: Any, **k: Any) -> Any:
        result = orig(self, *a, **k)
        rec = _rec(self)
        if rec is not None:
            try:
                rec.writer.flush()
            except Exception as exc:
                rec.fail("reset_cache", exc)
        return result

    return reset_cache


def _wrap_scan(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Optional: one call of a per-group lookup helper is one scan."""

    @functools.wraps(orig)
    def scan(self: Any, *a: Any, **k: Any) -> Any:
        rec = _rec(self)
        if rec is not None:
            rec.begin_scan()
        return orig(self, *a, **k)

    return scan


CLASS_PATCHES: tuple[ClassPatch, ...] = (
    ClassPatch("__init__", _wrap_init),
    ClassPatch("get_num_new_matched_tokens", _wrap_episode),
    ClassPatch("update_state_after_alloc", _wrap_alloc),
    ClassPatch("build_connector_meta", _wrap_step),
    ClassPatch("request_finished", _wrap_finished),
    ClassPatch("reset_cache", _wrap_reset),
    ClassPatch("_maximal_prefix_lookup", _wrap_scan, essential=False),
    ClassPatch("_sliding_window_lookup", _wrap_scan, essential=False),
)

MANAGER_METHODS: tuple[str, ...] = (
    "lookup",
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "reset_cache",
)


# ------------------------------------------------------------- manager wrapping
def _positions(req_context: Any) -> dict[bytes, int]:
    pos = getattr(req_context, "_offload_key_positions", None)
    return pos if isinstance(pos, dict) else {}


def _wrap_manager(sched: Any, rec: Recorder) -> None:
    """Instance-wrap ``sched.manager``'s methods. See the module docstring for why."""
    m = sched.manager
    lookup, prepare_store, complete_store = m.lookup, m.prepare_store, m.complete_store
    prepare_load, complete_load, reset_cache = m.prepare_load, m.complete_load, m.reset_cache

    def rec_lookup(key: Any, req_context: Any, *a: Any, **k: Any) -> Any:
        result = lookup(key, req_context, *a, **k)
        try:
            rec.lookup(
                key,
                req_context.req_id,
                req_context.get_offload_key_position(key),
                result.name,
                bool(k) or bool(a),
            )
        except Exception as exc:
            rec.fail("manager.lookup", exc)
        return result

    def rec_prepare_store(keys: Any, req_context: Any, *a: Any, **k: Any) -> Any:
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        out = prepare_store(keys, req_context, *a, **k)
        try:
            if out is None:
                rec.store_prepared(
                    req_context.req_id, keys, _positions(req_context), None, (), None
                )
            else:
                job = sched._job_counter if out.keys_to_store else None
                rec.store_prepared(
                    req_context.req_id,
                    keys,
                    _positions(req_context),
                    out.keys_to_store,
                    out.evicted_keys or (),
                    job,
                )
        except Exception as exc:
            rec.fail("manager.prepare_store", exc)
        return out

    def rec_complete_store(keys: Any, req_context: Any, *a: Any, **k: Any) -> Any:
        result = complete_store(keys, req_context, *a, **k)
        try:
            success = k.get("success", a[0] if a else True)
            job = next((j for j, st in sched._jobs.items() if st.keys is keys), None)
            rec.store_completed(
                req_context.req_id, keys, _positions(req_context), job, bool(success)
            )
        except Exception as exc:
            rec.fail("manager.complete_store", exc)
        return result

    def rec_prepare_load(keys: Any, req_context: Any, *a: Any, **k: Any) -> Any:
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        out = prepare_load(keys, req_context, *a, **k)
        try:
            rec.load("prepared", req_context.req_id, keys, _positions(req_context))
        except Exception as exc:
            rec.fail("manager.prepare_load", exc)
        return out

    def rec_complete_load(keys: Any, req_context: Any, *a: Any, **k: Any) -> Any:
        result = complete_load(keys, req_context, *a, **k)
        try:
            rec.load("completed", req_context.req_id, keys, _positions(req_context))
        except Exception as exc:
            rec.fail("manager.complete_load", exc)
        return result

    def rec_reset_cache(*a: Any, **k: Any) -> Any:
        result = reset_cache(*a, **k)
        try:
            rec.reset()
        except Exception as exc:
            rec.fail("manager.reset_cache", exc)
        return result

    wrappers = {
        "lookup": rec_lookup,
        "prepare_store": rec_prepare_store,
        "complete_store": rec_complete_store,
        "prepare_load": rec_prepare_load,
        "complete_load": rec_complete_load,
        "reset_cache": rec_reset_cache,
    }
    assert tuple(wrappers) == MANAGER_METHODS
    for name, fn in wrappers.items():
        fn.__wrapped__ = getattr(m, name)  # type: ignore[attr-defined]
        setattr(m, name, fn)


# ---------------------------------------------------------------- installation
class _State:
    """Process-wide patch state: one installation at a time, guarded by a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stack: contextlib.ExitStack | None = None
        self.directory: str | None = None
        self.exact_scans = False
        self.recorders: list[Recorder] = []
        self._warned: set[str] = set()

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


_STATE = _State()


def installed() -> bool:
    return _STATE.stack is not None


def install(directory: str | os.PathLike[str]) -> bool:
    """Patch vLLM so every new OffloadingConnectorScheduler records under ``directory``.

    Idempotent. Returns False (one warning, nothing patched) if the installed vLLM lacks an
    essential hook point.
    """
    from keytrace.vllm.compat import SUPPORTED_VLLM, load_targets, vllm_version

    with _STATE.lock:
        if _STATE.stack is not None:
            _STATE.directory = os.fspath(directory)
            return True
        cls, _base, problems = load_targets()
        if cls is not None:
            problems += [
                f"{cls.__name__}.{p.attr}"
                for p in CLASS_PATCHES
                if p.essential and not hasattr(cls, p.attr)
            ]
        if problems:
            _STATE.warn_once(
                f"keytrace: installed vLLM {vllm_version()} lacks hook point(s) "
                f"{', '.join(problems)}; keytrace supports vllm=={SUPPORTED_VLLM}. "
                "Nothing is recorded and vLLM is left untouched."
            )
            return False
        stack = contextlib.ExitStack()
        optional_present = True
        for patch in CLASS_PATCHES:
            original = cls.__dict__.get(patch.attr)
            if original is None:
                optional_present = False
                log.debug(
                    "keytrace: optional hook %s.%s absent; scans are inferred",
                    cls.__name__,
                    patch.attr,
                )
                continue
            setattr(cls, patch.attr, patch.factory(original))
            stack.callback(setattr, cls, patch.attr, original)
        _STATE.exact_scans = optional_present
        _STATE.stack = stack
        _STATE.directory = os.fspath(directory)
        return True


def uninstall() -> None:
    """Undo every class patch and close every recorder (flushing its rows)."""
    with _STATE.lock:
        stack, _STATE.stack = _STATE.stack, None
        _STATE.directory = None
        recorders, _STATE.recorders = _STATE.recorders, []
    for rec in recorders:
        with contextlib.suppress(Exception):
            rec.close()
    if stack is not None:
        stack.close()


def recorders() -> list[Recorder]:
    return list(_STATE.recorders)


@contextlib.contextmanager
def recording(directory: str | os.PathLike[str]) -> Iterator[list[Recorder]]:
    """Record every scheduler built inside the block; flush and unpatch on exit.

    Yields the live list of recorders created so far (tests read their stats).
    """
    if not install(directory):
        raise RuntimeError("keytrace could not install its hooks on this vLLM")
    try:
        yield _STATE.recorders
    finally:
        uninstall()
