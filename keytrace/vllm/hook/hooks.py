"""What recording observes at each hook point: plain functions of (recorder, call).

Nothing here patches anything; `keytrace.vllm.hook.patches` owns the table that says where each
observer runs and the one mechanism that applies and undoes it. Every observer runs *after*
or *before* vLLM's own call, receives the call's arguments exactly as vLLM passed them, and
may raise: the single wrapper in `patches` catches it and reports it to `Recorder.fail`.

The recorder never calls manager methods and keeps no vLLM objects.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keytrace.format.schema import LookupResult, TierEvent
from keytrace.judge.rules import request_limits
from keytrace.judge.trust import uncovered
from keytrace.live.registry import AlarmSettings
from keytrace.record.events import DICT_GETTERS
from keytrace.record.recorder import Recorder, env_float, env_int, env_sample, next_seq
from keytrace.vllm.mods.catalog import PROOF_FIX

log = logging.getLogger("keytrace")

RECORDERS: weakref.WeakKeyDictionary[Any, Recorder] = weakref.WeakKeyDictionary()
"""Scheduler instance -> its `Recorder`. A weak map rather than an attribute on the
scheduler, so a recorded scheduler's ``vars()`` are exactly vLLM's."""


def recorder_of(sched: Any) -> Recorder | None:
    """The recorder of a scheduler instance, or None when it is not recorded."""
    try:
        return RECORDERS.get(sched)
    except TypeError:  # unhashable or not weak-referenceable: never recorded
        return None


def arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    """Positional-or-keyword argument ``name`` (``index`` counts from the first after self)."""
    if len(args) > index:
        return args[index]
    return kwargs[name]


# --------------------------------------------------------------- start-up
def is_stand_in(vllm_config: Any, kv_cache_config: Any) -> bool:
    """True when a scheduler is built from test stand-ins (SimpleNamespace configs).

    vLLM's own unit tests do this; such a scheduler is skipped quietly, because nothing
    about it describes a real deployment and its header cannot be built.
    """
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return not isinstance(vllm_config, VllmConfig) or not isinstance(kv_cache_config, KVCacheConfig)


def start_recording(
    sched: Any,
    directory: str | None,
    spec: Any,
    vllm_config: Any,
    kv_cache_config: Any,
    *,
    modified: Sequence[str],
    exact_scans: bool,
    alarm: AlarmSettings | None = None,
) -> Recorder:
    """Build the header and the `Recorder` for a freshly initialised scheduler (with the
    process's live alarm for its geometry when ``alarm`` is set, and its metrics endpoint)."""
    from keytrace.vllm.hook.header import build_header, engine_identity

    header = build_header(sched, spec, vllm_config, kv_cache_config, modified=modified)
    sample = env_sample()
    if sample is not None:
        header = {**header, "sample": sample}
    engine_id, rank = engine_identity(vllm_config)
    live = None
    if alarm is not None and unjudged_here(header):
        alarm = None  # recording goes on; the trace says the same when it is read
    if alarm is not None:
        from keytrace.live.metrics import serve_metrics
        from keytrace.live.registry import alarm_for

        live = alarm_for(header, alarm)
        serve_metrics(alarm, rank)
    rec = Recorder(
        directory,
        header,
        engine_id=engine_id,
        dp_rank=rank,
        tokens_per_chunk={c.group_idx: c.tokens_per_chunk for c in sched.config.kv_group_configs},
        max_rows=env_int("KEYTRACE_MAX_ROWS"),
        max_seconds=env_float("KEYTRACE_MAX_SECONDS"),
        idle_seconds=env_float("KEYTRACE_IDLE_SECONDS"),
        listener=live,
        sample=sample,
    )
    if rec.sampler is not None:
        rec.sampler.tiered = is_tiered(sched.manager)
    rec.exact_scans = exact_scans
    return rec


def unjudged_here(header: Mapping[str, Any]) -> bool:
    """This engine holds what keytrace's rules do not describe
    (`keytrace.judge.trust.uncovered`): the live alarm does not judge it (said once per
    process, at WARNING: `keytrace.live.registry.say_unjudged`) and recording goes on."""
    from keytrace.live.registry import say_unjudged

    gaps = uncovered(header)
    if gaps:
        say_unjudged(gaps)
    return bool(gaps)


# ------------------------------------------------------- scheduler methods
def episode_begin(rec: Recorder, sched: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """``get_num_new_matched_tokens(request, num_computed_tokens, max_num_new_tokens)``."""
    if not rec.identity_settled:
        settle_identity(rec)
    request = arg(args, kw, 0, "request")
    hashes = request.block_hashes
    first = bytes(hashes[0]) if rec.sampler is not None and hashes else None
    if not rec.start_episode(request.request_id, first):
        return  # (a chain the sampler left out: nothing more of the request is read)
    max_new = args[2] if len(args) > 2 else kw.get("max_num_new_tokens")
    spb = getattr(request, "shared_prefix_boundary", None)
    rec.open_episode(
        request.request_id,
        int(arg(args, kw, 1, "num_computed_tokens")),
        max_new,
        int(request.num_prompt_tokens),
        int(request.num_tokens),
        len(hashes),
        int(spb) if spb else None,
        {
            **request_limits(getattr(request, "kv_transfer_params", None)),
            "skip_reading_kv": skips_external_kv(request),
        },
    )


def settle_identity(rec: Recorder) -> None:
    """At a scheduler's first lookup (vLLM has drawn NONE_HASH by then): the engine's hash
    identity into the header its parts carry, and, with the live alarm on, the start-up
    check against the engines it can know of (`keytrace.live.registry.identity_at_startup`)."""
    from keytrace.vllm.hook.header import settle_hash_identity

    rec.identity_settled = True
    settle_hash_identity(rec.writer.header)
    if rec.listener is not None:
        from keytrace.live.registry import identity_at_startup

        directory = getattr(rec.writer, "directory", None)
        identity_at_startup(rec.writer.header, directory if isinstance(directory, str) else None)


def skips_external_kv(request: Any) -> bool:
    """The request asked not to read external KV, which the offloading connector honours
    by answering 0 without a lookup: ``skip_reading_external_kv`` (vLLM 0.34.0: a prefix
    cache hit limit is set) or ``skip_reading_prefix_cache`` (0.33.0: the sampling or
    pooling params' flag). Only a real True counts."""
    for name in ("skip_reading_external_kv", "skip_reading_prefix_cache"):
        if hasattr(type(request), name) or name in getattr(request, "__dict__", {}):
            return getattr(request, name, False) is True
    return False


def episode_end(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    request = arg(args, kw, 0, "request")
    rec.end_scan()
    if rec.unfollowed == request.request_id:  # (a chain the sampler left out)
        rec.episode_end(request.request_id, result[0], result[1])
        return
    try:
        record_unqueried(rec, sched, request)
        record_withheld(rec, sched, request)
    finally:
        spb = getattr(request, "shared_prefix_boundary", None)
        rec.episode_end(request.request_id, result[0], result[1], int(spb) if spb else None)


def _key_of(sched: Any, request: Any) -> Callable[[int, int], bytes | None] | None:
    """Group id, chunk -> the request's own offload key there, read from vLLM's
    per-request, per-group key lists (read only, no manager call); None before vLLM made
    the request's state."""
    status = sched._req_status.get(request.request_id)
    if status is None:
        return None
    configs = {c.group_idx: i for i, c in enumerate(sched.config.kv_group_configs)}

    def key_of(gid: int, chunk: int) -> bytes | None:
        at = configs.get(gid)
        if at is None:
            return None
        keys = status.group_states[at].offload_keys
        return bytes(keys[chunk]) if chunk < len(keys) else None

    return key_of


def record_withheld(rec: Recorder, sched: Any, request: Any) -> None:
    """The chunks the request's ``max_offload_tokens`` keeps from the store path
    (`Recorder.withhold`), keyed from its own key lists."""
    key_of = _key_of(sched, request)
    if key_of is not None:
        rec.withhold(request.request_id, key_of)


def record_unqueried(rec: Recorder, sched: Any, request: Any) -> None:
    """The keys the episode needs that vLLM did not look up (`Recorder.list_needed`),
    read from vLLM's own per-request, per-group key lists (read only, no manager call);
    under the candidate fix ``eagle_proof_key``, the proof keys for the same hits."""
    key_of = _key_of(sched, request)
    if key_of is None:
        return
    ends = rec.list_needed(request.request_id, key_of)
    if ends and f"fix:{PROOF_FIX}" in (rec.writer.header.get("vllm_modified") or ()):
        tph = int(rec.writer.header.get("tokens_per_hash") or 1)
        record_proofs(rec, sched, request, ends, len(request.block_hashes) * tph)


def record_proofs(rec: Recorder, sched: Any, request: Any, hits: Sequence[int], keyed: int) -> None:
    """Under the candidate fix ``eagle_proof_key``: the proof key of each EAGLE peek chunk a
    hit at one of ``hits`` would query, including the one just past the keyed chunks that
    only its proof keys (``keytrace.vllm.mods.fixes``; the same function the fix looks up with)."""
    from keytrace.vllm.mods import proof

    for g in proof.proof_groups(sched).values():
        tpc = g.tokens_per_chunk
        chunks = sorted(
            {end // tpc for end in hits if end % tpc == 0 and end // tpc <= keyed // tpc}
        )
        proven = [
            (c, key)
            for c in chunks
            if (key := proof.peek_proof_key(sched, request, g, c)) is not None
        ]
        if proven:
            rec.proofs(
                request.request_id,
                g.group_idx,
                [(c + 1) * tpc for c, _ in proven],
                [bytes(key) for _, key in proven],
            )


def accepted(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``update_state_after_alloc(request, blocks, num_external_tokens)``."""
    request = arg(args, kw, 0, "request")
    rec.accepted(request.request_id, int(arg(args, kw, 2, "num_external_tokens")))


def step_rows(
    sched: Any, out: Any, keep: Callable[[str], bool] | None = None
) -> list[tuple[Any, ...]]:
    """Pre-step per-request values, read before vLLM mutates them in this call.

    One row per scheduled request, per finished request and per preempted request that
    was not scheduled: (req_id, computed, scheduled, prompt, num_tokens, finished,
    preempted, resumed). ``keep``: the requests whose rows are recorded (the sampler's
    decision; None: all), so a request the sampler left out costs no row built.
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

    scheduled = out.num_scheduled_tokens
    finished = out.finished_req_ids or ()
    idle: Iterable[str] = preempted - set(scheduled)
    if keep is not None:  # (the rows of the requests kept, before any is built)
        scheduled = {rid: n for rid, n in scheduled.items() if keep(rid)}
        finished = [rid for rid in finished if keep(rid)]
        idle = [rid for rid in idle if keep(rid)]  # (in the set's own order)
    rows = [row(rid, int(n), False) for rid, n in scheduled.items()]
    rows += [row(rid, 0, True) for rid in finished]
    return rows + [row(rid, 0, False) for rid in idle]


def step_begin(rec: Recorder, sched: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """``build_connector_meta(scheduler_output)``, before vLLM runs it."""
    keep = rec.sampler.request if rec.sampler is not None else None
    rec.step_rows(step_rows(sched, arg(args, kw, 0, "scheduler_output"), keep))


def step_end(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    rec.end_step()


def request_finished(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    rec.request_finished(arg(args, kw, 0, "request").request_id)


def flush(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``reset_cache()``: a natural checkpoint; write what is buffered."""
    rec.writer.flush()


def scan_begin(rec: Recorder, sched: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """One call of a per-group lookup helper is one scan."""
    rec.begin_scan()


# --------------------------------------------------------- manager methods
def positions(req_context: Any) -> dict[bytes, int]:
    """The scheduler's key -> end-token map on the request context (read, never copied)."""
    pos = getattr(req_context, "_offload_key_positions", None)
    return pos if isinstance(pos, dict) else {}


def _keys(value: Any) -> Sequence[bytes]:
    """The keys argument as vLLM passed it. Only sequences are read: an iterator would be
    consumed by the manager, and keytrace never changes what the manager receives."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"keys passed as {type(value).__name__}, not a sequence; not recorded")
    return value


def lookup(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``manager.lookup(key, req_context, **kw)``; extra arguments mark a secondary tier."""
    if len(args) == 2 and not kw:  # the scheduler's own call: the hot path
        key, ctx = args
        name = _RESULT_BY_ID.get(id(result)) or _result_name(result)
        rec.lookup(key, ctx.req_id, ctx.get_offload_key_position, name)
        return
    key, ctx = arg(args, kw, 0, "key"), arg(args, kw, 1, "req_context")
    if "exclude_tier_idx" in kw:  # a tier's peer, through its parent: not a scan
        rec.tier_event(
            TierEvent.PEER_LOOKUP,
            ctx.req_id,
            kw["exclude_tier_idx"],
            [key],
            positions(ctx),
            result=_result_name(result),
        )
        return
    secondary = len(args) > 2 or any(k not in ("key", "req_context") for k in kw)
    rec.lookup(key, ctx.req_id, ctx.get_offload_key_position, _result_name(result), secondary)


def lookup_direct(
    rec: Recorder, sched: Any, where: str, wrapped: Callable[..., Any], after: Any
) -> Callable[..., Any]:
    """`lookup` as the plain function `keytrace.vllm.hook.layers` installs on a real
    manager (`keytrace.vllm.hook.wrappers.observe_hot`): vLLM's call with its arguments as
    given, then, for the scheduler's own ``lookup(key, req_context)``, the recorder's
    append inline; any other call goes to ``after`` (`lookup`). An observer failure is
    counted (`Recorder.fail`), a vLLM exception propagates with nothing recorded."""
    record, fail, by_id = rec.lookup, rec.fail, _RESULT_BY_ID
    register_key_positions()
    if _takes_key_and_context(wrapped):
        # the CPU manager's signature: a two-argument function, no argument packing (a
        # ``*args, **kwargs`` closure builds a tuple and a dict per call, and calls vLLM
        # through CALL_FUNCTION_EX: about a third of the row's own cost per key)

        def lookup_pair(key: Any, req_context: Any) -> Any:
            result = wrapped(key, req_context)
            try:
                sc = rec.open_scan
                if (
                    sc is not None
                    and sc.appendable
                    and sc.req_id == req_context.req_id
                    and key[-4:] == sc.gid_bytes
                ):
                    # the call continues the open scan: `Recorder.lookup`'s three appends,
                    # here (a second Python frame per key was a fifth of the row's cost)
                    sc.seqs.append(next_seq())
                    sc.keys.append(key)
                    sc.results.append(by_id.get(id(result)) or _result_name(result))
                elif req_context.req_id != rec.unfollowed:
                    # (a request the sampler left out: `Recorder.lookup` would return at
                    # once; with sampling on that is most keys, and no frame is spent)
                    name = by_id.get(id(result)) or _result_name(result)
                    record(key, req_context.req_id, req_context.get_offload_key_position, name)
            except Exception as exc:
                fail(where, exc)
            return result

        return lookup_pair

    def lookup_call(*args: Any, **kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            if len(args) == 2 and not kwargs:
                key, ctx = args
                name = by_id.get(id(result)) or _result_name(result)
                record(key, ctx.req_id, ctx.get_offload_key_position, name)
            else:
                after(rec, sched, result, args, kwargs)
        except Exception as exc:
            fail(where, exc)
        return result

    return lookup_call


def _positions_reference(self: Any, key: Any) -> Any:
    return self._offload_key_positions.get(key)


def register_dict_getter(fn: Any, attr: str, reference: Callable[..., Any]) -> bool:
    """Register ``fn`` in `keytrace.record.events.DICT_GETTERS` as a read of ``self.<attr>``
    when its code is ``reference``'s (the same bytecode, constants and names, two
    positional parameters, no packing), compiled here by the same interpreter. A vLLM that
    changes the method in any way keeps its own method. Whether it was registered."""
    code, ref = getattr(fn, "__code__", None), reference.__code__
    packing = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    same = (
        code is not None
        and code.co_code == ref.co_code
        and code.co_consts == ref.co_consts
        and code.co_names == ref.co_names
        and code.co_argcount == ref.co_argcount == 2
        and code.co_kwonlyargcount == 0
        and not code.co_flags & packing
    )
    if same:
        DICT_GETTERS[fn] = attr
    return same


def register_key_positions() -> bool:
    """vLLM's ``ReqContext.get_offload_key_position`` is ``return
    self._offload_key_positions.get(key)`` (0.31.0 to 0.34.0): a scan closing reads its
    end tokens from that dict directly (`keytrace.record.events.direct_getter`)."""
    try:
        from vllm.v1.kv_offload.base import ReqContext
    except Exception:  # another layout: every key through vLLM's own method
        return False
    fn = getattr(ReqContext, "get_offload_key_position", None)
    return register_dict_getter(fn, "_offload_key_positions", _positions_reference)


def _takes_key_and_context(fn: Callable[..., Any]) -> bool:
    """``fn``'s parameters are exactly ``(key, req_context)``, each positional or keyword
    with no default: a function of that signature receives every call ``fn`` accepts."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return [p.name for p in params] == ["key", "req_context"] and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params
    )


_RESULT_NAMES: dict[Any, LookupResult] = {}
"""vLLM's ``LookupResult`` members -> keytrace's (`keytrace.format.schema.LookupResult`)."""
_RESULT_BY_ID: dict[int, LookupResult] = {}
"""The same by the member's ``id``, for the per-key hot path: hashing an ``Enum`` member
runs ``Enum.__hash__`` in Python (a third of the lookup hook's own instructions). The
members stay alive as `_RESULT_NAMES`' keys, so an id here never names another object."""


def prepare_store(
    rec: Recorder, sched: Any, out: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    keys, ctx = _keys(arg(args, kw, 0, "keys")), arg(args, kw, 1, "req_context")
    if out is None:
        rec.store_prepared(ctx.req_id, keys, positions(ctx), None, (), None)
        return
    job = sched._job_counter if out.keys_to_store else None
    rec.store_prepared(
        ctx.req_id,
        keys,
        positions(ctx),
        out.keys_to_store,
        out.evicted_keys or (),
        job,
        filtered_keys(getattr(sched, "manager", None), keys, out.keys_to_store)
        if rec.follows(ctx.req_id)
        else (),  # (a chain the sampler left out: its filtered keys are not kept)
    )


def filtered_keys(manager: Any, offered: Sequence[bytes], stored: Any) -> list[bytes]:
    """Of the keys ``prepare_store`` declined, those its ``store_threshold`` filtered (vLLM's
    ``CPUOffloadingManager``: ``counts`` is None when the filter is off): not stored and
    not held by the cache (``_policy.get``, a plain dict read, is None), so not declined
    for being present. Read after the call: the call counted this offer already."""
    counts = getattr(manager, "counts", None)
    policy = getattr(manager, "_policy", None)
    if counts is None or policy is None or len(stored) == len(offered):
        return []
    chosen = set(stored)
    return [k for k in offered if k not in chosen and policy.get(k) is None]


def complete_store(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    keys, ctx = arg(args, kw, 0, "keys"), arg(args, kw, 1, "req_context")
    if not rec.follows(ctx.req_id):
        return  # (a chain the sampler left out: nothing of a completion is kept)
    success = args[2] if len(args) > 2 else kw.get("success", True)
    job = next((j for j, st in sched._jobs.items() if st.keys is keys), None)
    rec.store_completed(ctx.req_id, keys, positions(ctx), job, bool(success))


def prepare_load(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    keys, ctx = _keys(arg(args, kw, 0, "keys")), arg(args, kw, 1, "req_context")
    rec.load("prepared", ctx.req_id, keys, positions(ctx))


def complete_load(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    keys, ctx = arg(args, kw, 0, "keys"), arg(args, kw, 1, "req_context")
    rec.load("completed", ctx.req_id, keys, positions(ctx))


def reset(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    rec.reset()


# ------------------------------------------------------------ tiered managers
# A TieringOffloadingManager (vLLM 0.33.0, v1/kv_offload/tiering/manager.py) over a CPU
# primary tier and secondary tiers. Its public methods are recorded like any manager's;
# these observe what it does below them: the primary's promotion aliases (prepare_write /
# complete_write, bound per instance), each secondary tier's lookups and write-through jobs,
# back-pressure drops and the promotion hold after a reset. All run under vLLM's manager
# lock (the scheduler's or the tier-poll thread's), so the recorder's tier context is never
# entered concurrently; `Recorder.tier_event` itself is safe from any thread.


@dataclass
class TieringContext:
    """What the tiered-manager observers carry between the calls they watch (a hook's
    own state, kept beside its recorder, never on it)."""

    promoting: int | None = None
    """The secondary tier a promotion in progress reads from (``_initiate_promotion``)."""
    promoted_from: dict[bytes, tuple[int | None, str]] = field(default_factory=dict)
    """Promoted keys not yet completed -> the tier they come from and the request whose
    lookup promotes them."""
    storing: tuple[Sequence[bytes], Any] | None = None
    """(keys, request context) of the ``complete_store`` call in progress: what a
    write-through that back-pressure drops would have written."""
    cascades: dict[int, tuple[str | None, int, list[bytes], Mapping[bytes, int]]] = field(
        default_factory=dict
    )
    """Write-through jobs in flight: job id -> (request, tier, keys, positions)."""
    settling: tuple[Any, int, int] | None = None
    """(request context, tier, job id) of the promotion whose result is being applied
    (``_complete_promotion``): what a deferred release inside it belongs to."""
    held: dict[int, tuple[str | None, int | None, int | None, bytes]] = field(default_factory=dict)
    """Primary chunks a failed promotion still holds (a deferred release, vLLM 0.34.0):
    chunk id -> (request, tier, promotion job, the key that left the cache)."""


_TIERING: weakref.WeakKeyDictionary[Recorder, TieringContext] = weakref.WeakKeyDictionary()


def tiering(rec: Recorder) -> TieringContext:
    """The tiered-manager observers' context of a recorded scheduler."""
    ctx = _TIERING.get(rec)
    if ctx is None:
        ctx = _TIERING[rec] = TieringContext()
    return ctx


def is_tiered(manager: Any) -> bool:
    """A tiered manager: a primary tier and a list of secondary tiers."""
    return hasattr(manager, "primary_tier") and isinstance(
        getattr(manager, "secondary_tiers", None), list
    )


def _tier_index(sched: Any, tier: Any) -> int | None:
    for i, t in enumerate(getattr(sched.manager, "secondary_tiers", None) or ()):
        if t is tier:
            return i
    return None


def _result_name(result: Any) -> LookupResult:
    name = _RESULT_NAMES.get(result)
    if name is None:
        name = _RESULT_NAMES[result] = LookupResult(result.name)
        _RESULT_BY_ID[id(result)] = name
    return name


def promotion_begin(rec: Recorder, sched: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """``_initiate_promotion(tier_idx, key, req_context)``: the tier it promotes from."""
    tiering(rec).promoting = int(arg(args, kw, 0, "tier_idx"))


def promotion_end(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    tiering(rec).promoting = None


def prepare_write(
    rec: Recorder, sched: Any, out: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """The primary's ``prepare_write(keys, req_context)`` (its ``prepare_store``, for a
    promotion): a slot taken (and what it evicted), or none free."""
    keys, ctx = _keys(arg(args, kw, 0, "keys")), arg(args, kw, 1, "req_context")
    here = tiering(rec)
    pos, tier = positions(ctx), here.promoting
    if out is None:
        rec.tier_event(TierEvent.PROMOTION_NO_ROOM, ctx.req_id, tier, keys, pos)
        return
    taken = list(out.keys_to_store)
    for k in taken:
        here.promoted_from[k] = (tier, ctx.req_id)
    rec.tier_event(TierEvent.PROMOTION_PREPARED, ctx.req_id, tier, taken, pos)
    evicted = list(out.evicted_keys or ())
    if evicted:
        rec.evicted_by_promotion(ctx.req_id, tier, evicted, pos)


def complete_write(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """The primary's ``complete_write(keys, req_context, success)``: a promotion landed."""
    keys, ctx = list(arg(args, kw, 0, "keys")), arg(args, kw, 1, "req_context")
    success = args[2] if len(args) > 2 else kw.get("success", True)
    by_tier: dict[int | None, list[bytes]] = {}
    for k in keys:
        by_tier.setdefault(tiering(rec).promoted_from.pop(k, (None, ""))[0], []).append(k)
    event = TierEvent.PROMOTION_COMPLETED if success else TierEvent.PROMOTION_FAILED
    for tier, ks in by_tier.items():
        rec.tier_event(event, ctx.req_id, tier, ks, positions(ctx))


def promotion_settling(
    rec: Recorder, sched: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``_complete_promotion(job_metadata, completed_job)``: whose promotion a deferred
    release in it fails (``defer_write_release`` is told only the keys)."""
    meta, done = arg(args, kw, 0, "job_metadata"), arg(args, kw, 1, "completed_job")
    ctx = meta.transfer_job.req_context
    tiering(rec).settling = (ctx, int(meta.tier_idx), int(done.job_id))


def promotion_settled(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    tiering(rec).settling = None


def defer_release(
    rec: Recorder, sched: Any, chunk_ids: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """The primary's ``defer_write_release(keys)`` (vLLM 0.34.0): a promotion failed while
    its tier may still write into the keys' chunks. The keys leave the cache at once (as
    ``complete_write(False)``) but their chunks stay out of the free pool until the tier
    says so (`deferred_released`)."""
    keys = list(arg(args, kw, 0, "keys"))
    here = tiering(rec)
    ctx, tier, job_id = here.settling or (None, None, None)
    req_id = None if ctx is None else ctx.req_id
    for k in keys:  # (the promotion's own record, should the settling call go unseen)
        from_tier, from_req = here.promoted_from.pop(k, (None, None))
        tier = from_tier if tier is None else tier
        req_id = from_req if req_id is None else req_id
    for chunk_id, k in zip(chunk_ids or (), keys, strict=False):
        here.held[int(chunk_id)] = (req_id, tier, job_id, k)
    pos = positions(ctx) if ctx is not None else None
    rec.tier_event(TierEvent.PROMOTION_DEFERRED, req_id, tier, keys, pos, job_id=job_id)


def release_deferred(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """The primary's ``release_deferred_write(chunk_ids)``: the tier can no longer write
    the chunks of a failed promotion, and they are free again."""
    here = tiering(rec)
    freed: dict[tuple[str | None, int | None, int | None], list[bytes]] = {}
    for chunk_id in arg(args, kw, 0, "chunk_ids"):
        held = here.held.pop(int(chunk_id), None)
        if held is not None:
            freed.setdefault(held[:3], []).append(held[3])
    for (req_id, tier, job_id), keys in freed.items():
        rec.tier_event(TierEvent.DEFERRED_RELEASED, req_id, tier, keys, job_id=job_id)


def store_begin(rec: Recorder, sched: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """``complete_store(keys, req_context, success)`` of a tiered manager: what its
    write-through would write (read if back-pressure drops it)."""
    tiering(rec).storing = (arg(args, kw, 0, "keys"), arg(args, kw, 1, "req_context"))


def store_end(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    tiering(rec).storing = None


def backpressure(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``_should_store_to_tier(tier, num_blocks)`` said no: the write-through is dropped."""
    if result is not False:
        return
    tier = _tier_index(sched, arg(args, kw, 0, "tier"))
    storing = tiering(rec).storing
    keys, ctx = storing if storing is not None else ((), None)
    req = ctx.req_id if ctx is not None else None
    rec.tier_event(
        TierEvent.CASCADE_DROPPED, req, tier, list(keys), positions(ctx) if ctx else None
    )


def reset_tiers(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """After a tiered manager's ``reset_cache``: promotions are held until released."""
    if getattr(sched.manager, "_promotions_held", False):
        rec.tier_event(TierEvent.PROMOTIONS_HELD, None, None, [])


def reset_flushed(
    rec: Recorder, sched: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    rec.tier_event(TierEvent.PROMOTIONS_RELEASED, None, None, [])


def tier_lookup(
    rec: Recorder, at: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """A secondary tier's ``lookup(key, req_context)`` (``at``: (scheduler, tier index))."""
    key, ctx = arg(args, kw, 0, "key"), arg(args, kw, 1, "req_context")
    rec.tier_event(
        TierEvent.LOOKUP, ctx.req_id, at[1], [key], positions(ctx), result=_result_name(result)
    )


def tier_submit_store(
    rec: Recorder, at: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``submit_store(job_metadata)``: a write-through (or cascade) job to this tier."""
    job = arg(args, kw, 0, "job_metadata")
    keys, ctx = list(job.keys), job.req_context
    pos = positions(ctx)
    tiering(rec).cascades[int(job.job_id)] = (ctx.req_id, at[1], keys, pos)
    rec.tier_event(
        TierEvent.CASCADE_SUBMITTED, ctx.req_id, at[1], keys, pos, job_id=int(job.job_id)
    )


def tier_finished(
    rec: Recorder, at: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    """``get_finished_jobs()``: which write-through jobs landed. Read only when vLLM's answer
    is a list or tuple (an iterator would be consumed here, and vLLM never sees it twice)."""
    if not isinstance(result, (list, tuple)):
        return
    for job in result:
        found = tiering(rec).cascades.pop(int(job.job_id), None)
        if found is None:
            continue  # a promotion's load: its completion is complete_write's
        req, tier, keys, pos = found
        event = TierEvent.CASCADE_COMPLETED if job.success else TierEvent.CASCADE_FAILED
        rec.tier_event(event, req, tier, keys, pos, job_id=int(job.job_id))


def tier_events(rec: Recorder, at: Any, events: Any) -> Any:
    """``take_events()``: vLLM's events, each handed on as it is taken; the ones that say a
    tier dropped keys are recorded (``tier_evicted``)."""
    for event in events:
        try:
            if getattr(event, "removed", False):
                keys = [bytes(k) for k in getattr(event, "keys", ()) or ()]
                if keys:
                    rec.tier_event(TierEvent.TIER_EVICTED, None, at[1], keys)
        except Exception as exc:
            rec.fail("tier.take_events", exc)
        yield event
