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
from dataclasses import dataclass
from typing import Any, Protocol

from keytrace.format.keys import chunk_ending_at, key_tail, tail_gid
from keytrace.format.schema import (
    HEAD,
    IN_FLIGHT_TIER_WORK,
    SCAN_ENDING,
    SCAN_EPISODE,
    SCAN_PROOF,
    SCAN_UNQUERIED,
)
from keytrace.format.writer import NullWriter, TraceWriter, call_columns
from keytrace.record.sampling import ChainSampler, sample_fraction


class Alarm(Protocol):
    """What the recorder feeds a live judge (`keytrace.live.alarm.Alarm`; a protocol here
    so the recorder does not depend on the layer above it)."""

    def add_instance(
        self,
        instance_id: int,
        name: str,
        engine: str | None,
        dp_rank: int | None,
        directory: str | None,
        recorder: Any = None,
    ) -> None: ...
    def store(
        self,
        inst: int,
        seq: int,
        ts: int,
        event: str,
        req_id: str | None,
        keys: Sequence[bytes],
        ends: Sequence[int | None],
    ) -> None: ...
    def episode_begin(
        self, inst: int, req_id: str, prompt: int, spb: int | None, seq: int | None = None
    ) -> None: ...
    def judge(
        self,
        inst: int,
        ep: Any,
        scans: Sequence[Any],
        unqueried: Mapping[int, Mapping[int, bytes]],
        tpc: Mapping[int, int],
        proofs: Mapping[int, Mapping[int, bytes]],
    ) -> Any: ...
    def report(self, inst: int, j: Any) -> None: ...
    def expected(
        self,
        inst: int,
        ep: Any,
        scans: Sequence[Any],
        tpc: Mapping[int, int],
        unqueried: Mapping[int, Mapping[int, bytes]] | None = None,
    ) -> int | None: ...
    def account(self, inst: int, judged: Any, N: int, accepted: int | None) -> None: ...
    def summarize_pending(self) -> None: ...
    def tier(
        self,
        inst: int,
        seq: int,
        ts: int,
        event: str,
        req_id: str | None,
        tier: int | None,
        keys: Sequence[bytes | None],
        episode: int | None,
        result: str | None = None,
    ) -> None: ...


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
        directory: str | None,
        header: Mapping[str, Any],
        *,
        engine_id: str | None,
        dp_rank: int | None,
        tokens_per_chunk: Mapping[int, int],
        max_rows: int | None = None,
        max_seconds: float | None = None,
        idle_seconds: float | None = None,
        alarm: Alarm | None = None,
        sample: float | None = None,
    ) -> None:
        kw: dict[str, Any] = {}
        if max_rows is not None:
            kw["max_rows"] = max_rows
        if max_seconds is not None:
            kw["max_seconds"] = max_seconds
        if idle_seconds is not None:
            kw["idle_seconds"] = idle_seconds
        writer_class = TraceWriter if directory is not None else NullWriter
        self.writer = writer_class(
            directory or "",
            header,
            engine_id=engine_id,
            dp_rank=dp_rank,
            tokens_per_chunk=tokens_per_chunk,
            **kw,
        )
        w = self.writer
        self.sampler = ChainSampler(sample) if sample is not None else None
        """Which chains are written (``KEYTRACE_SAMPLE``; None: all). The alarm is fed
        before it filters: it judges all traffic."""
        self.alarm = alarm
        """The live alarm this recorder feeds (`keytrace.live.alarm`), or None."""
        self._tpc = dict(tokens_per_chunk)
        self._ep_scans: dict[str, list[_Scan]] = {}
        self._ep_unqueried: dict[str, dict[int, dict[int, bytes]]] = {}
        self._ep_proofs: dict[str, dict[int, dict[int, bytes]]] = {}
        self._judged: dict[str, Any] = {}
        if alarm is not None:
            alarm.add_instance(w.instance_id, w.instance, engine_id, dp_rank, directory, self)
        self._common_tail = (w.instance, w.instance_id, w.engine_id, w.dp_rank, w.pid)
        self.step = 0
        self.episode = -1
        self.in_episode = False
        """Between ``get_num_new_matched_tokens``' start and end (tier rows carry the
        episode then)."""
        self.scan = -1
        self.exact_scans = False
        self._scan: _Scan | None = None
        self._pending_episode: dict[str, _Episode] = {}
        self.seen: dict[int, set[int]] = {}
        """Per group: the end tokens the current episode looked up (read by the hook)."""
        self.lead_hits: dict[int, int] = {}
        """Per group: leading HITs of the current episode's first scan of it."""
        self.groups: list[Any] = []
        """The header's offloaded groups, parsed once by the hook that needs them."""
        self.failures = 0
        # a tiered manager's context (keytrace.vllm.hook.hooks, all under vLLM's manager lock)
        self.promoting: int | None = None
        """The secondary tier a promotion in progress reads from (``_initiate_promotion``)."""
        self.promoted_from: dict[bytes, int | None] = {}
        """Promoted keys not yet completed -> the tier they come from."""
        self.storing: tuple[Sequence[bytes], Any] | None = None
        """(keys, request context) of the ``complete_store`` call in progress: what a
        write-through that back-pressure drops would have written."""
        self.cascades: dict[int, tuple[str | None, int, list[bytes], Mapping[bytes, int]]] = {}
        """Write-through jobs in flight: job id -> (request, tier, keys, positions)."""

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
        shared_prefix_boundary: int | None = None,
        first_hash: bytes | None = None,
    ) -> None:
        """A ``get_num_new_matched_tokens`` call begins: a new episode (and no scan yet).
        ``first_hash``: the request's first block hash (what a sampled trace decides by)."""
        self.end_scan()
        if self.sampler is not None:
            self.sampler.decide(req_id, first_hash)
        self.close_episode(req_id)
        self.episode = next(_SEQ)
        self.in_episode = True
        self.scan = -1
        self.seen = {}
        self.lead_hits = {}
        self._pending_episode[req_id] = _Episode(
            seq=self.episode,
            ts=time.time_ns(),
            step=self.step,
            req_id=req_id,
            local=local_tokens,
            prompt=num_prompt_tokens,
            tokens=num_tokens,
            hashes=num_hashes,
            max_new=max_new_tokens,
            spb=shared_prefix_boundary,
        )
        if self.alarm is not None:
            self._ep_scans[req_id] = []
            self._ep_unqueried.pop(req_id, None)
            self._ep_proofs.pop(req_id, None)
            self._feed(
                "episode_begin", req_id, num_prompt_tokens, shared_prefix_boundary, self.episode
            )

    def episode_end(self, req_id: str, external: int | None, load_async: bool | None) -> None:
        self.end_scan()
        self.in_episode = False
        ep = self._pending_episode.get(req_id)
        if ep is not None:
            ep.external = external
            ep.load_async = load_async
            if self.alarm is not None:
                self._judge(ep)
            if not external:
                # Nothing will be allocated from the tier; the row is final now.
                ep.accepted = 0 if external == 0 else None
                self.close_episode(req_id)
        self.scan = -1

    def accepted(self, req_id: str, num_external_tokens: int) -> None:
        ep = self._pending_episode.get(req_id)
        if ep is not None and ep.accepted is None:
            ep.accepted = num_external_tokens
            self.close_episode(req_id)

    def live_expected(self, req_id: str) -> int | None:
        """The alarm's E for the episode in progress (None without an alarm): the hook then
        also lists the keys a hit at E needs in groups vLLM never scanned, so neither the
        alarm nor the differ has to derive them."""
        ep = self._pending_episode.get(req_id)
        if self.alarm is None or ep is None:
            return None
        scans = self._ep_scans.get(req_id, [])
        listed = self._ep_unqueried.get(req_id, {})
        return self._feed("expected", ep, scans, self._tpc, listed)  # type: ignore[no-any-return]

    def _judge(self, ep: _Episode) -> None:
        """The alarm's verdict on an episode that just ended; its warning, if any."""
        scans = self._ep_scans.pop(ep.req_id, [])
        unqueried = self._ep_unqueried.pop(ep.req_id, {})
        proofs = self._ep_proofs.pop(ep.req_id, {})
        judged = self._feed("judge", ep, scans, unqueried, self._tpc, proofs)
        if judged is not None:
            self._judged[ep.req_id] = judged
            self._feed("report", judged)

    def _feed(self, method: str, *args: Any) -> Any:
        """``alarm.<method>(this instance, *args)``; a failure is counted (`fail`), never
        raised: the one place the recorder calls its alarm."""
        try:
            return getattr(self.alarm, method)(self.writer.instance_id, *args)
        except Exception as exc:
            self.fail("alarm", exc)
            return None

    def close_episode(self, req_id: str) -> None:
        ep = self._pending_episode.pop(req_id, None)
        if ep is None:
            return
        judged = self._judged.pop(req_id, None)
        if judged is not None and self.alarm is not None:
            self._feed("account", judged, ep.tokens, ep.accepted)
        self._lookup_row(
            ep.seq,
            ep.ts,
            ep.step,
            ep.seq,
            SCAN_EPISODE,
            req_id,
            local_tokens=ep.local,
            external_tokens=ep.external,
            load_async=ep.load_async,
            accepted_tokens=ep.accepted,
            num_prompt_tokens=ep.prompt,
            num_tokens=ep.tokens,
            num_hashes=ep.hashes,
            max_new_tokens=ep.max_new,
            shared_prefix_boundary=ep.spb,
        )

    def close_all_episodes(self) -> None:
        self.end_scan()
        for req_id in list(self._pending_episode):
            self.close_episode(req_id)

    def unqueried(
        self, req_id: str, group_id: int, ends: Sequence[int], keys: Sequence[bytes]
    ) -> None:
        """Keys the current episode needed in a group vLLM never scanned (the hook reads them
        from vLLM's own per-group key list), so the differ knows them exactly."""
        self._listed(SCAN_UNQUERIED, self._ep_unqueried, req_id, group_id, ends, keys)

    def proofs(
        self, req_id: str, group_id: int, ends: Sequence[int], keys: Sequence[bytes]
    ) -> None:
        """Proof keys (``SCAN_PROOF``) of chunks the current episode needed: under a
        candidate fix, a second key the lookup accepts for the chunk ending at each of
        ``ends``, so the differ and the alarm judge the chunk by the better of the two."""
        self._listed(SCAN_PROOF, self._ep_proofs, req_id, group_id, ends, keys)

    def _listed(
        self,
        scan: int,
        for_alarm: dict[str, dict[int, dict[int, bytes]]],
        req_id: str,
        group_id: int,
        ends: Sequence[int],
        keys: Sequence[bytes],
    ) -> None:
        """One row of keys listed (not looked up) for the current episode: ``scan`` says
        what they are; the alarm gets them as group -> chunk -> key."""
        if not keys:
            return
        if self.alarm is not None:
            tpc = self._tpc.get(group_id)
            if tpc:
                got = for_alarm.setdefault(req_id, {}).setdefault(group_id, {})
                for end, key in zip(ends, keys, strict=True):
                    chunk = chunk_ending_at(end, tpc)
                    if chunk is not None:
                        got[chunk] = key
        self._lookup_row(
            next(_SEQ),
            time.time_ns(),
            self.step,
            self.episode,
            scan,
            req_id,
            group_id=group_id,
            head_seqs=[None] * len(keys),
            head_end_tokens=list(ends),
            head_keys=list(keys),
            head_results=[None] * len(keys),
        )

    # ----------------------------------------------------------------- lookups
    def begin_scan(self) -> None:
        """A per-group lookup helper was called: the next lookups form a new scan."""
        self.end_scan()
        self.scan += 1

    def lookup(
        self, key: bytes, req_id: str, end_token: int | None, result: str, secondary: bool
    ) -> None:
        """One ``manager.lookup`` call: the hot path, a few list appends."""
        sc = self._scan
        if (
            sc is None
            or sc.req_id != req_id
            or sc.secondary != secondary
            or (not self.exact_scans and key_tail(key) != sc.gid_bytes)
        ):
            if sc is not None:
                self.end_scan()
            if not self.exact_scans:  # without the helper hooks a new group is a new scan
                self.scan += 1
            sc = self._scan = _Scan(
                self.episode, max(self.scan, 0), req_id, key_tail(key), secondary, self.step
            )
        sc.add(next(_SEQ), end_token, key, result)

    def end_scan(self) -> None:
        """Write the scan in progress as one lookup row: its summary and its raw lists."""
        sc = self._scan
        if sc is None:
            return
        self._scan = None
        if self.alarm is not None:
            scans = self._ep_scans.get(sc.req_id)
            if scans is not None:
                scans.append(sc)
        gid = tail_gid(sc.gid_bytes)
        self.seen.setdefault(gid, set()).update(e for e in sc.ends if e is not None)
        self.lead_hits.setdefault(gid, sc.lead)
        term = sc.term if sc.term is not None else sc.first_nonhit
        counts = sc.counts
        head, tail = slice(0, HEAD), slice(HEAD, None)
        self._lookup_row(
            sc.seqs[0],
            sc.ts,
            sc.step,
            sc.episode,
            sc.scan,
            sc.req_id,
            group_id=gid,
            secondary=sc.secondary,
            n_keys=len(sc.seqs),
            n_hit=counts["HIT"],
            n_pending=counts["HIT_PENDING"],
            n_retry=counts["RETRY"],
            n_miss=counts["MISS"],
            lead_hits=sc.lead,
            term_pos=term,
            term_seq=None if term is None else sc.seqs[term],
            term_end_token=None if term is None else sc.ends[term],
            term_key=None if term is None else sc.keys[term],
            term_result=None if term is None else sc.results[term],
            last_hit_seq=None if sc.last_hit is None else sc.seqs[sc.last_hit],
            last_hit_end_token=None if sc.last_hit is None else sc.ends[sc.last_hit],
            head_seqs=sc.seqs[head],
            head_end_tokens=sc.ends[head],
            head_keys=sc.keys[head],
            head_results=sc.results[head],
            tail_seqs=sc.seqs[tail] or None,
            tail_end_tokens=sc.ends[tail] or None,
            tail_keys=sc.keys[tail] or None,
            tail_results=sc.results[tail] or None,
        )

    def _lookup_row(
        self, seq: int, ts: int, step: int, episode: int, scan: int, req_id: str, **values: Any
    ) -> None:
        if self.sampler is not None and not self.sampler.request(req_id):
            return
        row = [seq, ts, *self._common_tail, step, episode, scan, req_id]
        row += [values.get(name) for name in _LOOKUP_VALUES]
        self.writer.append("lookup", 1, tuple(row))

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
            if self.alarm is not None:
                self._feed("store", seq, ts, event, req_id, keys, positions)
            if self.sampler is not None:
                req_id, keys, positions, job_id = self._sampled_store(
                    event, req_id, keys, positions, job_id
                )
                if not keys:
                    return
            call: tuple[Any, ...] = (seq, ts, *self._common_tail, self.step, event, req_id, job_id)
        else:
            if self.sampler is not None and not self.sampler.request(req_id):
                return
            call = (seq, ts, *self._common_tail, self.step, event, req_id)
        self.writer.append(kind, len(keys), call, key=list(keys), end_token=list(positions))

    def _sampled_store(
        self,
        event: str,
        req_id: str | None,
        keys: Sequence[bytes],
        positions: Sequence[int | None],
        job_id: int | None,
    ) -> tuple[str | None, Sequence[bytes], Sequence[int | None], int | None]:
        """What a sampled trace writes of one store call (`keytrace.record.sampling`): the
        call itself on a sampled chain; of an eviction, the sampled chains' keys; of an
        unsampled chain's prepared keys, the first of each group (as no request's)."""
        sm = self.sampler
        assert sm is not None
        if event == "evicted":
            kept = sm.sampled_keys(keys)
            sm.evicted(keys)
            pos = dict(zip(keys, positions, strict=True))
            return req_id, kept, [pos[k] for k in kept if k is not None], job_id  # type: ignore[return-value]
        if event == "prepared":
            if sm.stored(req_id, keys):
                sm.note_prepared(keys)
                return req_id, keys, positions, job_id
            first = sm.first_of_groups(keys)
            pos = dict(zip(keys, positions, strict=True))
            return None, first, [pos[k] for k in first], None
        if sm.request(req_id):
            return req_id, keys, positions, job_id
        return req_id, (), (), job_id

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
        if self.sampler is not None:
            self.sampler.reset()
        seq, ts = next(_SEQ), time.time_ns()
        self.writer.append(
            "store",
            1,
            (seq, ts, *self._common_tail, self.step, "reset", None, None),
            key=[None],
            end_token=[None],
        )
        if self.alarm is not None:
            self._feed("store", seq, ts, "reset", None, [], [])

    # ------------------------------------------------------------------- tiers
    def evicted_by_promotion(
        self,
        req_id: str | None,
        tier: int | None,
        keys: Sequence[bytes],
        positions: Mapping[bytes, int],
    ) -> None:
        """Keys the primary evicted to make room for a promotion: ``evicted`` store rows
        (they left the CPU tier, whatever made room) and ``promotion_evicted`` tier rows
        (what made room)."""
        self._keyed("store", "evicted", req_id, keys, [positions.get(k) for k in keys])
        self.tier_event("promotion_evicted", req_id, tier, keys, positions)

    def tier_event(
        self,
        event: str,
        req_id: str | None,
        tier: int | None,
        keys: Sequence[bytes | None],
        positions: Mapping[bytes, int] | None = None,
        *,
        result: str | None = None,
        job_id: int | None = None,
    ) -> None:
        """What a tiered manager did below its public methods (the ``tier`` kind, one row per
        key; one keyless row for ``promotions_held``/``promotions_released``). Safe from any
        thread: a peer's lookup can arrive from the tiering manager's poll thread, and this
        touches no scan or episode state. Rows recorded while a lookup episode is in
        progress carry its number (``episode``): what its lookups found and caused."""
        ks = list(keys) or [None]
        pos = (positions or {}).get
        ends = [None if k is None else pos(k) for k in ks]
        seq, ts = next(_SEQ), time.time_ns()
        episode = self.episode if self.in_episode else None
        if self.alarm is not None:
            self._feed("tier", seq, ts, event, req_id, tier, ks, episode, result)
        if self.sampler is not None and keys:
            ks = self._sampled_tier(event, req_id, ks)
            if not ks:
                return
            ends = [None if k is None else pos(k) for k in ks]
        call = (
            seq,
            ts,
            *self._common_tail,
            self.step,
            event,
            req_id,
            episode,
            tier,
            result,
            job_id,
        )
        self.writer.append("tier", len(ks), call, key=ks, end_token=ends)

    def _sampled_tier(
        self, event: str, req_id: str | None, keys: list[bytes | None]
    ) -> list[bytes | None]:
        """What a sampled trace writes of one keyed tier call: all of it for transfers in
        flight (they count for every chain's promotions) and for a sampled request; by key
        for a tier's evictions and a promotion's (whose request is not the keys' owner)."""
        sm = self.sampler
        assert sm is not None
        if event == "promotion_prepared":  # keys enter this primary from a tier (stored,
            sm.stored(req_id, [k for k in keys if k is not None])  # maybe, by another engine)
        if event in IN_FLIGHT_TIER_WORK:
            return keys
        if req_id is None or event == "promotion_evicted":  # keys of any chain
            return sm.sampled_keys(keys)
        return keys if sm.request(req_id) else []

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
        keep = self.sampler.request if self.sampler is not None else None
        for row in rows:
            if keep is not None and not keep(row[0]):
                continue
            self.writer.append("step", 1, (next(_SEQ), ts, *self._common_tail, self.step, *row))

    def end_step(self) -> None:
        self.step += 1

    def flush(self) -> None:
        """Write what is buffered as closed parts now (episodes still open stay open)."""
        self.writer.flush()

    def close(self) -> None:
        self.close_all_episodes()
        if self.alarm is not None:
            try:  # not through _feed: the summary is the alarm's, not this instance's
                self.alarm.summarize_pending()
            except Exception as exc:
                self.fail("alarm", exc)
        self.writer.close()


_LOOKUP_VALUES = call_columns("lookup")[11:]
"""The v2 lookup columns after (common, episode, scan, req_id), in the writer's order."""


@dataclass(slots=True)
class _Episode:
    """An episode whose row waits for the accepted token count."""

    seq: int
    ts: int
    step: int
    req_id: str
    local: int
    prompt: int
    tokens: int
    hashes: int
    max_new: int | None
    spb: int | None
    external: int | None = None
    load_async: bool | None = None
    accepted: int | None = None


class _Scan:
    """One scan in progress: raw lists in call order and the running summary."""

    __slots__ = (
        "counts",
        "ends",
        "episode",
        "first_nonhit",
        "gid_bytes",
        "keys",
        "last_hit",
        "lead",
        "req_id",
        "results",
        "scan",
        "secondary",
        "seqs",
        "step",
        "term",
        "ts",
    )

    def __init__(
        self, episode: int, scan: int, req_id: str, gid_bytes: bytes, secondary: bool, step: int
    ) -> None:
        self.episode, self.scan, self.req_id = episode, scan, req_id
        self.gid_bytes, self.secondary, self.step = gid_bytes, secondary, step
        self.ts = time.time_ns()
        self.seqs: list[int] = []
        self.ends: list[int | None] = []
        self.keys: list[bytes] = []
        self.results: list[str] = []
        self.counts = {"HIT": 0, "HIT_PENDING": 0, "RETRY": 0, "MISS": 0}
        self.lead = 0  # HITs before the first non-HIT
        self.last_hit: int | None = None
        self.term: int | None = None  # first MISS or RETRY
        self.first_nonhit: int | None = None

    def add(self, seq: int, end: int | None, key: bytes, result: str) -> None:
        i = len(self.seqs)
        self.seqs.append(seq)
        self.ends.append(end)
        self.keys.append(key)
        self.results.append(result)
        self.counts[result] = self.counts.get(result, 0) + 1
        if result == "HIT":
            self.last_hit = i
            if self.first_nonhit is None:
                self.lead += 1
            return
        if self.first_nonhit is None:
            self.first_nonhit = i
        if self.term is None and result in SCAN_ENDING:
            self.term = i


def env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw and raw.strip().isdigit() else None


def env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


_SAMPLE_WARNED: list[str] = []


def env_sample() -> float | None:
    """``KEYTRACE_SAMPLE`` (`keytrace.record.sampling.sample_fraction`); a value that is not
    a fraction is warned about once and the trace is full."""
    raw = os.environ.get("KEYTRACE_SAMPLE")
    try:
        return sample_fraction(raw)
    except ValueError:
        if raw not in _SAMPLE_WARNED:
            _SAMPLE_WARNED.append(str(raw))
            log.warning(
                "keytrace: KEYTRACE_SAMPLE=%r is not a fraction in (0, 1]; recording all", raw
            )
        return None
