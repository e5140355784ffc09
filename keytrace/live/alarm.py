"""The live write-only alarm: judge each lookup episode as it ends, in the serving process.

The alarm is a `keytrace.record.events.Listener`: every recorder of the process hands it
its typed records (store and tier calls, episodes): those the trace keeps, so under
sampling it judges the sampled episodes, as the differ does on that trace. It keeps
what the differ would read from a trace (`keytrace.live.state`: key records, what tiers and
promotions hold; the recorder's own chain book for the intended boundaries) and, when vLLM
answers an episode, gives it the verdict `keytrace diff` would give it
(`keytrace.live.judge`, with `keytrace.judge`'s rules), counts it, and warns once per new
(engine, group, cause) mismatch (`keytrace.live.warnings`). The agreement (every field of
every episode) is tested against the offline differ on real-scheduler traffic.

Bounded memory: key records are capped by ``max_bytes`` (default 64 MiB, about 250,000
keys); the least recently touched go first. What is kept per request (deferrals, own
promotions' evictions, the judgement waiting for its accepted count) goes when vLLM
finishes the request, so a server that runs for months holds what its requests in flight
need. A shortfall that would need a forgotten key's history, or a needed key the episode
never saw, is ``undetermined``: counted, never warned about (a false alarm costs more than
a late one).

Work per store call: one dict update per key. Per episode: O(keys it looked up + needed
chunks). Nothing here calls vLLM or raises into it: the recorder counts any failure
(`keytrace.record.recorder.Recorder.fail`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from keytrace.judge import definitions as d
from keytrace.judge.definitions import FINDINGS, SHORTFALLS, Verdict
from keytrace.judge.partial import partial_block, partial_tails_on
from keytrace.judge.rules import (
    groups_from_header,
    partial_anchor_of,
    retention_of,
    trim_first_of,
)
from keytrace.live import warnings
from keytrace.live.judge import Judge
from keytrace.live.judged import Judged
from keytrace.live.state import BYTES_PER_RECORD, InstanceState, KeyStore
from keytrace.record.chain import ChainBook
from keytrace.record.events import Episode, InstanceInfo, StoreCall, TierCall

log = logging.getLogger("keytrace")

DEFAULT_MAX_BYTES = 64 << 20
"""Default cap on the alarm's key records (``KEYTRACE_ALARM_MAX_BYTES``)."""
STALLED_KEPT = 4096
"""Stalled requests remembered (so each warns once); a finished request is forgotten, and
the set is cleared should it reach this size all the same."""
DEFAULT_INTERVAL = 60.0
"""Seconds between summaries of repeated mismatches of one group and cause."""

__all__ = ["BYTES_PER_RECORD", "DEFAULT_MAX_BYTES", "Alarm", "Judged"]


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
        self.groups = groups_from_header(dict(header))
        self.by_gid = {g.gid: g for g in self.groups}
        self.tiered = bool(header.get("secondary_tiers"))
        self.interval = interval
        self.warn = warn
        self._lock = threading.Lock()
        group_ids = [int(g["group_id"]) for g in header.get("groups", [])]
        self.keys = KeyStore(max_bytes // BYTES_PER_RECORD, group_ids)
        self.judge = Judge(
            self.groups,
            group_ids,
            int(header.get("tokens_per_hash") or 1),
            self.tiered,
            header.get("cpu_num_chunks"),
            retention_of(dict(header)),
            self.keys,
            trim_first_of(dict(header)),
            header.get("secondary_tiers") or (),
        )
        if partial_tails_on(header):
            self.judge.partial_bs = partial_block(header)
            self.judge.partial_rule = partial_anchor_of(dict(header))
        self._inst: dict[int, InstanceState] = {}
        # counters, read by the Prometheus collector and the tests
        self.episodes: Counter[tuple[str, str]] = Counter()  # (engine, verdict)
        self.short_tokens: Counter[tuple[str, str, str]] = Counter()  # (engine, cause, group)
        self.looked_up: Counter[tuple[str, str, str]] = Counter()  # (engine, group, result)
        self.warned: set[warnings.Problem] = set()
        self._repeats: Counter[warnings.Problem] = Counter()
        self._last_summary: dict[warnings.Problem, float] = {}
        self.judged: list[Judged] | None = [] if keep_judged else None
        self.shorts: dict[tuple[str, int], int] | None = {} if keep_judged else None
        """With ``keep_judged``: (instance, episode) -> its tokens short of E."""
        self.first: list[Judged] = []
        """The episodes that raised a warning, in order (the tests read them)."""
        self.stalled_first: list[Judged] = []
        """The stalled requests' first stalled episodes that raised a warning, in order."""
        self._stalled: set[tuple[str, str]] = set()
        """(instance, request) judged stalled and not answered since: one warning per
        request, not per step."""

    # ----------------------------------------------------------- Listener
    def instance_started(self, info: InstanceInfo, book: object) -> None:
        assert isinstance(book, ChainBook)
        with self._lock:
            st = InstanceState(
                info.name, info.engine, info.dp_rank, info.directory, info.health, book
            )
            st.tag = len(self._inst).to_bytes(2, "big")
            self._inst[info.instance_id] = st
            self.judge.instances = tuple(self._inst.values())

    def store_called(self, inst: int, call: StoreCall) -> None:
        st = self._inst[inst]
        with self._lock:
            if st.open is not None and call.seq > st.open:
                st.pending.append(call)
                return
            self.keys.store(st, call)

    def tier_called(self, inst: int, call: TierCall) -> None:
        st = self._inst[inst]
        with self._lock:
            self.keys.in_flight(st, call)
            deferred = call.event in d.PROMOTION_AS_STORE or call.event.startswith("promotions_")
            if deferred and st.open is not None and call.seq > st.open:
                st.pending.append(call)
                return
            self.keys.tier(st, call)

    def episode_began(self, inst: int, ep: Episode) -> None:
        """Store-like rows after it wait for its verdict (`InstanceState.pending`)."""
        with self._lock:
            self._inst[inst].open = ep.seq

    def episode_ended(self, inst: int, ep: Episode) -> None:
        """Judge the episode vLLM just answered; count it and warn if it is new trouble."""
        st = self._inst[inst]
        with self._lock:
            for sc in ep.scans:
                g = str(sc.gid)
                for result, n in sc.counts.items():
                    if n:
                        self.looked_up[(st.engine, g, result)] += n
            forgotten = bool(self.keys.forgotten or st.book.forgotten)
            j = self.judge.judge(st, ep, forgotten)
            if ep.external is not None:
                self._stalled.discard((st.name, ep.req_id))
            st.no_room.pop(ep.seq, None)
            st.promoted_now.pop(ep.seq, None)
            st.crowd.pop(ep.seq, None)
            st.open = None
            pending, st.pending = st.pending, []
            for call in pending:
                if isinstance(call, StoreCall):
                    self.keys.store(st, call)
                else:
                    self.keys.tier(st, call)
            self.episodes[(st.engine, j.verdict)] += 1
            st.judged[ep.req_id] = j
            if self.judged is not None:
                self.judged.append(j)
        self.report(st, j)

    def episode_closed(self, inst: int, ep: Episode) -> None:
        """Tokens short of E for a shortfall, once its accepted count is known (`lost`)."""
        st = self._inst[inst]
        with self._lock:
            j = st.judged.pop(ep.req_id, None)
        if j is None or j.episode != ep.seq or j.E is None:
            return
        if j.verdict not in (*SHORTFALLS, Verdict.UNDETERMINED):
            return
        gpu, offload = d.served(j.S, ep.tokens, ep.accepted, j.external)
        short = d.short_of_E(j.E, gpu, offload)
        if self.shorts is not None:
            self.shorts[(j.instance, j.episode)] = short
        if short:
            group = "" if j.binding_group is None else str(j.binding_group)
            with self._lock:
                self.short_tokens[(st.engine, j.cause or "", group)] += short

    def request_finished(self, inst: int, req_id: str) -> None:
        st = self._inst[inst]
        with self._lock:
            st.forget_request(req_id)
            self._stalled.discard((st.name, req_id))

    def recorder_closed(self, inst: int) -> None:
        self.summarize_pending()

    # ------------------------------------------------------------ warnings
    def report(self, st: InstanceState, j: Judged) -> None:
        """One WARNING per new (engine, group, cause) mismatch, and per engine for its first
        stalled request; repeats summarised (a stalled request counts once, not at every
        step it is deferred again)."""
        if j.verdict not in FINDINGS or not self.warn:
            return
        if j.verdict is Verdict.STALLED:
            with self._lock:
                if (st.name, j.req_id) in self._stalled:
                    return
                if len(self._stalled) >= STALLED_KEPT:
                    self._stalled.clear()
                self._stalled.add((st.name, j.req_id))
        what = (st.engine, j.binding_group, j.cause if j.verdict is Verdict.MISMATCH else "stalled")
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
                (self.first if j.verdict is Verdict.MISMATCH else self.stalled_first).append(j)
                repeat = False
        if repeat:
            warnings.log_repeats(n, what)
            return
        log.warning("%s", self.describe(st, j))

    def describe(self, st: InstanceState, j: Judged) -> str:
        """The warning's text (`keytrace.live.warnings`)."""
        if j.verdict is Verdict.STALLED:
            return warnings.describe_stalled(st, j, self.tiered)
        g = self.by_gid.get(j.binding_group) if j.binding_group is not None else None
        return warnings.describe_mismatch(st, j, g)

    def summarize_pending(self) -> None:
        """Log the repeats not yet summarised (a recorder closing: the server stopping), so
        a burst that ended inside an interval is not left to the metrics alone."""
        with self._lock:
            pending = [(what, n) for what, n in self._repeats.items() if n]
            for what, _ in pending:
                self._repeats[what] = 0
        for what, n in pending:
            warnings.log_repeats(n, what)

    # ------------------------------------------------------------- reading
    @property
    def forgotten(self) -> int:
        """Key records dropped to stay under the cap."""
        return self.keys.forgotten

    @property
    def stored(self) -> Counter[tuple[str, str, str]]:
        """(engine, group, event) -> keys stored (a copy: the counts as of now)."""
        with self._lock:
            return Counter(self.keys.stored)

    @property
    def max_records(self) -> int:
        return self.keys.max_records

    def health(self) -> list[tuple[str, int, int, int, bool]]:
        """(engine, recorder failures, rows and parts its writer did not write, whether the
        writer stopped at the disk cap) per live instance."""
        out = []
        for st in list(self._inst.values()):
            h = st.health()
            if h is not None:
                out.append((st.engine, h.failures, h.dropped_rows, h.dropped_parts, h.capped))
        return out

    def counts(self, engine: str | None = None) -> dict[str, int]:
        """Episodes by verdict, for one engine or all (the offline differ's ``counts``)."""
        out: Counter[str] = Counter()
        for (e, v), n in self.episodes.items():
            if engine is None or e == engine:
                out[v] += n
        return dict(out)

    def state_records(self) -> int:
        return len(self.keys)

    def per_request_entries(self) -> int:
        """What is kept per request over every instance (bounded by requests in flight)."""
        return sum(st.per_request_entries() for st in self._inst.values()) + len(self._stalled)

    def engine(self, instance_id: int) -> str:
        return self._inst[instance_id].engine

    def instances(self) -> Iterable[tuple[int, str]]:
        return [(i, st.engine) for i, st in self._inst.items()]
