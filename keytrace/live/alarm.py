"""The live write-only alarm: judge each lookup episode as it ends, in the serving process.

The recorder feeds every store event and every finished scan here; at the end of each
lookup episode `Alarm.judge` gives the episode the verdict `keytrace diff` would give it
(``docs/diff.md``), from state kept as the events went by instead of from a trace:

- per key and recorder instance, the last sequence number of each store event (completed,
  evicted, prepared, failed), whether it was rejected, and when it was first offered (wall
  clock, for ``other_engine``); per instance the last tier reset and the first prepared
  sequence number of each group (for ``other_group``);
- per instance the anchor group's keys each request offered at its own boundaries (its
  cap and its ``shared_prefix_boundary`` junction): the *intended boundaries* of later
  episodes that look the same keys up (the chain).

Every rule comes from where the differ takes it: vLLM's arithmetic from
`keytrace.judge.rules`, keytrace's definitions (F, E, residency, the cause table, the
binding scan, verdicts, shortfall tokens) from `keytrace.judge.definitions`, the key
layout from `keytrace.format.keys`; the differ evaluates them over polars columns, this
module with the values it kept. What is here is only how those values are kept and
gathered. The agreement (every field of every episode) is tested against the offline differ
on real-scheduler traffic.

Bounded memory: key records, boundary offers and request boundaries are capped together by
``max_bytes`` (default 64 MiB, about 250,000 keys); the least recently touched go first. A
shortfall that would need a forgotten key's history, or a needed key the episode never saw,
is ``undetermined``: counted, never warned about (a false alarm costs more than a late one).

Work per store event: one dict update per key. Per episode: O(keys it looked up + needed
chunks). Nothing here calls vLLM or raises into it: the recorder's hook wrappers catch and
count any failure (`keytrace.record.recorder.Recorder.fail`).
"""

from __future__ import annotations

import itertools
import logging
import shlex
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keytrace.format.keys import (
    chunk_ending_at,
    gid_tail,
    key_hash,
    key_tail,
    make_key,
    tail_gid,
)
from keytrace.format.remote import shown
from keytrace.judge import definitions as d
from keytrace.judge.definitions import FINDINGS, RULE_CAUSES, UNSEEN
from keytrace.judge.rules import (
    OFFER_EVENTS,
    STORE_OFFERS,
    Group,
    align_down,
    lookup_cap,
    needed_range,
    store_boundary,
)

log = logging.getLogger("keytrace")

DEFAULT_MAX_BYTES = 64 << 20
"""Default cap on the alarm's state (``KEYTRACE_ALARM_MAX_BYTES``)."""
STALLED_KEPT = 4096
"""Stalled requests remembered (so each warns once): a request aborted while stalled is
never answered, so the set is cleared when it reaches this size (at worst a request then
counts once more in the log's summary)."""
BYTES_PER_RECORD = 280
"""What one key record costs in CPython (its tagged key, the record, the dict slot):
204 bytes measured with tracemalloc at 50k records (tests/unit/test_alarm.py checks it);
the margin covers the dict's growth steps."""
DEFAULT_INTERVAL = 60.0
"""Seconds between summaries of repeated mismatches of one group and cause."""


class _KeyRec:
    """One key's store history on one instance: last sequence number of each event."""

    __slots__ = ("completed", "evicted", "failed", "offered_ts", "prepared", "rejected", "tiers")

    def __init__(self) -> None:
        self.completed: int | None = None
        self.evicted: int | None = None
        self.prepared: int | None = None
        self.failed: int | None = None
        self.rejected = False
        self.offered_ts: int | None = None
        self.tiers: dict[int | None, list[int | None]] | None = None
        """A tiered manager's secondary tiers: tier -> [last seq it held the key (a
        write-through completed, or its lookup answered HIT), last seq it evicted it]."""


@dataclass
class _Instance:
    """Per recorder instance: resets, first preparation per group, boundaries and offers."""

    name: str
    engine: str
    dp_rank: int | None
    directory: str | None
    recorder: Any = None  # weakref to the Recorder (its failure and drop counters)
    tag: bytes = b""  # 2 bytes appended to a key to name its record on this instance
    reset: int | None = None
    first_prep: dict[int, int] = field(default_factory=dict)
    bounds: dict[str, dict[int, int]] = field(default_factory=dict)  # req -> chunk -> b
    prompt: dict[str, int] = field(default_factory=dict)  # req -> P
    offers: dict[bytes, dict[tuple[str, int], int]] = field(default_factory=dict)
    """anchor key -> (req, b) -> first offer seq"""
    deferred: dict[str, tuple[int, int]] = field(default_factory=dict)
    """req -> (consecutive deferred episodes, wall clock of the first of them)"""
    held: list[int | None] = field(default_factory=lambda: [None, None])
    """[last promotions_held seq, last promotions_released seq]"""
    no_room: dict[int, set[bytes]] = field(default_factory=dict)
    """episode -> keys its lookups found on a tier with no primary slot to promote into"""
    promoted_out: dict[str, set[bytes]] = field(default_factory=dict)
    """req -> keys its own promotions evicted from the primary"""
    promoted_now: dict[int, set[bytes]] = field(default_factory=dict)
    """episode -> keys its own lookup's promotions evicted during it (until it is judged)"""
    cascading: dict[bytes, int] = field(default_factory=dict)
    """key -> its write-through jobs in flight, to any tier (zero counts are dropped; each
    key above zero holds one primary slot, `keytrace.judge.definitions.IN_FLIGHT_TIER_WORK`)"""
    promoting: dict[str, int] = field(default_factory=dict)
    """req -> its promotions in flight (requests with none are dropped)"""
    crowd: dict[int, int] = field(default_factory=dict)
    """episode -> the most primary slots other work held when its promotions found no room
    (`keytrace.judge.definitions.held_by_others`; until it is judged)"""
    open: int | None = None
    """The episode in progress (its sequence number), if any."""
    pending: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    """Store-like rows recorded during the episode in progress (a tiered manager's
    promotions and the evictions they cause), applied once it is judged: the episode is
    judged on the history before it, as the differ reads it (``seq < s``)."""


@dataclass(frozen=True)
class _Moment:
    """An episode the causes of its keys are read at: its instance, sequence number and wall
    clock, how far its chain keyed (``keyable_end``), its request, whether its needed
    chunks fit the primary tier, and whether other work in flight crowded them out."""

    st: _Instance
    s: int
    t: int
    keyable_end: int | None
    req_id: str
    fits: bool
    crowded: bool = False


@dataclass(frozen=True)
class Judged:
    """One episode's online verdict, with what a warning names."""

    verdict: str
    instance: str
    req_id: str
    episode: int
    S: int
    E: int | None
    external: int | None
    binding_group: int | None = None
    cause: str | None = None  # first decisive cause (or in_flight / all_resident)
    term_chunk: int | None = None
    term_key: bytes | None = None
    term_result: str | None = None
    term_cause: str | None = None
    decisive: tuple[str, ...] = ()


class Alarm:
    """Process-wide online judge shared by every recorder of the process (see module doc)."""

    def __init__(
        self,
        header: Mapping[str, Any],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        interval: float = DEFAULT_INTERVAL,
        warn: bool = True,
        keep_judged: bool = False,
    ) -> None:
        from keytrace.judge.rules import groups_from_header

        self.groups: list[Group] = groups_from_header(dict(header))
        self.by_gid = {g.gid: g for g in self.groups}
        self.anchor = d.anchor(self.groups)
        self._anchor_tail = gid_tail(self.anchor.gid)
        self.group_ids = [int(g["group_id"]) for g in header.get("groups", [])]
        self.tph = int(header.get("tokens_per_hash") or 1)
        self.tiered = bool(header.get("secondary_tiers"))
        """A tiered manager: F, residency and causes read what its tiers hold."""
        self.primary_chunks: int | None = header.get("cpu_num_chunks")
        self.retention = int(header.get("retention_interval") or 0)
        self.max_records = max(1024, max_bytes // BYTES_PER_RECORD)
        self.interval = interval
        self.warn = warn
        self._lock = threading.Lock()
        self._keys: dict[bytes, _KeyRec] = {}
        """key + the instance's 2-byte tag -> record: one flat dict (a dict per key would
        double the cost of a record), in least-recently-touched order."""
        self._inst: dict[int, _Instance] = {}
        self.forgotten = 0
        """Key records dropped to stay under the cap."""
        # counters, read by the Prometheus collector and the tests
        self.episodes: Counter[tuple[str, str]] = Counter()  # (engine, verdict)
        self.short_tokens: Counter[tuple[str, str, str]] = Counter()  # (engine, cause, group)
        self.stored: Counter[tuple[str, str, str]] = Counter()  # (engine, group, event)
        self.looked_up: Counter[tuple[str, str, str]] = Counter()  # (engine, group, result)
        self.warned: set[tuple[str, int | None, str | None]] = set()
        self._repeats: Counter[tuple[str, int | None, str | None]] = Counter()
        self._last_summary: dict[tuple[str, int | None, str | None], float] = {}
        self.judged: list[Judged] | None = [] if keep_judged else None
        self.shorts: dict[tuple[str, int], int] | None = {} if keep_judged else None
        """With ``keep_judged``: (instance, episode) -> its tokens short of E (`account`)."""
        self.first: list[Judged] = []
        """The episodes that raised a warning, in order (the tests read them)."""
        self.stalled_first: list[Judged] = []
        """The stalled requests' first stalled episodes that raised a warning, in order."""
        self._stalled: set[tuple[str, str]] = set()
        """(instance, request) judged stalled and not answered since: one warning per
        request, not per step (an answer forgets it)."""

    # ------------------------------------------------------------ instances
    def add_instance(
        self,
        instance_id: int,
        name: str,
        engine: str | None,
        dp_rank: int | None,
        directory: str | None,
        recorder: Any = None,
    ) -> None:
        import weakref

        ref = weakref.ref(recorder) if recorder is not None else None
        with self._lock:
            tag = len(self._inst).to_bytes(2, "big")
            self._inst[instance_id] = _Instance(
                name, engine or name, dp_rank, directory, ref, tag=tag
            )

    def health(self) -> list[tuple[str, int, int, int, bool]]:
        """(engine, recorder failures, rows and parts its writer did not write, whether the
        writer stopped at the disk cap) per live instance."""
        out = []
        for st in list(self._inst.values()):
            rec = st.recorder() if st.recorder is not None else None
            if rec is not None:
                stats = rec.writer.stats
                out.append(
                    (
                        st.engine,
                        rec.failures,
                        stats.dropped_rows,
                        getattr(stats, "dropped_parts", 0),
                        bool(getattr(stats, "capped", False)),
                    )
                )
        return out

    def engine(self, instance_id: int) -> str:
        return self._inst[instance_id].engine

    # --------------------------------------------------------------- stores
    def store(
        self,
        inst: int,
        seq: int,
        ts: int,
        event: str,
        req_id: str | None,
        keys: Sequence[bytes],
        ends: Sequence[int | None],
    ) -> None:
        """One store-side call's rows (the recorder's ``store`` kind)."""
        st = self._inst[inst]
        with self._lock:
            if st.open is not None and seq > st.open:
                st.pending.append(("store", (seq, ts, event, req_id, keys, ends)))
                return
            self._store(st, seq, ts, event, req_id, keys, ends)

    def _store(
        self,
        st: _Instance,
        seq: int,
        ts: int,
        event: str,
        req_id: str | None,
        keys: Sequence[bytes],
        ends: Sequence[int | None],
    ) -> None:
        if event == "reset":
            st.reset = seq
            return
        for tail, n in Counter(key_tail(k) for k in keys).items():  # per group, not key
            self.stored[(st.engine, str(tail_gid(tail)), event)] += n
            if event == "prepared":
                st.first_prep.setdefault(tail_gid(tail), seq)
        offer = event in OFFER_EVENTS
        boundary = event in STORE_OFFERS and req_id is not None and req_id in st.bounds
        anchor = self._anchor_tail
        touch, tag = self._touch, st.tag
        for key, end in zip(keys, ends, strict=True):
            rec = touch(key + tag)
            if event == "completed":
                rec.completed = seq
            elif event == "evicted":
                rec.evicted = seq
            elif event == "prepared":
                rec.prepared = seq
            elif event == "failed":
                rec.failed = seq
            elif event == "rejected":
                rec.rejected = True
            if offer and rec.offered_ts is None:
                rec.offered_ts = ts
            if boundary and end is not None and key_tail(key) == anchor:
                self._boundary_offer(st, req_id, key, end, seq)  # type: ignore[arg-type]

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
    ) -> None:
        """One tier-side call's rows (the recorder's ``tier`` kind): promotions count as
        stores into the primary, write-throughs and tier lookups as what a tier holds
        (the facts `keytrace.analysis.history` reads from a trace)."""
        st = self._inst[inst]
        with self._lock:
            self._in_flight(st, event, req_id, keys, episode)
            deferred = event in d.PROMOTION_AS_STORE or event.startswith("promotions_")
            if deferred and st.open is not None and seq > st.open:
                st.pending.append(("tier", (seq, ts, event, req_id, tier, keys, episode, result)))
                return
            self._tier(st, seq, event, req_id, tier, keys, episode, result)

    @staticmethod
    def _in_flight(
        st: _Instance,
        event: str,
        req_id: str | None,
        keys: Sequence[bytes | None],
        episode: int | None,
    ) -> None:
        """Keep the primary slots tier work holds as the rows arrive (before any episode's
        deferral: `keytrace.analysis.history.crowding` reads the rows before each one)."""
        if event == "promotion_no_room" and episode is not None:
            own = st.promoting.get(req_id, 0) if req_id is not None else 0
            writing = sum(1 for jobs in st.cascading.values() if jobs > 0)
            held = d.held_by_others(writing, sum(st.promoting.values()), own)
            st.crowd[episode] = max(st.crowd.get(episode, held), held)
            return
        step = d.IN_FLIGHT_TIER_WORK.get(event)
        if step is None:
            return
        if event.startswith("cascade"):
            for key in keys:
                if key is None:
                    continue
                # a running count, as the differ's: a settle seen before its submission
                # (a trace begun mid-flight) leaves it below zero, not clamped
                jobs = st.cascading.get(key, 0) + step
                if jobs:
                    st.cascading[key] = jobs
                else:
                    st.cascading.pop(key, None)
            return
        # a promotion row without a request counts for no request's own (as the differ
        # joins it): under "" here, which no episode's request is
        who = req_id if req_id is not None else ""
        left = st.promoting.get(who, 0) + step * sum(1 for k in keys if k is not None)
        if left:
            st.promoting[who] = left
        else:
            st.promoting.pop(who, None)

    def _tier(
        self,
        st: _Instance,
        seq: int,
        event: str,
        req_id: str | None,
        tier: int | None,
        keys: Sequence[bytes | None],
        episode: int | None,
        result: str | None,
    ) -> None:
        if event in ("promotions_held", "promotions_released"):
            st.held[event == "promotions_released"] = seq
            return
        if event == "promotion_no_room" and episode is not None:
            st.no_room.setdefault(episode, set()).update(k for k in keys if k)
            return
        if event == "promotion_evicted" and req_id is not None:
            st.promoted_out.setdefault(req_id, set()).update(k for k in keys if k)
            if episode is not None:
                st.promoted_now.setdefault(episode, set()).update(k for k in keys if k)
            return
        for key in keys:
            if key is None:
                continue
            if event in d.PROMOTION_AS_STORE:
                setattr(self._touch(key + st.tag), d.PROMOTION_AS_STORE[event], seq)
            elif event in (*d.DURABLE_EVENTS, "lookup", "tier_evicted"):
                if event == "lookup" and result != "HIT":
                    continue
                rec = self._touch(key + st.tag)
                held_gone = (rec.tiers or {}).get(tier) or [None, None]
                held_gone[event == "tier_evicted"] = seq
                rec.tiers = {**(rec.tiers or {}), tier: held_gone}

    def _boundary_offer(self, st: _Instance, req_id: str, key: bytes, end: int, seq: int) -> None:
        chunk = chunk_ending_at(end, self.anchor.tpc)
        if chunk is None:
            return
        b = st.bounds.get(req_id, {}).get(chunk)
        if b is None:
            return
        firsts = st.offers.setdefault(key, {})
        firsts.setdefault((req_id, b), seq)

    def _touch(self, tagged: bytes) -> _KeyRec:
        """The record of a key on an instance (``key + tag``), most recently touched now."""
        rec = self._keys.pop(tagged, None)
        if rec is None:
            rec = _KeyRec()
            if len(self._keys) >= self.max_records:
                self._forget()
        self._keys[tagged] = rec
        return rec

    def _forget(self) -> None:
        """Drop the least recently touched tenth of the records (and stale boundary data).

        The victims are taken in one pass: deleting from the front of a dict and asking
        ``next(iter(d))`` again rescans every deleted slot, quadratic in what is dropped."""
        victims = list(itertools.islice(self._keys, max(1, self.max_records // 10)))
        for tagged in victims:
            del self._keys[tagged]
            for st in self._inst.values():
                st.offers.pop(tagged[:-2], None)
        self.forgotten += len(victims)
        for st in self._inst.values():  # requests are many and short-lived: keep the newest
            for table in (st.bounds, st.prompt):
                extra = len(table) - self.max_records // 4
                for req in list(itertools.islice(table, max(0, extra))):
                    del table[req]

    # ------------------------------------------------------------- episodes
    def episode_begin(
        self, inst: int, req_id: str, prompt: int, spb: int | None, seq: int | None = None
    ) -> None:
        """A request's boundaries, as the store path will key them (`request_boundaries`);
        ``seq``: the episode's sequence number (store-like rows after it wait for its
        verdict, `_Instance.pending`)."""
        st = self._inst[inst]
        with self._lock:
            st.open = seq
            P = max(prompt, st.prompt.get(req_id, 0))
            st.prompt[req_id] = P
            bs = [store_boundary(self.groups, P)]
            if spb:
                bs.append(align_down(spb, self.groups))
            chunks = st.bounds.setdefault(req_id, {})
            for b in bs:
                if b > 0:
                    chunks.setdefault(d.boundary_chunk(b, self.anchor.tpc), b)

    def judge(
        self,
        inst: int,
        ep: Any,
        scans: Sequence[Any],
        unqueried: Mapping[int, Mapping[int, bytes]],
        tpc: Mapping[int, int],
        proofs: Mapping[int, Mapping[int, bytes]],
    ) -> Judged:
        """The verdict of episode ``ep`` (the recorder's `_Episode`, external set) from its
        ``scans`` (the recorder's `_Scan` objects, in call order), the keys it needed in
        groups vLLM never scanned and the proof keys listed under a candidate fix (both
        gid -> chunk -> key)."""
        st = self._inst[inst]
        with self._lock:
            for sc in scans:
                g = str(tail_gid(sc.gid_bytes))
                for result, n in sc.counts.items():
                    if n:
                        self.looked_up[(st.engine, g, result)] += n
            j = self._judge(st, ep, scans, unqueried, tpc, proofs)
            st.no_room.pop(ep.seq, None)
            st.promoted_now.pop(ep.seq, None)
            st.crowd.pop(ep.seq, None)
            st.open = None
            pending, st.pending = st.pending, []
            for kind, args in pending:
                if kind == "store":
                    self._store(st, *args)
                else:
                    seq, _ts, event, req_id, tier, keys, episode, result = args
                    self._tier(st, seq, event, req_id, tier, keys, episode, result)
            self.episodes[(st.engine, j.verdict)] += 1
            if self.judged is not None:
                self.judged.append(j)
        return j

    def expected(
        self,
        inst: int,
        ep: Any,
        scans: Sequence[Any],
        tpc: Mapping[int, int],
        unqueried: Mapping[int, Mapping[int, bytes]] | None = None,
    ) -> int | None:
        """E of an episode in progress (its scans so far, and the keys listed so far)."""
        with self._lock:
            return self._expected(self._inst[inst], ep, scans, tpc, unqueried or {})[0]

    def _judge(
        self,
        st: _Instance,
        ep: Any,
        scans: Sequence[Any],
        unqueried: Mapping[int, Mapping[int, bytes]],
        tpc: Mapping[int, int],
        proofs: Mapping[int, Mapping[int, bytes]],
    ) -> Judged:
        S, X, s = ep.local, ep.external, ep.seq
        base = {"instance": st.name, "req_id": ep.req_id, "episode": s, "S": S, "external": X}
        E, chain_P = self._expected(st, ep, scans, tpc, unqueried)
        if X is None:
            count, first = st.deferred.get(ep.req_id, (0, ep.ts))
            st.deferred[ep.req_id] = (count + 1, first)
            numbers = d.EpisodeNumbers(S=S, X=X, E=E, deferrals=count + 1, waited=ep.ts - first)
        else:
            st.deferred.pop(ep.req_id, None)
            self._stalled.discard((st.name, ep.req_id))
            numbers = d.EpisodeNumbers(S=S, X=X, E=E)
        verdict = d.base_verdict(numbers)
        if verdict != "shortfall":
            return Judged(verdict, E=E, **base)
        assert E is not None  # a shortfall has an expected boundary
        return self._shortfall(st, ep, scans, unqueried, tpc, proofs, E, chain_P, base)

    def _expected(
        self,
        st: _Instance,
        ep: Any,
        scans: Sequence[Any],
        tpc: Mapping[int, int],
        unqueried: Mapping[int, Mapping[int, bytes]],
    ) -> tuple[int | None, int | None]:
        """(E, chain_P): `keytrace.analysis.diff._expected_boundary` for one episode."""
        S, s = ep.local, ep.seq
        first_scan: dict[int, Any] = {}
        for sc in scans:
            first_scan.setdefault(tail_gid(sc.gid_bytes), sc)
        first_lead: dict[int, int | None] = {}
        if self.tiered:
            for g in self.groups:
                if g.full_attention:
                    listed = unqueried.get(g.gid, {})
                    first_lead[g.gid] = self._lead(st, g, first_scan.get(g.gid), S, listed)
        else:
            first_lead = {gid: sc.lead for gid, sc in first_scan.items()}
        F = d.resident_prefix(S, self.groups, first_lead.get)
        top = d.match_ceiling(lookup_cap(self.groups, ep.tokens, S, ep.max_new), F)
        boundaries: set[int] = set()
        chain_P: int | None = None
        anchor_keys = [k for sc in scans if sc.gid_bytes == self._anchor_tail for k in sc.keys]
        anchor_keys += unqueried.get(self.anchor.gid, {}).values()
        for key in anchor_keys:
            for (req, b), first in st.offers.get(key, {}).items():
                # always true when judged as the episode ends (nothing of this instance
                # is recorded during a lookup); kept: it is the definition (docs/diff.md)
                if first < s:
                    boundaries.add(b)
                    P = st.prompt.get(req)
                    if P is not None:
                        chain_P = P if chain_P is None else max(chain_P, P)
        chain_best = max((b for b in boundaries if d.in_reach(b, S, top)), default=None)
        standing = d.standing_boundaries(top, self.groups, self.retention)
        return d.expected_boundary(S, chain_best, standing), chain_P

    def _lead(
        self, st: _Instance, g: Group, sc: Any | None, S: int, listed: Mapping[int, bytes]
    ) -> int | None:
        """The leading chunks from S of full-attention group ``g`` resident in some tier:
        HIT in the primary or held by a secondary tier, its first scan's keys first (``sc``,
        None if the episode never scanned it), then the keys listed past where it stopped.
        None where neither reaches S's chunk or beyond, as for a group never scanned
        (`keytrace.analysis.scans.tiered_leads`)."""
        cells: dict[int, tuple[bytes, str | None]] = {}
        if sc is not None:
            for end, key, result in zip(sc.ends, sc.keys, sc.results, strict=True):
                chunk = chunk_ending_at(end, g.tpc)
                if chunk is not None:
                    cells.setdefault(chunk, (key, result))
        for chunk, key in listed.items():
            cells.setdefault(chunk, (key, None))
        first = S // g.tpc
        if not any(chunk >= first for chunk in cells):
            return None
        n, chunk = 0, first
        while chunk in cells:
            key, result = cells[chunk]
            if result != "HIT" and not self._durable(st, key):
                break
            n, chunk = n + 1, chunk + 1
        return n

    def _durable(self, st: _Instance, key: bytes) -> bool:
        """A secondary tier holds ``key`` (`keytrace.analysis.history.durable`)."""
        rec = self._keys.get(key + st.tag)
        return bool(
            rec is not None
            and rec.tiers
            and any(d.resident(held, gone) for held, gone in rec.tiers.values())
        )

    def _shortfall(
        self,
        st: _Instance,
        ep: Any,
        scans: Sequence[Any],
        unqueried: Mapping[int, Mapping[int, bytes]],
        tpc: Mapping[int, int],
        proofs: Mapping[int, Mapping[int, bytes]],
        E: int,
        chain_P: int | None,
        base: dict[str, Any],
    ) -> Judged:
        S, s, t = ep.local, ep.seq, ep.ts
        # the binding scan: the last that can bind (else the last scan), its terminal row
        bind_gid: int | None = None
        term: tuple[int, int | None, bytes, str] | None = None  # (seq, end, key, result)
        bad = [sc for sc in scans if d.binds(sc.counts["HIT"], len(sc.seqs))]
        if bad:
            sc = bad[-1]
            bind_gid = tail_gid(sc.gid_bytes)
            i = sc.term if sc.term is not None else sc.first_nonhit
            term = (sc.seqs[i], sc.ends[i], sc.keys[i], sc.results[i])
        elif scans:
            bind_gid = tail_gid(scans[-1].gid_bytes)
        # every lookup of the episode, the last by sequence number per (group, chunk)
        seen: dict[tuple[int, int], tuple[int, bytes, str]] = {}
        for sc in scans:
            gid = tail_gid(sc.gid_bytes)
            size = tpc.get(gid)
            for seq, end, key, result in zip(sc.seqs, sc.ends, sc.keys, sc.results, strict=True):
                chunk = chunk_ending_at(end, size) if size else None
                if chunk is not None:
                    seen[(gid, chunk)] = (seq, key, result)
        needed: list[tuple[int, int, bytes | None, str | None, int | None]] = []
        for g in self.groups:
            if g.full_attention and not self.tiered:  # resident by construction (E <= F)
                continue
            keyed = ep.hashes * self.tph // g.tpc
            proven = proofs.get(g.gid, {})
            lo, hi = needed_range(g, S, E, keyed + (keyed in proven))
            for chunk in range(lo, hi):
                hit = seen.get((g.gid, chunk))
                if hit is not None:
                    needed.append((g.gid, chunk, hit[1], hit[2], hit[0]))
                else:
                    needed.append((g.gid, chunk, unqueried.get(g.gid, {}).get(chunk), None, None))
        # the terminal key is the first key E needed that the binding scan did not find
        inside = [n for n in needed if n[0] == bind_gid and n[3] is not None and n[3] != "HIT"]
        if inside:
            first = min(inside, key=lambda n: (d.terminal_order(n[3]), n[4]))
            term = (
                first[4] or 0,
                (first[1] + 1) * self.by_gid[first[0]].tpc,
                first[2] or b"",
                first[3] or "",
            )
        term_chunk = None
        if term is not None and bind_gid is not None and term[1] is not None:
            size = self.by_gid[bind_gid].tpc if bind_gid in self.by_gid else tpc.get(bind_gid)
            term_chunk = chunk_ending_at(term[1], size) if size else None
        unknown = False
        total = self._needed_chunks(S, E, len(needed))
        at = _Moment(
            st,
            s,
            t,
            chain_P,
            ep.req_id,
            bool(d.fits_primary(total, self.primary_chunks)),
            bool(d.crowded(total, self.primary_chunks, st.crowd.get(s, 0))),
        )
        causes: list[tuple[int, str]] = []  # (gid, cause) in (gid, chunk) order
        for gid, chunk, key, result, _seq in needed:
            end = (chunk + 1) * self.by_gid[gid].tpc
            proof = proofs.get(gid, {}).get(chunk)
            if result == "HIT":
                cause: str | None = "resident"
            elif key is None and proof is None:
                cause, unknown = UNSEEN, True
            else:
                cause = None if key is None else self._cause(at, key, gid, end, result)
            if proof is not None and cause != "resident":
                cause = d.better_cause(cause, self._cause(at, proof, gid, end, result))
            causes.append((gid, cause or UNSEEN))
        term_cause = None
        if term is not None and term[2] and bind_gid is not None and term_chunk is not None:
            end = (term_chunk + 1) * self.by_gid[bind_gid].tpc
            term_cause = self._cause(at, term[2], bind_gid, end, term[3])
        rule = [c for _, c in causes if c in RULE_CAUSES]
        candidates = d.candidates_of(causes, bind_gid)
        decisive = d.decisive(candidates)
        term_result = term[3] if term is not None else None
        verdict = d.shortfall_verdict(d.shortfall_facts(candidates, term_result))
        if verdict == "mismatch" and not rule and (unknown or self.forgotten):
            # nothing absent: a mismatch unless a needed key is unknown here (vLLM never
            # keyed it for this request; the differ may derive it from other requests in the
            # whole trace) or a record was forgotten: then it is not known, and not warned
            verdict = "undetermined"
        if (
            verdict == "mismatch"
            and self.forgotten
            and any(c == "never_offered" or c == "not_keyable" for c in rule)
        ):
            # a forgotten record could have been this key's offer: do not cry wolf
            verdict = "undetermined"
        return Judged(
            verdict,
            E=E,
            binding_group=bind_gid,
            cause=d.shortfall_cause(decisive, term_result),
            term_chunk=term_chunk,
            term_key=term[2] if term is not None else None,
            term_result=term_result,
            term_cause=term_cause,
            decisive=tuple(decisive),
            **base,
        )

    def _needed_chunks(self, S: int, E: int, listed: int) -> int:
        """The chunks an episode needs for a hit at E, every group's (``listed`` of them in
        its needed list: full attention's too on a tiered manager), as
        `keytrace.judge.definitions.fits_primary` and `~.crowded` count them."""
        fa = (
            0
            if self.tiered
            else sum(E // g.tpc - S // g.tpc for g in self.groups if g.full_attention)
        )
        return listed + fa

    def _cause(self, at: _Moment, key: bytes, gid: int, token_end: int, result: str | None) -> str:
        """`keytrace.judge.definitions.cause` for one key at an episode, from its record
        (``result``: the episode's own lookup result for it)."""
        st, s, t, keyable_end = at.st, at.s, at.t, at.keyable_end
        rec = self._keys.get(key + st.tag)
        reset = st.reset if st.reset is not None and st.reset < s else None
        facts = d.KeyFacts(
            s=s,
            completed=rec.completed if rec else None,
            evicted=rec.evicted if rec else None,
            reset=reset,
            prepared=rec.prepared if rec else None,
            failed=rec.failed if rec else None,
            rejected=bool(rec and rec.rejected),
            other_engine=self._offered_elsewhere(st, key, t),
            sibling_stored=self._sibling_stored(st, key, gid),
            own_first_prepared=st.first_prep.get(gid),
            token_end=token_end,
            keyable_end=keyable_end,
            durable=self._durable(st, key),
            held=bool(d.resident(*st.held)),
            no_room=key in st.no_room.get(s, ()),
            own_promotion_evicted=key in st.promoted_out.get(at.req_id, ()),
            evicted_now=key in st.promoted_now.get(s, ()),
            fits=at.fits,
            crowded=at.crowded,
            unsettled=bool(d.unsettled(result)),
            unasked=result is None,
        )
        return str(d.cause(facts))

    def _offered_elsewhere(self, st: _Instance, key: bytes, t: int) -> bool:
        """Another instance's store path offered ``key`` before the wall clock ``t``."""
        for other in self._inst.values():
            r = self._keys.get(key + other.tag) if other is not st else None
            if r is not None and r.offered_ts is not None and r.offered_ts < t:
                return True
        return False

    def _sibling_stored(self, st: _Instance, key: bytes, gid: int) -> bool:
        """The block hash of ``key`` was completed under another group id on ``st``."""
        h = key_hash(key)
        for g in self.group_ids:
            if g == gid:
                continue
            sib = self._keys.get(make_key(h, g) + st.tag)
            if sib is not None and sib.completed is not None:
                return True
        return False

    # ------------------------------------------------------------- reporting
    def account(self, inst: int, judged: Judged, N: int, accepted: int | None) -> None:
        """Tokens short of E for a shortfall, once its accepted count is known (`lost`)."""
        if judged.verdict not in ("explained", "mismatch", "undetermined") or judged.E is None:
            return
        gpu, offload = d.served(judged.S, N, accepted, judged.external)
        short = d.short_of_E(judged.E, gpu, offload)
        if self.shorts is not None:
            self.shorts[(judged.instance, judged.episode)] = short
        if short:
            group = "" if judged.binding_group is None else str(judged.binding_group)
            with self._lock:
                self.short_tokens[(self.engine(inst), judged.cause or "", group)] += short

    def report(self, inst: int, j: Judged) -> None:
        """One WARNING per new (engine, group, cause) mismatch, and per engine for its first
        stalled request; repeats summarised (a stalled request counts once, not at every
        step it is deferred again)."""
        if j.verdict not in FINDINGS or not self.warn:
            return
        st = self._inst[inst]
        if j.verdict == "stalled":
            with self._lock:
                if (st.name, j.req_id) in self._stalled:
                    return
                if len(self._stalled) >= STALLED_KEPT:  # aborted ones are never answered
                    self._stalled.clear()
                self._stalled.add((st.name, j.req_id))
        what = (st.engine, j.binding_group, j.cause if j.verdict == "mismatch" else "stalled")
        with self._lock:
            if what in self.warned:
                self._repeats[what] += 1
                now = time.monotonic()
                if now - self._last_summary.get(what, 0.0) < self.interval:
                    return
                n, self._repeats[what] = self._repeats[what], 0
                self._last_summary[what] = now
                repeat = True
            else:
                self.warned.add(what)
                self._last_summary[what] = time.monotonic()
                (self.first if j.verdict == "mismatch" else self.stalled_first).append(j)
                repeat = False
        if repeat:
            _log_repeats(n, what)
            return
        log.warning("%s", self.describe(inst, j))

    def summarize_pending(self) -> None:
        """Log the repeats not yet summarised (a recorder closing: the server stopping), so
        a burst that ended inside an interval is not left to the metrics alone."""
        with self._lock:
            pending = [(what, n) for what, n in self._repeats.items() if n]
            for what, _ in pending:
                self._repeats[what] = 0
        for what, n in pending:
            _log_repeats(n, what)

    def describe(self, inst: int, j: Judged) -> str:
        """The warning's text: everything a developer needs to look, and the command."""
        st = self._inst[inst]
        if j.verdict == "stalled":
            return self._describe_stalled(st, j)
        g = self.by_gid.get(j.binding_group) if j.binding_group is not None else None
        where = f"group {j.binding_group} ({g.label})" if g else f"group {j.binding_group}"
        if g is not None and j.term_chunk is not None:
            chunk = (
                f"chunk {j.term_chunk} (tokens {j.term_chunk * g.tpc:,}-"
                f"{(j.term_chunk + 1) * g.tpc:,}), key {j.term_key.hex() if j.term_key else '?'}"
                f" ({j.term_result}, {j.term_cause})"
            )
        else:
            chunk = "every needed chunk resident"
        rank = "" if st.dp_rank is None else f", DP rank {st.dp_rank}"
        cmd = (
            f"keytrace diff {shlex.quote(shown(st.directory))} --request {shlex.quote(j.req_id)}"
            if st.directory
            else "record a trace (KEYTRACE_DIR) and run keytrace diff on it"
        )
        return (
            f"keytrace: write-only offload: request {j.req_id} on engine {st.engine}{rank} got "
            f"{j.external:,} external tokens, expected E={j.E:,} from S={j.S:,}; {where} "
            f"ended the match at {chunk}; cause {j.cause}. Stores of this key/group are not "
            f"found by lookups. Further mismatches of this group and cause are counted "
            f"(keytrace_episodes_total). Details: {cmd}"
        )

    def _describe_stalled(self, st: _Instance, j: Judged) -> str:
        rank = "" if st.dp_rank is None else f", DP rank {st.dp_rank}"
        expected = "" if j.E is None else f" (expected E={j.E:,} from S={j.S:,})"
        cmd = (
            f"keytrace diff {shlex.quote(shown(st.directory))} --request {shlex.quote(j.req_id)}"
            if st.directory
            else "record a trace (KEYTRACE_DIR) and run keytrace diff on it"
        )
        why = (
            "a tiered manager's promotions can evict the request's own prefix (keytrace "
            "docs/findings.md)"
            if self.tiered
            else "a store or load that never settles keeps it waiting"
        )
        return (
            f"keytrace: stalled lookup: request {j.req_id} on engine {st.engine}{rank} was "
            f"deferred {d.STALL_EPISODES} times in a row, or for {d.STALL_NS / 1e9:.0f} s, "
            f"and served nothing{expected}; {why}. Further stalled requests on this engine "
            f"are summarised in the log. Details: {cmd}"
        )

    def counts(self, engine: str | None = None) -> dict[str, int]:
        """Episodes by verdict, for one engine or all (the offline differ's ``counts``)."""
        out: Counter[str] = Counter()
        for (e, v), n in self.episodes.items():
            if engine is None or e == engine:
                out[v] += n
        return dict(out)

    def state_records(self) -> int:
        return len(self._keys)

    def instances(self) -> Iterable[tuple[int, str]]:
        return [(i, st.engine) for i, st in self._inst.items()]


def _log_repeats(n: int, what: tuple[str, int | None, str | None]) -> None:
    engine, group, cause = what
    if cause == "stalled":
        log.warning(
            "keytrace: %d more stalled request(s) on engine %s since the last report", n, engine
        )
        return
    log.warning(
        "keytrace: %d more write-only mismatch(es) on engine %s, group %s (%s) since the "
        "last report",
        n,
        engine,
        group,
        cause,
    )


# ------------------------------------------------------------------ process-wide
@dataclass(frozen=True)
class AlarmSettings:
    """How the alarm runs in this process (`from_env` reads the ``KEYTRACE_*`` variables)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    interval: float = DEFAULT_INTERVAL
    warn: bool = True
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    keep_judged: bool = False
    """Keep every `Judged` (tests compare them with the offline differ, episode by episode)."""

    @staticmethod
    def from_env(environ: Mapping[str, str], recording: bool) -> AlarmSettings | None:
        """None when the alarm is off: ``KEYTRACE_ALARM=0``, or neither ``KEYTRACE_ALARM=1``
        nor recording (``KEYTRACE_DIR``) asked for it."""
        flag = environ.get("KEYTRACE_ALARM", "").strip().lower()
        if flag in ("0", "false", "no", "off") or (
            not recording and flag not in ("1", "true", "yes", "on")
        ):
            return None

        def number(name: str, default: float) -> float:
            try:
                return float(environ[name]) if environ.get(name) else default
            except ValueError:
                log.warning("keytrace: ignoring %s=%r (not a number)", name, environ[name])
                return default

        port = environ.get("KEYTRACE_METRICS_PORT", "").strip()
        return AlarmSettings(
            max_bytes=int(number("KEYTRACE_ALARM_MAX_BYTES", DEFAULT_MAX_BYTES)),
            interval=number("KEYTRACE_ALARM_INTERVAL", DEFAULT_INTERVAL),
            metrics_port=int(port) if port.isdigit() else None,
            metrics_addr=environ.get("KEYTRACE_METRICS_ADDR") or "0.0.0.0",
        )


_ALARMS: dict[str, Alarm] = {}
"""One alarm per geometry in this process: schedulers of one deployment (two engines in one
process, as in the harness) share it, so a key offered by one is ``other_engine`` for the
other, as in the offline differ."""
_ALARMS_LOCK = threading.Lock()


def alarm_for(header: Mapping[str, Any], settings: AlarmSettings) -> Alarm:
    """The process's alarm for this geometry (created on first use)."""
    import json

    geometry = json.dumps(
        {
            k: v
            for k, v in header.items()
            if k in ("groups", "tokens_per_hash", "retention_interval")
        },
        sort_keys=True,
    )
    with _ALARMS_LOCK:
        alarm = _ALARMS.get(geometry)
        if alarm is None:
            alarm = _ALARMS[geometry] = Alarm(
                header,
                max_bytes=settings.max_bytes,
                interval=settings.interval,
                warn=settings.warn,
                keep_judged=settings.keep_judged,
            )
        return alarm


def alarms() -> list[Alarm]:
    with _ALARMS_LOCK:
        return list(_ALARMS.values())


def live_totals() -> tuple[dict[str, int], int]:
    """Over every alarm of this process: episodes by verdict, and warnings raised."""
    counts: Counter[str] = Counter()
    warnings = 0
    for alarm in alarms():
        counts.update(alarm.counts())
        warnings += len(alarm.first)
    return dict(counts), warnings


def forget_alarms() -> None:
    """Drop every alarm (a new recording session starts from nothing)."""
    with _ALARMS_LOCK:
        _ALARMS.clear()
