"""The wrappers a patch row makes: observers around vLLM's calls (recording, the lab's
own), and replacements (an injected bug, a candidate fix).

An observer only watches: vLLM's call runs exactly as without keytrace, with the
arguments exactly as vLLM passed them, and an observer's failure is counted and logged
once (`keytrace.record.recorder.Recorder.fail`), never raised into vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keytrace.record.recorder import Recorder
from keytrace.vllm.hook import hooks
from keytrace.vllm.hook.layers import Binding, Wrapper

Observer = Callable[..., Any]
Direct = Callable[[Recorder, Any, str, Callable[..., Any], Observer], Callable[..., Any]]
"""A hot row's plain-function form: ``(rec, sched, where, wrapped, after) -> function``
called as vLLM calls the wrapped method, with `observe`'s contract (`observe_hot`)."""


def _observed(
    rec: Recorder,
    sched: Any,
    where: str,
    before: Observer | None,
    after: Observer | None,
    always: bool,
    wrapped: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The only place recording code runs around a vLLM call.

    vLLM's call runs exactly as it would without keytrace; ``before``/``after`` failures
    are counted and logged once (`Recorder.fail`) and never reach vLLM. With ``always``,
    ``after`` runs (with result None) even when vLLM's call raises.
    """
    if before is not None:
        try:
            before(rec, sched, args, kwargs)
        except Exception as exc:
            rec.fail(where, exc)
    if after is None:
        return wrapped(*args, **kwargs)
    result = None
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        if not always:
            raise
        _after(rec, sched, where, after, None, args, kwargs)
        raise
    _after(rec, sched, where, after, result, args, kwargs)
    return result


def _after(
    rec: Recorder,
    sched: Any,
    where: str,
    after: Observer,
    result: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    try:
        after(rec, sched, result, args, kwargs)
    except Exception as exc:
        rec.fail(where, exc)


def observe_hot(
    where: str, after: Observer, direct: Direct | None = None
) -> Callable[[Binding], Wrapper]:
    """`observe` for an instance row on the per-key hot path (``manager.lookup``, called
    once per chunk of every scan): the same semantics as ``observe(where, after=after)``
    without `_observed`'s and `_after`'s frames.

    With ``direct``, the wrapper also carries a plain-function form
    (``wrapper.direct(wrapped)``: ``direct(rec, sched, where, wrapped, after)``), which
    `keytrace.vllm.hook.layers` installs instead of a ``wrapt`` proxy where the wrapped
    attribute is a real bound method (never a test's ``MagicMock``, whose attribute reads
    and writes must reach the mock): a wrapt proxy and its generic wrapper cost about half
    of what recording adds to each of vLLM's per-key lookups (`tools/bench_recorder.py`)."""

    def make(binding: Binding) -> Wrapper:
        if binding is None:
            raise TypeError(f"{where}: observe_hot is for instance rows only")
        rec, sched = binding

        def hot(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            try:
                after(rec, sched, result, args, kwargs)
            except Exception as exc:
                rec.fail(where, exc)
            return result

        if direct is not None:
            hot.direct = lambda wrapped: direct(rec, sched, where, wrapped, after)  # type: ignore[attr-defined]
        return hot

    return make


def observe(
    where: str,
    *,
    before: Observer | None = None,
    after: Observer | None = None,
    always: bool = False,
) -> Callable[[Binding], Wrapper]:
    """A recording row's wrapper factory: ``before(rec, sched, args, kwargs)`` and
    ``after(rec, sched, result, args, kwargs)`` around vLLM's call (see `_observed`).

    Class rows find the recorder from the scheduler instance (unrecorded schedulers pass
    straight through); instance rows are bound to ``(recorder, scheduler)`` up front.
    """

    def make(binding: Binding) -> Wrapper:
        if binding is not None:
            rec, sched = binding

            def bound(
                wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                return _observed(rec, sched, where, before, after, always, wrapped, args, kwargs)

            return bound

        def unbound(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            rec = hooks.recorder_of(instance)
            if rec is None:
                return wrapped(*args, **kwargs)
            return _observed(rec, instance, where, before, after, always, wrapped, args, kwargs)

        return unbound

    return make


def observe_iter(
    where: str, over: Callable[[Recorder, Any, Any], Any]
) -> Callable[[Binding], Wrapper]:
    """An instance row whose observer hands vLLM's returned iterable on item by item:
    ``over(rec, at, result)`` is a generator yielding every item of ``result`` unchanged
    (it records as it goes; its own failures are counted, never raised)."""

    def make(binding: Binding) -> Wrapper:
        rec, at = binding

        def wrapper(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            result = wrapped(*args, **kwargs)
            try:
                return over(rec, at, result)
            except Exception as exc:
                rec.fail(where, exc)
                return result

        return wrapper

    return make


def replace(fn: Wrapper) -> Callable[[Binding], Wrapper]:
    """A row that replaces vLLM's function (an injection): the wrapper decides everything."""
    return lambda _binding: fn


def notify(method: str) -> Callable[[Binding], Wrapper]:
    """A harness row: after vLLM's call, ``binding.<method>(result, args, kwargs)``."""

    def make(binding: Binding) -> Wrapper:
        def wrapper(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            result = wrapped(*args, **kwargs)
            getattr(binding, method)(result, args, kwargs)
            return result

        return wrapper

    return make


def with_triton_seen(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The CPU lab's wrapper of ``CpuPlatform.check_and_update_config``: the check runs
    with ``vllm.triton_utils.HAS_TRITON`` true, and only while it runs.

    From vLLM 0.34.0 the check refuses every config on an x86 CPU without triton-cpu
    ("vLLM on x86 CPUs requires Triton (triton-cpu)"; a warning before). Triton compiles
    the model's kernels; the lab builds a scheduler, a connector and a manager and runs no
    kernel, so the refusal is not about anything the lab does. The check imports the flag
    from the ``vllm.triton_utils`` module at call time, reads it for that refusal alone and
    imports no module that could copy it (the row's source digests pin exactly that code,
    `keytrace.vllm.hook.support.REPLACED_SOURCES`), so the flag is put back as it was the
    moment the check returns or raises. Applied by the lab only
    (`keytrace.vllm.hook.patches.lab_platform`), never in a server: a server that lacks
    Triton must keep being refused."""
    import vllm.triton_utils as triton_utils

    saved = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        triton_utils.HAS_TRITON = saved
