"""The recorder: turns plain values from the hooks into trace rows and typed records.
Imports no vLLM.

One `Recorder` per ``OffloadingConnectorScheduler`` instance (one per EngineCore process in
serving). It owns a `TraceWriter`, the context the manager calls lack on their own (the
current step, episode and scan) and the instance's `ChainBook` (which boundaries requests
meant later lookups to hit). What it records goes to the writer as rows and, as typed
records (`keytrace.record.events`), to its listener (the live alarm). Under sampling
(``KEYTRACE_SAMPLE``) both get the same subset, the sampled chains and what they are judged
by: the alarm then judges exactly the episodes the trace holds, as the differ would, and
the hooks do next to nothing for the other requests (the cost issue 41 measures). What it
writes never depends on whether a listener is there.

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
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ParamSpec

from keytrace.format.keys import chunk_ending_at, key_tail
from keytrace.format.schema import (
    HEAD,
    IN_FLIGHT_TIER_WORK,
    SCAN_EPISODE,
    SCAN_PROOF,
    SCAN_UNQUERIED,
    LookupResult,
    StoreEvent,
    TierEvent,
)
from keytrace.format.writer import NullWriter, TraceWriter, call_columns
from keytrace.judge import definitions as d
from keytrace.judge.definitions import DURABLE_EVENTS
from keytrace.judge.identity import shared_places
from keytrace.judge.partial import partial_block, partial_tails_on
from keytrace.judge.rules import (
    STORE_OFFERS,
    groups_from_header,
    lookup_cap,
    retention_of,
    trim_first_of,
    withheld_chunk,
)
from keytrace.record.chain import ChainBook
from keytrace.record.events import (
    Episode,
    Health,
    InstanceInfo,
    Listed,
    Listener,
    Scan,
    StoreCall,
    TierCall,
)
from keytrace.record.sampling import ChainSampler, sample_fraction

log = logging.getLogger("keytrace")

P = ParamSpec("P")

_SEQ = itertools.count()
"""One sequence shared by every recorder and kind in this process: total order of calls."""

next_seq = _SEQ.__next__
"""The shared sequence's next number, as a plain callable: what a hook's fast path that
appends to `Recorder.open_scan` numbers its call with."""

_FAILURES_LOGGED: set[str] = set()
"""Where a failure was already logged in this process: one line per place, not per row or
per scheduler (a test suite builds thousands of schedulers)."""

KeyOf = Callable[[int, int], bytes | None]
"""(group id, chunk) -> the request's key of that chunk, None when it has none."""


class Recorder:
    """Builds rows and records for one scheduler instance. See the module docstring."""

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
        listener: Listener | None = None,
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
        """Which chains are written and judged (``KEYTRACE_SAMPLE``; None: all). The
        listener is fed what the writer keeps, so it judges the sampled episodes."""
        self.groups = groups_from_header(dict(header))
        self.trim_first = trim_first_of(dict(header))
        self._withheld: set[str] = set()
        """Requests whose `withhold` rows are written (until they finish)."""
        """The header's offloaded groups."""
        self.tiered = bool(header.get("secondary_tiers"))
        self.tph = int(header.get("tokens_per_hash") or 1)
        self.retention = retention_of(dict(header))
        self.book = ChainBook(self.groups)
        if partial_tails_on(header):
            self.book.partial_bs = partial_block(header)
        self.book.share(shared_places(dict(header)))
        """Which boundaries requests meant later lookups to hit (`keytrace.record.chain`)."""
        self.listener = listener
        """The live judge this recorder feeds (`keytrace.live.alarm`), or None."""
        self.inst = w.instance_id
        self._common_tail = (w.instance, w.instance_id, w.engine_id, w.dp_rank, w.pid)
        self.step = 0
        self.episode = -1
        self.in_episode = False
        """Between ``get_num_new_matched_tokens``' start and end (tier rows carry the
        episode then)."""
        self.scan = -1
        self.unfollowed: str | None = None
        """The request of the episode in progress when the sampler left its chain out: its
        lookups are not recorded, judged or summarised (`lookup` returns at once)."""
        self.exact_scans = False
        self.open_scan: Scan | None = None
        """The scan being recorded. A hook may append a call to it directly (its three
        lists, numbered by `next_seq`) when the call continues it: the same request, a
        group key ending in its ``gid_bytes``, and ``sc.appendable``. Every other call goes
        through `lookup`. An open scan's request is always followed (the sampler's choice
        changes only at an episode's start or end, after `end_scan`)."""
        self._pending: dict[str, Episode] = {}
        self.failures = 0
        self.identity_settled = False
        """Whether the hook has read the engine's hash identity into the header (at its
        first lookup: vLLM draws NONE_HASH after the scheduler is built)."""
        if listener is not None:
            me = weakref.ref(self)
            info = InstanceInfo(
                w.instance_id,
                w.instance,
                engine_id or w.instance,
                dp_rank,
                directory,
                lambda: _health(me()),
            )
            self._tell(listener.instance_started, info, self.book)

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

    def _tell(self, method: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
        """Call one of the listener's methods; a failure is counted (`fail`), never raised:
        the one place the recorder calls its listener."""
        try:
            method(*args, **kwargs)
        except Exception as exc:
            self.fail("alarm", exc)

    def follows(self, req_id: str | None) -> bool:
        """Whether rows of ``req_id`` are recorded: always without sampling; with it, the
        sampler's decision for the request's chain (`ChainSampler.request`). The hooks ask
        before reading what only a followed request's rows need."""
        return self.sampler is None or self.sampler.request(req_id)

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
        limits: Mapping[str, Any] | None = None,
    ) -> None:
        """A ``get_num_new_matched_tokens`` call begins: a new episode (and no scan yet).
        ``first_hash``: the request's first block hash (what a sampled trace decides by).
        ``limits``: what the request asked of the connector
        (`keytrace.judge.rules.request_limits`). `start_episode`, then, for a followed
        request, `open_episode`: the hook calls the two itself, reading the request's
        values only for a followed one."""
        if self.start_episode(req_id, first_hash):
            self.open_episode(
                req_id,
                local_tokens,
                max_new_tokens,
                num_prompt_tokens,
                num_tokens,
                num_hashes,
                shared_prefix_boundary,
                limits,
            )

    def start_episode(self, req_id: str, first_hash: bytes | None = None) -> bool:
        """An episode of ``req_id`` begins: the open scan and any earlier episode of the
        request end, the episode is numbered, and the sampler decides for its chain.
        Whether it is followed (False: a chain the sampler left out, and nothing else of
        the episode is recorded: `unfollowed`)."""
        self.end_scan()
        self.close_episode(req_id)
        self.episode = next(_SEQ)
        self.in_episode = True
        self.scan = -1
        if self.sampler is not None and not self.sampler.decide(req_id, first_hash):
            self.unfollowed = req_id  # numbered as any episode, nothing else
            return False
        self.unfollowed = None
        return True

    def open_episode(
        self,
        req_id: str,
        local_tokens: int,
        max_new_tokens: int | None,
        num_prompt_tokens: int,
        num_tokens: int,
        num_hashes: int,
        shared_prefix_boundary: int | None = None,
        limits: Mapping[str, Any] | None = None,
    ) -> None:
        """The followed episode `start_episode` began: its row-to-be, its chain's
        boundaries, the listener told."""
        lim = limits or {}
        ep = self._pending[req_id] = Episode(
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
            max_load=lim.get("max_load_tokens"),
            max_offload=lim.get("max_offload_tokens"),
            load_tiers=lim.get("kv_load_tiers"),
            skip_reading=bool(lim.get("skip_reading_kv")),
        )
        self.book.begin(req_id, num_prompt_tokens, shared_prefix_boundary)
        if self.listener is not None:
            self._tell(self.listener.episode_began, self.inst, ep)

    def episode_end(
        self,
        req_id: str,
        external: int | None,
        load_async: bool | None,
        junction: int | None = None,
    ) -> None:
        """vLLM answered the episode (``external``: None when it deferred). ``junction``:
        the request's ``shared_prefix_boundary`` after the lookup: vLLM 0.34.0's lookup
        raises it where a sparse group cut the hit below the full-attention prefix, and the
        request's stores then keep tails for it too."""
        self.end_scan()
        self.in_episode = False
        self.unfollowed = None
        ep = self._pending.get(req_id)
        if ep is not None:
            ep.external = external
            ep.load_async = load_async
            # where its computation begins is known now: a recurrent model keeps a state
            # at the junction only if the request computes through it (`junction_kept`)
            computed_from = None if external is None else ep.local + external
            if junction and junction > (ep.spb or 0):
                ep.spb = junction
                self.book.begin(req_id, ep.prompt, junction, computed_from)
            elif ep.spb and computed_from is not None:
                self.book.begin(req_id, ep.prompt, ep.spb, computed_from)
            if self.listener is not None:
                self._tell(self.listener.episode_ended, self.inst, ep)
            if not external:
                # Nothing will be allocated from the tier; the row is final now.
                ep.accepted = 0 if external == 0 else None
                self.close_episode(req_id)
        self.scan = -1

    def accepted(self, req_id: str, num_external_tokens: int) -> None:
        ep = self._pending.get(req_id)
        if ep is not None and ep.accepted is None:
            ep.accepted = num_external_tokens
            self.close_episode(req_id)

    def current(self, req_id: str) -> Episode | None:
        """The episode of ``req_id`` whose row is not final yet, if any."""
        return self._pending.get(req_id)

    def close_episode(self, req_id: str) -> None:
        ep = self._pending.pop(req_id, None)
        if ep is None:
            return
        if self.listener is not None:
            self._tell(self.listener.episode_closed, self.inst, ep)
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
            max_load_tokens=ep.max_load,
            max_offload_tokens=ep.max_offload,
            kv_load_tiers=ep.load_tiers,
            skip_reading_kv=ep.skip_reading,
        )

    def close_all_episodes(self) -> None:
        self.end_scan()
        for req_id in list(self._pending):
            self.close_episode(req_id)

    def request_finished(self, req_id: str) -> None:
        """vLLM finished ``req_id``: its episode row is final, and what was kept for it alone
        (its boundaries, its sampling decision) goes."""
        self.close_episode(req_id)
        self._withheld.discard(req_id)
        self.book.finished(req_id)
        if self.sampler is not None:
            self.sampler.finished(req_id)
        if self.listener is not None:  # (an unsampled request's kept tier rows name it too)
            self._tell(self.listener.request_finished, self.inst, req_id)

    # ------------------------------------------------------- keys not looked up
    def list_needed(self, req_id: str, key_of: KeyOf) -> list[int]:
        """List the keys the episode in progress needs for a hit at any boundary it could
        expect and that its lookups did not ask for (vLLM stops at the first group that
        returns 0, so later groups are never looked up): from the request's own key lists
        (``key_of``), read only, at every end of
        `keytrace.judge.definitions.listing_boundaries` (the intended boundaries this
        instance's `ChainBook` knows, the ceiling min(L, F), the standing ones). The
        differ and the live alarm then know those keys exactly, alarm on or off. Returns
        the ends listed for (a candidate fix lists proof keys for the same)."""
        ep = self._pending.get(req_id)
        if ep is None or not self.groups:
            return []
        S = ep.local
        cap = lookup_cap(self.groups, ep.tokens, S, ep.max_new, ep.load_cap, self.trim_first)
        first = ep.first_scans()
        leads = {gid: sc.lead for gid, sc in first.items()}
        top = (
            cap
            if self.tiered
            else d.match_ceiling(cap, d.resident_prefix(S, self.groups, leads.get))
        )
        seen = ep.seen_ends()
        keyed_tokens = ep.hashes * self.tph
        anchor = self.book.anchor
        if ep.load_cap is not None and anchor is not None and anchor.full_attention:
            # a capped lookup never asks past its cap: list the anchor group's keys up to
            # the cap without it, so the chain names the boundaries the cap kept away
            free = lookup_cap(self.groups, ep.tokens, S, ep.max_new, None, self.trim_first)
            chunks = d.listed_chunks(anchor, S, (), keyed_tokens // anchor.tpc, free, True)
            self._list(ep, anchor.gid, chunks, seen, key_of)
        if top <= S:
            return []
        for g in self.groups:  # full attention first: its keys name the chain
            if g.full_attention:
                self._list(
                    ep,
                    g.gid,
                    d.listed_chunks(g, S, (), keyed_tokens // g.tpc, cap, self.tiered),
                    seen,
                    key_of,
                )
        anchor_keys: list[bytes] = []
        if anchor is not None:
            anchor_keys = [k for sc in ep.scans if sc.gid == anchor.gid for k in sc.keys]
            anchor_keys += ep.unqueried.get(anchor.gid, {}).values()
        intended, _ = self.book.intended(anchor_keys, ep.seq)
        intended |= self.book.shared_intended(anchor_keys, ep.seq)
        ends = d.listing_boundaries(
            S, top, sorted(intended), self.groups, self.retention, self.tiered
        )
        for g in self.groups:
            if not g.full_attention:
                chunks = d.listed_chunks(g, S, ends, keyed_tokens // g.tpc, cap, self.tiered)
                self._list(ep, g.gid, chunks, seen, key_of)
        return ends

    def _list(
        self,
        ep: Episode,
        gid: int,
        chunks: Sequence[int],
        seen: Mapping[int, set[int]],
        key_of: KeyOf,
    ) -> None:
        tpc = self.writer.tokens_per_chunk.get(gid)
        if not tpc or not chunks:
            return
        looked = seen.get(gid, set())
        ends, keys = [], []
        for c in chunks:
            end = (c + 1) * tpc
            if end in looked:
                continue
            key = key_of(gid, c)
            if key is not None:
                ends.append(end)
                keys.append(key)
        self._listed(SCAN_UNQUERIED, ep.unqueried, ep.req_id, gid, ends, keys)

    def proofs(
        self, req_id: str, group_id: int, ends: Sequence[int], keys: Sequence[bytes]
    ) -> None:
        """Proof keys (``SCAN_PROOF``) of chunks the current episode needed: under a
        candidate fix, a second key the lookup accepts for the chunk ending at each of
        ``ends``, so the differ and the alarm judge the chunk by the better of the two."""
        ep = self._pending.get(req_id)
        if ep is not None:
            self._listed(SCAN_PROOF, ep.proofs, req_id, group_id, ends, keys)

    def _listed(
        self,
        scan: int,
        into: Listed,
        req_id: str,
        group_id: int,
        ends: Sequence[int],
        keys: Sequence[bytes],
    ) -> None:
        """One row of keys listed (not looked up) for the current episode: ``scan`` says
        what they are; the episode keeps them as group -> chunk -> key."""
        if not keys:
            return
        tpc = self.writer.tokens_per_chunk.get(group_id)
        if tpc:
            got = into.setdefault(group_id, {})
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
        self,
        key: bytes,
        req_id: str,
        position: int | Callable[[bytes], int | None] | None,
        result: LookupResult,
        secondary: bool = False,
    ) -> None:
        """One ``manager.lookup`` call: the hot path, three list appends. ``position``: the
        key's end token, or the request's key -> end token lookup, which the hook passes
        (vLLM's ``get_offload_key_position``), called once the scan ends."""
        if req_id == self.unfollowed:
            return
        sc = self.open_scan
        if (
            sc is None
            or sc.req_id != req_id
            or sc.secondary != secondary
            or key[-4:] != sc.gid_bytes
        ):
            if sc is not None:
                self.end_scan()
            # a scan is one group's calls: without the helper hooks a new group starts one,
            # and with them too where one helper asks every group in turn (a recurrent
            # model's partial-tail lookup asks each group's key at one boundary)
            if not self.exact_scans or (
                sc is not None and sc.req_id == req_id and key[-4:] != sc.gid_bytes
            ):
                self.scan += 1
            sc = self.open_scan = Scan(
                self.episode,
                max(self.scan, 0),
                req_id,
                key_tail(key),
                secondary,
                self.step,
                position if callable(position) else None,
            )
        sc.seqs.append(next(_SEQ))
        sc.keys.append(key)
        sc.results.append(result)
        if sc.position is None:
            sc.ends.append(position)  # type: ignore[arg-type]

    def end_scan(self) -> None:
        """Write the scan in progress as one lookup row: its summary and its raw lists."""
        sc = self.open_scan
        if sc is None:
            return
        self.open_scan = None
        sc.close()
        ep = self._pending.get(sc.req_id)
        if ep is not None and ep.seq == sc.episode:
            ep.scans.append(sc)
        term = sc.terminal
        counts = sc.counts
        head, tail = slice(0, HEAD), slice(HEAD, None)
        self._lookup_row(
            sc.seqs[0],
            sc.ts,
            sc.step,
            sc.episode,
            sc.scan,
            sc.req_id,
            group_id=sc.gid,
            secondary=sc.secondary,
            n_keys=len(sc.seqs),
            n_hit=counts[LookupResult.HIT],
            n_pending=counts[LookupResult.HIT_PENDING],
            n_retry=counts[LookupResult.RETRY],
            n_miss=counts[LookupResult.MISS],
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
    def _store(
        self,
        event: StoreEvent,
        req_id: str | None,
        keys: Sequence[bytes],
        positions: Sequence[int | None],
        job_id: int | None = None,
    ) -> None:
        if not keys:
            return
        seq = next(_SEQ)
        if self.sampler is not None:
            req_id, keys, positions, job_id = self._sampled_store(
                event, req_id, keys, positions, job_id
            )
            if not keys:
                return
        self._store_kept(seq, event, req_id, keys, positions, job_id)

    def _store_kept(
        self,
        seq: int,
        event: StoreEvent,
        req_id: str | None,
        keys: Sequence[bytes],
        positions: Sequence[int | None],
        job_id: int | None,
    ) -> None:
        """A store call's rows as the trace keeps them (after sampling): the chain book,
        the listener, the writer."""
        call = StoreCall(seq, time.time_ns(), event, req_id, keys, positions, job_id)
        if event in STORE_OFFERS:
            self.book.offered(req_id, keys, positions, call.seq)
        if self.listener is not None:
            self._tell(self.listener.store_called, self.inst, call)
        row = (call.seq, call.ts, *self._common_tail, self.step, event, req_id, job_id)
        self.writer.append("store", len(keys), row, key=list(keys), end_token=list(positions))

    def _sampled_store(
        self,
        event: StoreEvent,
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
        if event is StoreEvent.EVICTED:
            kept = sm.sampled_keys(keys)
            sm.evicted(keys)
            pos = dict(zip(keys, positions, strict=True))
            return req_id, kept, [pos[k] for k in kept if k is not None], job_id  # type: ignore[return-value]
        if event is StoreEvent.PREPARED:
            if sm.stored(req_id, keys):
                sm.note_prepared(keys)
                return req_id, keys, positions, job_id
            first = sm.first_of_groups(keys)
            pos = dict(zip(keys, positions, strict=True))
            return None, first, [pos[k] for k in first], None
        if sm.request(req_id):
            return req_id, keys, positions, job_id
        return req_id, (), (), job_id

    def _unsampled_prepared(
        self, prepared: Sequence[bytes], positions: Mapping[bytes, int]
    ) -> None:
        """The keys a ``prepare_store`` call of a chain the sampler left out prepared: of what
        a sampled trace keeps (`_sampled_store`), only the first prepared key of a group new
        to the instance can be here (its evictions are written apart), so nothing else of
        the call is listed, looked up or judged: with sampling on this is most calls."""
        sm = self.sampler
        assert sm is not None
        first = sm.first_of_groups(prepared)
        if first:
            pos = positions.get
            self._store_kept(
                next(_SEQ), StoreEvent.PREPARED, None, first, [pos(k) for k in first], None
            )

    def store_prepared(
        self,
        req_id: str,
        offered: Sequence[bytes],
        positions: Mapping[bytes, int],
        keys_to_store: Iterable[bytes] | None,
        evicted: Sequence[bytes],
        job_id: int | None,
        filtered: Sequence[bytes] = (),
    ) -> None:
        """One ``prepare_store`` call: an outcome row per offered key, plus evictions.
        ``filtered``: of the keys it declined, those the manager's ``store_threshold``
        filtered (each also gets a `StoreEvent.FILTERED` row)."""
        pos = positions.get
        if evicted:
            self._store(StoreEvent.EVICTED, req_id, evicted, [pos(k) for k in evicted])
        followed = self.sampler is None or self.sampler.request(req_id)
        if keys_to_store is None:
            if followed:
                self._store(StoreEvent.FAILED, req_id, offered, [pos(k) for k in offered])
            return
        chosen = (
            keys_to_store if isinstance(keys_to_store, (set, frozenset)) else set(keys_to_store)
        )
        whole = len(chosen) == len(offered)
        prepared = offered if whole else [k for k in offered if k in chosen]
        if not followed:
            self._unsampled_prepared(prepared, positions)
            return
        self._store(StoreEvent.PREPARED, req_id, prepared, [pos(k) for k in prepared], job_id)
        if whole:
            return
        rejected = [k for k in offered if k not in chosen]
        self._store(StoreEvent.REJECTED, req_id, rejected, [pos(k) for k in rejected])
        if filtered:
            self._store(StoreEvent.FILTERED, req_id, filtered, [pos(k) for k in filtered])

    def withhold(self, req_id: str, key_of: KeyOf) -> None:
        """The episode in progress's request asked ``max_offload_tokens``: a
        `StoreEvent.WITHHELD` row for each group's first chunk the cap keeps from the store
        path (`keytrace.judge.rules.withheld_chunk`), read from the request's own key lists
        (``key_of``), once per request."""
        ep = self._pending.get(req_id)
        if ep is None or ep.max_offload is None or req_id in self._withheld:
            return
        self._withheld.add(req_id)
        keys, ends = [], []
        for g in self.groups:
            chunk = withheld_chunk(g, ep.max_offload, ep.prompt)
            key = key_of(g.gid, chunk) if chunk is not None else None
            if chunk is not None and key is not None:
                keys.append(key)
                ends.append((chunk + 1) * g.tpc)
        self._store(StoreEvent.WITHHELD, req_id, keys, ends)

    def store_completed(
        self,
        req_id: str,
        keys: Iterable[bytes],
        positions: Mapping[bytes, int],
        job_id: int | None,
        success: bool,
    ) -> None:
        if self.sampler is not None and not self.sampler.request(req_id):
            return  # (a chain the sampler left out: nothing of a completion is kept)
        ks = list(keys)
        pos = positions.get
        event = StoreEvent.COMPLETED if success else StoreEvent.FAILED
        self._store(event, req_id, ks, [pos(k) for k in ks], job_id)

    def reset(self) -> None:
        """``manager.reset_cache()``: every stored key left the tier."""
        if self.sampler is not None:
            self.sampler.reset()
        call = StoreCall(next(_SEQ), time.time_ns(), StoreEvent.RESET, None, (), ())
        if self.listener is not None:
            self._tell(self.listener.store_called, self.inst, call)
        self.writer.append(
            "store",
            1,
            (call.seq, call.ts, *self._common_tail, self.step, call.event, None, None),
            key=[None],
            end_token=[None],
        )

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
        self._store(StoreEvent.EVICTED, req_id, keys, [positions.get(k) for k in keys])
        self.tier_event(TierEvent.PROMOTION_EVICTED, req_id, tier, keys, positions)

    def tier_event(
        self,
        event: TierEvent,
        req_id: str | None,
        tier: int | None,
        keys: Sequence[bytes | None],
        positions: Mapping[bytes, int] | None = None,
        *,
        result: LookupResult | None = None,
        job_id: int | None = None,
    ) -> None:
        """What a tiered manager did below its public methods (the ``tier`` kind, one row per
        key; one keyless row for ``promotions_held``/``promotions_released``). Safe from any
        thread: a peer's lookup can arrive from the tiering manager's poll thread, and this
        touches no scan or episode state. Rows recorded while a lookup episode is in
        progress carry its number (``episode``): what its lookups found and caused."""
        ks = list(keys) or [None]
        seq = next(_SEQ)
        if self.sampler is not None and keys:
            ks = self._sampled_tier(event, req_id, ks)
            if not ks:
                return
        pos = (positions or {}).get
        ends = [None if k is None else pos(k) for k in ks]
        # (rows kept from an episode the sampler left out name no episode: none is recorded)
        episode = self.episode if self.in_episode and self.unfollowed is None else None
        call = TierCall(seq, time.time_ns(), event, req_id, tier, ks, ends, episode, result, job_id)
        if event in DURABLE_EVENTS:  # what a shared tier holds for other engines' lookups
            self.book.written(tier, ks, call.seq)
        if self.listener is not None:
            self._tell(self.listener.tier_called, self.inst, call)
        row = (
            call.seq,
            call.ts,
            *self._common_tail,
            self.step,
            event,
            req_id,
            episode,
            tier,
            result,
            job_id,
        )
        self.writer.append("tier", len(ks), row, key=ks, end_token=ends)

    def _sampled_tier(
        self, event: TierEvent, req_id: str | None, keys: list[bytes | None]
    ) -> list[bytes | None]:
        """What a sampled trace writes of one keyed tier call: all of it for transfers in
        flight (they count for every chain's promotions) and for a sampled request; by key
        for a tier's evictions and a promotion's (whose request is not the keys' owner)."""
        sm = self.sampler
        assert sm is not None
        if event is TierEvent.PROMOTION_PREPARED:  # keys enter this primary from a tier
            sm.stored(req_id, [k for k in keys if k is not None])  # (stored, maybe, elsewhere)
        if event in IN_FLIGHT_TIER_WORK:
            return keys
        if req_id is None or event is TierEvent.PROMOTION_EVICTED:  # keys of any chain
            return sm.sampled_keys(keys)
        return keys if sm.request(req_id) else []

    # ------------------------------------------------------------------- loads
    def load(
        self, event: str, req_id: str, keys: Iterable[bytes], positions: Mapping[bytes, int]
    ) -> None:
        if self.sampler is not None and not self.sampler.request(req_id):
            return
        ks = list(keys)
        if not ks:
            return
        pos = positions.get
        row = (next(_SEQ), time.time_ns(), *self._common_tail, self.step, event, req_id)
        self.writer.append("load", len(ks), row, key=ks, end_token=[pos(k) for k in ks])

    # ------------------------------------------------------------------- steps
    def step_rows(
        self, rows: Iterable[tuple[str, int, int, int | None, int | None, bool, bool, bool]]
    ) -> None:
        """Per-request rows of one ``build_connector_meta`` call (pre-step values)."""
        ts = time.time_ns()
        keep = self.sampler.request if self.sampler is not None else None
        head = (*self._common_tail, self.step)
        self.writer.extend(
            "step",
            [(next(_SEQ), ts, *head, *row) for row in rows if keep is None or keep(row[0])],
        )

    def end_step(self) -> None:
        self.step += 1

    def flush(self) -> None:
        """Write what is buffered as closed parts now (episodes still open stay open)."""
        self.writer.flush()

    def close(self) -> None:
        self.close_all_episodes()
        if self.listener is not None:
            self._tell(self.listener.recorder_closed, self.inst)
        self.writer.close()


def _health(rec: Recorder | None) -> Health | None:
    if rec is None:
        return None
    stats = rec.writer.stats
    return Health(rec.failures, stats.dropped_rows, stats.dropped_parts, stats.capped)


_LOOKUP_VALUES = call_columns("lookup")[11:]
"""The v2 lookup columns after (common, episode, scan, req_id), in the writer's order."""


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
