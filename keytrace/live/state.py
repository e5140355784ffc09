"""What the live alarm keeps as a recorder's records go by: per key and recorder instance
the last sequence number of each store event, per instance what its tiers and promotions
hold. These are the facts `keytrace.analysis.history` reads from a trace; here they are
kept instead of read, in bounded memory. Nothing here judges: `keytrace.live.judge` does,
with `keytrace.judge.definitions`.

Key records live in one dict per instance, keyed by vLLM's own key objects (their hash is
computed once, by vLLM's dicts; a key concatenated with an instance tag was a new object to
hash on every touch), each in least-recently-touched order. One cap counts the records of
every instance; before a store call could take the count over it, the least recently
touched tenth goes, from each instance in proportion to its records (`KeyStore.forgotten`
counts them, and the judgement then never warns on what a forgotten record could change).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pyarrow as pa
import pyarrow.compute as pc

from keytrace.format.keys import GID_BYTES, key_hash, key_tails, make_key, tail_gid
from keytrace.format.schema import LIMIT_EVENTS, LookupResult, StoreEvent, TierEvent
from keytrace.judge import definitions as d
from keytrace.judge.rules import OFFER_EVENTS
from keytrace.live.judged import Judged
from keytrace.record.chain import ChainBook
from keytrace.record.events import Health, StoreCall, TierCall

if TYPE_CHECKING:
    from collections.abc import Callable

COUNT_BATCH = 100_000
"""Stored keys held back before `KeyStore.stored` counts them (their calls' key lists stay
alive until then: a few MB at most)."""

BYTES_PER_RECORD = 280
"""What one key record costs in CPython (its key, which the record keeps alive, the record,
the dict slot): measured with tracemalloc at 50k records (tests/unit/test_alarm.py checks
it); the margin covers the dict's growth steps."""


class KeyRecord:
    """One key's store history on one instance: last sequence number of each event."""

    __slots__ = (
        "completed",
        "evicted",
        "failed",
        "limit",
        "offered_ts",
        "prepared",
        "rejected",
        "tiers",
    )

    def __init__(self) -> None:
        self.completed: int | None = None
        self.evicted: int | None = None
        self.prepared: int | None = None
        self.failed: int | None = None
        self.rejected = False
        self.limit: tuple[int, StoreEvent] | None = None
        """(seq, event) of the key's last store event when that was a limit's
        (`keytrace.format.schema.LIMIT_EVENTS`); any later store event clears it."""
        self.offered_ts: int | None = None
        self.tiers: dict[int | None, list[int | None]] | None = None
        """A tiered manager's secondary tiers: tier -> [last seq it held the key (a
        write-through completed, or its lookup answered HIT), last seq it evicted it]."""


_SET_ON = {
    StoreEvent.COMPLETED: "completed",
    StoreEvent.EVICTED: "evicted",
    StoreEvent.PREPARED: "prepared",
    StoreEvent.FAILED: "failed",
}


@dataclass
class InstanceState:
    """Per recorder instance: what its tier and its episodes' promotions hold."""

    name: str
    engine: str
    dp_rank: int | None
    directory: str | None
    health: Callable[[], Health | None]
    book: ChainBook
    """The recorder's chain book: the intended boundaries (`keytrace.record.chain`)."""
    tag: bytes = b""
    """Names the instance's table of key records (`KeyStore`)."""
    reset: int | None = None
    first_prep: dict[int, int] = field(default_factory=dict)
    """Group id -> the first sequence number it reached the store path at."""
    deferred: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Request -> (consecutive deferred episodes, wall clock of the first of them)."""
    held: list[int | None] = field(default_factory=lambda: [None, None])
    """[last promotions_held seq, last promotions_released seq]"""
    no_room: dict[int, set[bytes]] = field(default_factory=dict)
    """Episode -> keys its lookups found on a tier with no primary slot to promote into."""
    promoted_out: dict[str, set[bytes]] = field(default_factory=dict)
    """Request -> keys its own promotions evicted from the primary (until it finishes)."""
    promoted_now: dict[int, set[bytes]] = field(default_factory=dict)
    """Episode -> keys its own lookup's promotions evicted during it (until it is judged)."""
    cascading: dict[bytes, int] = field(default_factory=dict)
    """Key -> its write-through jobs in flight, to any tier (zero counts are dropped; each
    key above zero holds one primary slot, `keytrace.judge.definitions.IN_FLIGHT_TIER_WORK`)."""
    promoting: dict[str, int] = field(default_factory=dict)
    """Request -> its promotions in flight (requests with none are dropped)."""
    crowd: dict[int, int] = field(default_factory=dict)
    """Episode -> the most primary slots other work held when its promotions found no room
    (`keytrace.judge.definitions.held_by_others`; until it is judged)."""
    open: int | None = None
    """The episode in progress (its sequence number), if any."""
    pending: list[StoreCall | TierCall] = field(default_factory=list)
    """Store-like calls recorded during the episode in progress (a tiered manager's
    promotions and the evictions they cause), applied once it is judged: the episode is
    judged on the history before it, as the differ reads it (``seq < s``)."""
    judged: dict[str, Judged] = field(default_factory=dict)
    """Request -> its last episode's judgement, until its accepted count is known."""

    def forget_request(self, req_id: str) -> None:
        """vLLM finished ``req_id``: what was kept for it alone goes."""
        self.deferred.pop(req_id, None)
        self.promoted_out.pop(req_id, None)
        self.judged.pop(req_id, None)

    def per_request_entries(self) -> int:
        """Entries kept per request (what must not grow with traffic: the soak test)."""
        return len(self.deferred) + len(self.promoted_out) + len(self.judged) + len(self.promoting)


def _new_keys(table: dict[bytes, KeyRecord], keys: Sequence[bytes]) -> int:
    """How many of ``keys`` have no record in ``table`` (asked only near the cap)."""
    return sum(1 for key in keys if key not in table)


class KeyStore:
    """Every instance's key records (see the module docstring) and the counters of what
    was stored, by engine, group and event."""

    def __init__(self, max_records: int, group_ids: Iterable[int] = ()) -> None:
        self.max_records = max(1024, max_records)
        self._tables: dict[bytes, dict[bytes, KeyRecord]] = {}
        """Instance tag -> key -> its record, least recently touched first."""
        self._count = 0
        """Records in every table (the cap's count)."""
        self.forgotten = 0
        """Key records dropped to stay under the cap."""
        self.group_ids = frozenset(group_ids)
        """The header's group ids: once an instance's store path has reached every one of
        them, a prepared call needs no per-group pass (`InstanceState.first_prep`)."""
        self._stored: Counter[tuple[str, str, str]] = Counter()
        self._uncounted: list[tuple[str, str, Sequence[bytes]]] = []
        """Store calls (engine, event, keys) not yet counted into `stored`: counted by the
        hundred thousand keys, in Arrow (a key's group from its last 4 bytes: ~1,500
        instructions per key and call in Python, on the scheduler's thread)."""
        self._uncounted_keys = 0

    def __len__(self) -> int:
        return self._count

    def _table(self, st: InstanceState) -> dict[bytes, KeyRecord]:
        table = self._tables.get(st.tag)
        if table is None:
            table = self._tables[st.tag] = {}
        return table

    def get(self, st: InstanceState, key: bytes) -> KeyRecord | None:
        table = self._tables.get(st.tag)
        return table.get(key) if table is not None else None

    def touch(self, st: InstanceState, key: bytes) -> KeyRecord:
        """The record of a key on an instance, most recently touched now."""
        table = self._table(st)
        rec = table.pop(key, None)
        if rec is None:
            if self._count >= self.max_records:
                self._forget()  # before the new record: never the record just touched
            rec = KeyRecord()
            self._count += 1
        table[key] = rec
        return rec

    def _forget(self) -> None:
        """Drop the least recently touched tenth of the cap's records, each table's in
        proportion to its share, in one pass per table (deleting from a dict's front one at
        a time and asking ``next(iter(d))`` again rescans every deleted slot: quadratic in
        what is dropped). Called before the records that would go over the cap are added,
        so a call never forgets its own keys."""
        tenth = max(1, self.max_records // 10)
        total = self._count
        for table in self._tables.values():
            share = min(len(table), -(-tenth * len(table) // total))  # rounded up
            for key in list(itertools.islice(table, share)):
                del table[key]
            self._count -= share
            self.forgotten += share

    # ------------------------------------------------------------- stores
    def store(self, st: InstanceState, call: StoreCall) -> None:
        """Apply one store call to the records (`keytrace.analysis.history`'s facts)."""
        event, seq = call.event, call.seq
        if event is StoreEvent.RESET:
            st.reset = seq
            return
        keys = call.keys
        self._uncounted.append((st.engine, event, keys))
        self._uncounted_keys += len(keys)
        if self._uncounted_keys >= COUNT_BATCH:
            self.count_stored()
        if event is StoreEvent.PREPARED and not self.group_ids <= st.first_prep.keys():
            for tail in set(key_tails(keys)):
                st.first_prep.setdefault(tail_gid(tail), seq)
        attr = _SET_ON.get(event)
        limit = (seq, event) if event in LIMIT_EVENTS else None
        offered_ts = call.ts if event in OFFER_EVENTS else None
        rejected = event is StoreEvent.REJECTED
        table, new = self._table(st), 0
        cap = self.max_records
        if self._count + len(keys) > cap and self._count + _new_keys(table, keys) > cap:
            self._forget()  # before the call's new records take the count over the cap
        # `touch` inlined: this loop runs once per stored key, the alarm's per-key work
        for key in keys:
            rec = table.pop(key, None)
            if rec is None:
                rec = KeyRecord()
                new += 1
            table[key] = rec
            rec.limit = limit
            if attr is not None:
                setattr(rec, attr, seq)
            elif rejected:
                rec.rejected = True
            if offered_ts is not None and rec.offered_ts is None:
                rec.offered_ts = offered_ts
        self._count += new

    @property
    def stored(self) -> Counter[tuple[str, str, str]]:
        """(engine, group, event) -> keys (the caller holds the alarm's lock)."""
        self.count_stored()
        return self._stored

    def count_stored(self) -> None:
        """Count the store calls not yet counted into `stored`, by group, in Arrow."""
        batches: dict[tuple[str, str], list[bytes]] = {}
        for engine, event, keys in self._uncounted:
            batches.setdefault((engine, event), []).extend(keys)
        self._uncounted, self._uncounted_keys = [], 0
        for (engine, event), keys in batches.items():
            tails = pc.value_counts(
                pc.binary_slice(pc.drop_null(pa.array(keys, pa.binary())), -GID_BYTES)
            )
            values = cast("list[bytes]", tails.field("values").to_pylist())  # no nulls left
            counts = cast("list[int]", tails.field("counts").to_pylist())
            for tail, n in zip(values, counts, strict=True):
                self._stored[(engine, str(tail_gid(tail)), event)] += n

    # -------------------------------------------------------------- tiers
    @staticmethod
    def in_flight(st: InstanceState, call: TierCall) -> None:
        """Keep the primary slots tier work holds as the calls arrive (before any
        episode's deferral: `keytrace.analysis.history.crowding` reads the rows before
        each one)."""
        event, req_id, keys, episode = call.event, call.req_id, call.keys, call.episode
        if event is TierEvent.PROMOTION_NO_ROOM and episode is not None:
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
        # joins it): under "" here, which no episode's request is; a deferred failure
        # hands its slots from its request to no request (`OWN_TIER_WORK`)
        n = sum(1 for k in keys if k is not None)
        who = req_id if req_id is not None else ""
        own = d.OWN_TIER_WORK.get(event, step)
        for holder, delta in ((who, own * n), ("", (step - own) * n)):
            if not delta:
                continue
            left = st.promoting.get(holder, 0) + delta
            if left:
                st.promoting[holder] = left
            else:
                st.promoting.pop(holder, None)

    def tier(self, st: InstanceState, call: TierCall) -> None:
        """Apply one tier call: promotions count as stores into the primary, write-throughs
        and tier lookups as what a tier holds."""
        event, keys = call.event, call.keys
        if event in (TierEvent.PROMOTIONS_HELD, TierEvent.PROMOTIONS_RELEASED):
            st.held[event is TierEvent.PROMOTIONS_RELEASED] = call.seq
            return
        if event is TierEvent.PROMOTION_NO_ROOM and call.episode is not None:
            st.no_room.setdefault(call.episode, set()).update(k for k in keys if k)
            return
        if event is TierEvent.PROMOTION_EVICTED and call.req_id is not None:
            st.promoted_out.setdefault(call.req_id, set()).update(k for k in keys if k)
            if call.episode is not None:
                st.promoted_now.setdefault(call.episode, set()).update(k for k in keys if k)
            return
        as_store = d.PROMOTION_AS_STORE.get(event)
        holds = event in (*d.DURABLE_EVENTS, TierEvent.LOOKUP, TierEvent.TIER_EVICTED)
        for key in keys:
            if key is None:
                continue
            if as_store is not None:
                setattr(self.touch(st, key), _SET_ON[as_store], call.seq)
            elif holds:
                if event is TierEvent.LOOKUP and call.result is not LookupResult.HIT:
                    continue
                rec = self.touch(st, key)
                held_gone = (rec.tiers or {}).get(call.tier) or [None, None]
                held_gone[event is TierEvent.TIER_EVICTED] = call.seq
                rec.tiers = {**(rec.tiers or {}), call.tier: held_gone}

    # -------------------------------------------------------------- facts
    def durable(self, st: InstanceState, key: bytes, excluded: Collection[int] = ()) -> bool:
        """A secondary tier holds ``key``, one not in ``excluded`` (the tiers an episode's
        ``kv_load_tiers`` kept its lookup from: `keytrace.analysis.history.durable`)."""
        rec = self.get(st, key)
        return bool(
            rec is not None
            and rec.tiers
            and any(
                d.resident(held, gone)
                for tier, (held, gone) in rec.tiers.items()
                if tier not in excluded
            )
        )

    def offered_elsewhere(
        self, st: InstanceState, key: bytes, t: int, instances: Sequence[InstanceState]
    ) -> bool:
        """Another instance's store path offered ``key`` before the wall clock ``t``."""
        for other in instances:
            r = self.get(other, key) if other is not st else None
            if r is not None and r.offered_ts is not None and r.offered_ts < t:
                return True
        return False

    def sibling_stored(
        self, st: InstanceState, key: bytes, gid: int, group_ids: Sequence[int]
    ) -> bool:
        """The block hash of ``key`` was completed under another group id on ``st``."""
        h = key_hash(key)
        for g in group_ids:
            if g == gid:
                continue
            sib = self.get(st, make_key(h, g))
            if sib is not None and sib.completed is not None:
                return True
        return False
