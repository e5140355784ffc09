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

vLLM's arithmetic comes from `keytrace.analysis.rules` (the same functions the differ runs
over polars columns); the precedence of causes and the verdict rule are written out below
in the order of `keytrace.analysis.history.causes` and `keytrace.analysis.verdict`, and the
agreement is tested episode by episode against the offline differ on real-scheduler traffic.

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

from keytrace.analysis.rules import (
    OFFER_EVENTS,
    RULE_CAUSES,
    STORE_OFFERS,
    Group,
    align_down,
    better_cause,
    lookup_cap,
    needed_range,
    store_boundary,
    unit,
)

log = logging.getLogger("keytrace")

DEFAULT_MAX_BYTES = 64 << 20
"""Default cap on the alarm's state (``KEYTRACE_ALARM_MAX_BYTES``)."""
BYTES_PER_RECORD = 280
"""What one key record costs in CPython (its tagged key, the record, the dict slot):
204 bytes measured with tracemalloc at 50k records (tests/unit/test_alarm.py checks it);
the margin covers the dict's growth steps."""
DEFAULT_INTERVAL = 60.0
"""Seconds between summaries of repeated mismatches of one group and cause."""


class _KeyRec:
    """One key's store history on one instance: last sequence number of each event."""

    __slots__ = ("completed", "evicted", "failed", "offered_ts", "prepared", "rejected")

    def __init__(self) -> None:
        self.completed: int | None = None
        self.evicted: int | None = None
        self.prepared: int | None = None
        self.failed: int | None = None
        self.rejected = False
        self.offered_ts: int | None = None


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
        from keytrace.analysis.rules import groups_from_header

        self.groups: list[Group] = groups_from_header(dict(header))
        self.by_gid = {g.gid: g for g in self.groups}
        self.anchor = next((g for g in self.groups if g.full_attention), self.groups[0])
        self._anchor_tail = self.anchor.gid.to_bytes(4, "big")
        self.group_ids = [int(g["group_id"]) for g in header.get("groups", [])]
        self.tph = int(header.get("tokens_per_hash") or 1)
        self.retention = int(header.get("retention_interval") or 0)
        self.unit = unit(self.groups)
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
        self.first: list[Judged] = []
        """The episodes that raised a warning, in order (the tests read them)."""

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

    def health(self) -> list[tuple[str, int, int]]:
        """(engine, recorder failures, rows dropped by its writer) per live instance."""
        out = []
        for st in list(self._inst.values()):
            rec = st.recorder() if st.recorder is not None else None
            if rec is not None:
                out.append((st.engine, rec.failures, rec.writer.stats.dropped_rows))
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
            if event == "reset":
                st.reset = seq
                return
            for tail, n in Counter(k[-4:] for k in keys).items():  # per group, not per key
                self.stored[(st.engine, str(int.from_bytes(tail, "big")), event)] += n
                if event == "prepared":
                    st.first_prep.setdefault(int.from_bytes(tail, "big"), seq)
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
                if boundary and end is not None and key[-4:] == anchor:
                    self._boundary_offer(st, req_id, key, end, seq)  # type: ignore[arg-type]

    def _boundary_offer(self, st: _Instance, req_id: str, key: bytes, end: int, seq: int) -> None:
        tpc = self.anchor.tpc
        if end % tpc:
            return
        b = st.bounds.get(req_id, {}).get(end // tpc - 1)
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
    def episode_begin(self, inst: int, req_id: str, prompt: int, spb: int | None) -> None:
        """A request's boundaries, as the store path will key them (`request_boundaries`)."""
        st = self._inst[inst]
        with self._lock:
            P = max(prompt, st.prompt.get(req_id, 0))
            st.prompt[req_id] = P
            bs = [store_boundary(self.groups, P)]
            if spb:
                bs.append(align_down(spb, self.groups))
            chunks = st.bounds.setdefault(req_id, {})
            for b in bs:
                if b > 0:
                    chunks.setdefault(b // self.anchor.tpc - 1, b)

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
                g = str(int.from_bytes(sc.gid_bytes, "big"))
                for result, n in sc.counts.items():
                    if n:
                        self.looked_up[(st.engine, g, result)] += n
            j = self._judge(st, ep, scans, unqueried, tpc, proofs)
            self.episodes[(st.engine, j.verdict)] += 1
            if self.judged is not None:
                self.judged.append(j)
        return j

    def expected(
        self, inst: int, ep: Any, scans: Sequence[Any], tpc: Mapping[int, int]
    ) -> int | None:
        """E of an episode in progress (its scans so far)."""
        with self._lock:
            return self._expected(self._inst[inst], ep, scans, tpc)[0]

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
        E, chain_P = self._expected(st, ep, scans, tpc)
        if X is None:
            return Judged("deferred", E=E, **base)
        if E is None:
            return Judged("cold", E=None, **base)
        if X >= E - S:
            return Judged("hit", E=E, **base)
        return self._shortfall(st, ep, scans, unqueried, tpc, proofs, E, chain_P, base)

    def _expected(
        self, st: _Instance, ep: Any, scans: Sequence[Any], tpc: Mapping[int, int]
    ) -> tuple[int | None, int | None]:
        """(E, chain_P): `keytrace.analysis.diff._expected_boundary` for one episode."""
        S, s = ep.local, ep.seq
        top = lookup_cap(self.groups, ep.tokens, S, ep.max_new)
        first_lead: dict[int, int] = {}
        for sc in scans:
            first_lead.setdefault(int.from_bytes(sc.gid_bytes, "big"), sc.lead)
        for g in self.groups:
            if g.full_attention:  # F: a group never scanned gives S
                lead = first_lead.get(g.gid)
                top = min(top, S if lead is None else (S // g.tpc + lead) * g.tpc)
        boundaries: set[int] = set()
        chain_P: int | None = None
        for sc in scans:
            if sc.gid_bytes != self._anchor_tail:
                continue
            for key in sc.keys:
                for (req, b), first in st.offers.get(key, {}).items():
                    # always true when judged as the episode ends (nothing of this instance
                    # is recorded during a lookup); kept: it is the definition (docs/diff.md)
                    if first < s:
                        boundaries.add(b)
                        P = st.prompt.get(req)
                        if P is not None:
                            chain_P = P if chain_P is None else max(chain_P, P)
        cands = [b for b in boundaries if S < b <= top]
        if self.retention > 0:
            cands.append(top // self.retention * self.retention)
        if all(g.full_attention for g in self.groups):
            cands.append(top // self.unit * self.unit)
        cands = [b for b in cands if b > S]
        return (max(cands) if cands else None), chain_P

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
        # the binding scan: the last that saw a non-HIT (else the last scan), its terminal row
        bind_gid: int | None = None
        term: tuple[int, int | None, bytes, str] | None = None  # (seq, end, key, result)
        bad = [sc for sc in scans if sc.counts["HIT"] < len(sc.seqs)]
        if bad:
            sc = bad[-1]
            bind_gid = int.from_bytes(sc.gid_bytes, "big")
            i = sc.term if sc.term is not None else sc.first_nonhit
            term = (sc.seqs[i], sc.ends[i], sc.keys[i], sc.results[i])
        elif scans:
            bind_gid = int.from_bytes(scans[-1].gid_bytes, "big")
        # every lookup of the episode, the last by sequence number per (group, chunk)
        seen: dict[tuple[int, int], tuple[int, bytes, str]] = {}
        for sc in scans:
            gid = int.from_bytes(sc.gid_bytes, "big")
            size = tpc.get(gid)
            for seq, end, key, result in zip(sc.seqs, sc.ends, sc.keys, sc.results, strict=True):
                if size and end is not None and end % size == 0:
                    seen[(gid, end // size - 1)] = (seq, key, result)
        needed: list[tuple[int, int, bytes | None, str | None, int | None]] = []
        for g in self.groups:
            if g.full_attention:
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
            first = min(inside, key=lambda n: (n[3] not in ("MISS", "RETRY"), n[4]))
            term = (
                first[4] or 0,
                (first[1] + 1) * self.by_gid[first[0]].tpc,
                first[2] or b"",
                first[3] or "",
            )
        term_chunk = None
        if term is not None and bind_gid is not None and term[1] is not None:
            size = self.by_gid[bind_gid].tpc if bind_gid in self.by_gid else tpc.get(bind_gid)
            term_chunk = term[1] // size - 1 if size and term[1] % size == 0 else None
        unknown = False
        causes: list[tuple[int, str]] = []  # (gid, cause) in (gid, chunk) order
        for gid, chunk, key, result, _seq in needed:
            end = (chunk + 1) * self.by_gid[gid].tpc
            proof = proofs.get(gid, {}).get(chunk)
            if result == "HIT":
                cause: str | None = "resident"
            elif key is None and proof is None:
                cause, unknown = "not_looked_up", True
            else:
                cause = None if key is None else self._cause(st, key, gid, s, t, end, chain_P)
            if proof is not None and cause != "resident":
                cause = better_cause(cause, self._cause(st, proof, gid, s, t, end, chain_P))
            causes.append((gid, cause or "not_looked_up"))
        term_cause = None
        if term is not None and term[2] and bind_gid is not None and term_chunk is not None:
            term_cause = self._cause(
                st,
                term[2],
                bind_gid,
                s,
                t,
                (term_chunk + 1) * self.by_gid[bind_gid].tpc,
                chain_P,
            )
        rule = [c for _, c in causes if c in RULE_CAUSES]
        absent = [(g, c) for g, c in causes if c not in ("resident", "not_looked_up")]
        binding_absent = [c for g, c in absent if g == bind_gid]
        decisive = rule or binding_absent or [c for _, c in absent]
        term_result = term[3] if term is not None else None
        if rule:
            verdict = "mismatch"
        elif term_result in ("HIT_PENDING", "RETRY") or absent:
            verdict = "explained"
        else:
            # nothing absent: a mismatch unless a needed key is unknown here (vLLM never
            # keyed it for this request; the differ may derive it from other requests in the
            # whole trace) or a record was forgotten: then it is not known, and not warned
            verdict = "undetermined" if unknown or self.forgotten else "mismatch"
        if (
            verdict == "mismatch"
            and self.forgotten
            and any(c == "never_offered" or c == "not_keyable" for c in rule)
        ):
            # a forgotten record could have been this key's offer: do not cry wolf
            verdict = "undetermined"
        if decisive:
            first_cause = decisive[0]
        elif term_result in ("HIT_PENDING", "RETRY"):
            first_cause = "in_flight"
        else:
            first_cause = "all_resident"
        return Judged(
            verdict,
            E=E,
            binding_group=bind_gid,
            cause=first_cause,
            term_chunk=term_chunk,
            term_key=term[2] if term is not None else None,
            term_result=term_result,
            term_cause=term_cause,
            decisive=tuple(decisive),
            **base,
        )

    def _cause(
        self,
        st: _Instance,
        key: bytes,
        gid: int,
        s: int,
        t: int,
        token_end: int,
        keyable_end: int | None,
    ) -> str:
        """`keytrace.analysis.history.causes` for one key at (s, t), first match wins."""
        rec = self._keys.get(key + st.tag)
        completed = evicted = prepared = failed = None
        rejected = False
        if rec is not None:
            completed, evicted, prepared, failed = (
                rec.completed,
                rec.evicted,
                rec.prepared,
                rec.failed,
            )
            rejected = rec.rejected
        reset = st.reset if st.reset is not None and st.reset < s else None
        removed = max((x for x in (evicted, reset) if x is not None), default=None)
        if completed is not None and (removed is None or completed > removed):
            return "resident"
        if (
            prepared is not None
            and (removed is None or prepared > removed)
            and (failed is None or failed < prepared)
        ):
            return "in_flight"
        if completed is not None:
            return "evicted"
        for other in self._inst.values():
            r = self._keys.get(key + other.tag) if other is not st else None
            if r is not None and r.offered_ts is not None and r.offered_ts < t:
                return "other_engine"
        if failed is not None:
            return "store_failed"
        if rejected:
            return "rejected"
        h = key[:-4]
        for g in self.group_ids:
            if g == gid:
                continue
            sib = self._keys.get(h + g.to_bytes(4, "big") + st.tag)
            if sib is not None and sib.completed is not None:
                own = st.first_prep.get(gid)
                if own is None or own >= s:
                    return "other_group"
                break
        if keyable_end is not None and token_end <= keyable_end:
            return "never_offered"
        return "not_keyable"

    # ------------------------------------------------------------- reporting
    def account(self, inst: int, judged: Judged, N: int, accepted: int | None) -> None:
        """Tokens short of E for a shortfall, once its accepted count is known (`lost`)."""
        if judged.verdict not in ("explained", "mismatch", "undetermined") or judged.E is None:
            return
        gpu = min(judged.S, N)
        got = accepted if accepted is not None else judged.external
        offload = min(got or 0, N - gpu)
        short = max(judged.E - gpu - offload, 0)
        if short:
            group = "" if judged.binding_group is None else str(judged.binding_group)
            with self._lock:
                self.short_tokens[(self.engine(inst), judged.cause or "", group)] += short

    def report(self, inst: int, j: Judged) -> None:
        """One WARNING per new (engine, group, cause) mismatch; repeats summarised."""
        if j.verdict != "mismatch" or not self.warn:
            return
        st = self._inst[inst]
        what = (st.engine, j.binding_group, j.cause)
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
                self.first.append(j)
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
            f"keytrace diff {shlex.quote(st.directory)} --request {shlex.quote(j.req_id)}"
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
