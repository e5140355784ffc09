"""The live judgement of one episode: the verdict `keytrace diff` would give it.

Every rule is `keytrace.judge`'s (the differ evaluates the same functions over polars
columns, `keytrace.analysis.diff`): E from the instance's chain book and the episode's
scans; for a shortfall the binding scan (`binding_rank`), the needed chunks
(`lists_needed`, `keyed_chunks`, `needed_range`), each chunk's cause (`chunk_cause` over
`cause`'s `KeyFacts`, gathered from `keytrace.live.state`), the terminal key
(`terminal_candidate`, `terminal_rank`), the decisive causes and the verdict. What is here
is only which records each rule reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar, overload

from keytrace.format.keys import chunk_ending_at, gid_tail, key_hash
from keytrace.format.schema import LookupResult
from keytrace.judge import definitions as d
from keytrace.judge import partial as pt
from keytrace.judge.definitions import UNSEEN, Cause, Limit, Verdict
from keytrace.judge.ops import plain_of
from keytrace.judge.rules import (
    PARTIAL_ANCHOR_COMPLETE,
    Group,
    excluded_tiers,
    lookup_cap,
    needed_range,
)
from keytrace.live.judged import Judged
from keytrace.live.state import InstanceState, KeyRecord, KeyStore
from keytrace.record.events import Episode, Scan

T = TypeVar("T")


@dataclass(frozen=True)
class _Moment:
    """An episode the causes of its keys are read at: its instance, sequence number and wall
    clock, how far its chain keyed (``keyable_end``), its request, whether its needed
    chunks fit the primary tier, and whether other work in flight crowded them out."""

    st: InstanceState
    s: int
    t: int
    keyable_end: int | None
    req_id: str
    fits: bool
    crowded: bool = False
    excluded: frozenset[int] = frozenset()
    """The secondary tiers the episode's ``kv_load_tiers`` kept its lookup from."""


@dataclass
class _Needed:
    """One needed chunk of a shortfall: its group and chunk, its key (looked up or
    listed), the episode's lookup result and call for it (None: never looked up).
    ``end``: where its key's tokens end, for a partial tail's key (None: the chunk's)."""

    gid: int
    chunk: int
    key: bytes | None
    result: LookupResult | None
    seq: int | None
    end: int | None = None


class Judge:
    """Judges episodes of one geometry on the records of a `KeyStore`."""

    def __init__(
        self,
        groups: Sequence[Group],
        group_ids: Sequence[int],
        tph: int,
        tiered: bool,
        primary_chunks: int | None,
        retention: int | None,
        keys: KeyStore,
        trim_first: bool = False,
        secondary_tiers: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.groups = list(groups)
        self.by_gid = {g.gid: g for g in self.groups}
        self.anchor = d.anchor(self.groups)
        self.group_ids = list(group_ids)
        self.tph = tph
        self.tiered = tiered
        """A tiered manager: F, residency and causes read what its tiers hold."""
        self.primary_chunks = primary_chunks
        self.retention = retention
        self.keys = keys
        self.trim_first = trim_first
        self.secondary_tiers = list(secondary_tiers)
        """The header's ``secondary_tiers`` (medium and locality: what a request's
        ``kv_load_tiers`` matches)."""
        self._excluded: dict[str, frozenset[int]] = {}
        self.partial_bs = 0
        """The partial-tail block (`keytrace.judge.partial.partial_block`; 0: partial tails
        off) and the lookup's anchor rule (`keytrace.judge.rules.partial_anchor_of`)."""
        self.partial_rule = PARTIAL_ANCHOR_COMPLETE
        """The trace's `keytrace.judge.rules.trim_first_of` (where vLLM's lookup cap takes
        off the recomputed token)."""

    # ------------------------------------------------------------------- E
    def expected(self, st: InstanceState, ep: Episode) -> tuple[int | None, int | None]:
        """(E, chain_P) of an episode (`keytrace.analysis.diff._expected_boundary`)."""
        E, chain_P, _ = self.boundaries(st, ep)
        return E, chain_P

    def boundaries(
        self, st: InstanceState, ep: Episode
    ) -> tuple[int | None, int | None, int | None]:
        """(E, chain_P, E_free) of an episode: E_free is E without the request's
        ``max_load_tokens`` (None where it asked for none; `keytrace.analysis.diff._episodes`)."""
        S = ep.local
        first = ep.first_scans()
        if self.tiered:
            lead = {
                g.gid: self._lead(st, g, first.get(g.gid), S, ep.unqueried.get(g.gid, {}))
                for g in self.groups
                if g.full_attention
            }
        else:
            lead = {gid: sc.lead for gid, sc in first.items()}
        F = d.resident_prefix(S, self.groups, lead.get)
        L = lookup_cap(self.groups, ep.tokens, S, ep.max_new, ep.load_cap, self.trim_first)
        top = d.match_ceiling(L, F)
        anchor_keys = [k for sc in ep.scans if sc.gid == self.anchor.gid for k in sc.keys]
        anchor_keys += ep.unqueried.get(self.anchor.gid, {}).values()
        boundaries, chain_P = st.book.intended(anchor_keys, ep.seq)
        boundaries |= st.book.shared_intended(anchor_keys, ep.seq)

        def best(top: Any) -> Any:
            chain_best = max((b for b in boundaries if d.in_reach(b, S, top)), default=None)
            standing = d.standing_boundaries(top, self.groups, self.retention)
            return d.expected_boundary(S, chain_best, standing, self.groups)

        E_free = None
        if ep.load_cap is not None:
            free = lookup_cap(self.groups, ep.tokens, S, ep.max_new, None, self.trim_first)
            E_free = best(d.free_ceiling(L, F, free))
        E = best(top)
        if self.partial_bs:
            E, E_free = self._partial_expected(st, ep, E, E_free, L, F)
        return E, chain_P, E_free

    def _partial_expected(
        self,
        st: InstanceState,
        ep: Episode,
        E: int | None,
        E_free: int | None,
        L: int,
        F: int | None,
    ) -> tuple[int | None, int | None]:
        """E and E_free raised to the episode's partial E (`keytrace.judge.partial`; the
        differ: `keytrace.analysis.partial_tails.with_expected`)."""
        bs, S = self.partial_bs, ep.local
        probed = [
            k
            for sc in ep.scans
            for k, end in zip(sc.keys, sc.ends, strict=True)
            if end is not None and pt.is_partial(end, bs)
        ]
        tails = st.book.intended_tails(probed, ep.seq)
        if not tails:
            return E, E_free
        top = d.match_ceiling(L, F)
        L_p = pt.partial_cap(ep.prompt, ep.hashes, self.tph, S, ep.max_new, ep.load_cap)
        E = plain_of(
            pt.expected_with_partial(E, pt.expected_partial(sorted(tails), S, top, L_p, bs))
        )
        if ep.load_cap is not None:
            free = lookup_cap(self.groups, ep.tokens, S, ep.max_new, None, self.trim_first)
            L_p_free = pt.partial_cap(ep.prompt, ep.hashes, self.tph, S, ep.max_new, None)
            free_top = plain_of(d.free_ceiling(L, F, free))
            E_p_free = pt.expected_partial(sorted(tails), S, free_top, L_p_free, bs)
            E_free = plain_of(pt.expected_with_partial(E_free, E_p_free))
        return E, E_free

    def stored_limit(self, st: InstanceState, ep: Episode) -> Limit | None:
        """The limit that kept a key the episode missed from the tier: the first scan whose
        terminal key's last store event before the episode was a limit's
        (`keytrace.judge.definitions.store_limit`; `keytrace.analysis.diff._store_limits`)."""
        for sc in ep.scans:
            i = sc.terminal
            rec = self.keys.get(st, sc.keys[i]) if i is not None else None
            if rec is not None and rec.limit is not None and rec.limit[0] < ep.seq:
                limit = d.store_limit(rec.limit[1])
                if limit is not None:
                    return Limit(limit)
        return None

    def _lead(
        self, st: InstanceState, g: Group, sc: Scan | None, S: int, listed: Mapping[int, bytes]
    ) -> int | None:
        """The leading chunks from S of full-attention group ``g`` that count toward F on a
        tiered manager (`keytrace.judge.definitions.lead_ok`), its first scan's keys first
        (``sc``, None if the episode never scanned it), then the keys listed past where it
        stopped. None where neither reaches S's chunk or beyond, as for a group never
        scanned (`keytrace.analysis.scans.tiered_leads`)."""
        cells: dict[int, tuple[bytes, LookupResult | None]] = {}
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
            cell_key, cell_result = cells[chunk]
            if not d.lead_ok(cell_result, self.keys.durable(st, cell_key)):
                break
            n, chunk = n + 1, chunk + 1
        return n

    # ------------------------------------------------------------- verdict
    def judge(self, st: InstanceState, ep: Episode, forgotten: bool) -> Judged:
        """The verdict of episode ``ep`` (vLLM has answered it). ``forgotten``: a record it
        might need was dropped to stay under the cap: a mismatch it cannot be sure of is
        then `Verdict.UNDETERMINED`."""
        S, X = ep.local, ep.external
        E, chain_P, E_free = self.boundaries(st, ep)
        stored = self.stored_limit(st, ep) if E is None else None
        if X is None:
            count, first = st.deferred.get(ep.req_id, (0, ep.ts))
            st.deferred[ep.req_id] = (count + 1, first)
            numbers = d.EpisodeNumbers(S=S, X=X, E=E, deferrals=count + 1, waited=ep.ts - first)
        else:
            st.deferred.pop(ep.req_id, None)
            numbers = d.EpisodeNumbers(S=S, X=X, E=E, E_free=E_free, stored_limit=stored)
        verdict = Verdict(plain_of(d.base_verdict(numbers)))
        if verdict is Verdict.LIMITED:
            limit = d.limit_of(E, E_free, stored, ep.skip_reading)
            return Judged(verdict, st.name, ep.req_id, ep.seq, S, E, X, limit=limit)
        if verdict is not Verdict.SHORTFALL:
            return Judged(verdict, st.name, ep.req_id, ep.seq, S, E, X)
        assert E is not None  # a shortfall has an expected boundary
        return self._shortfall(st, ep, E, chain_P, forgotten)

    def _binding(
        self, scans: Sequence[Scan]
    ) -> tuple[int | None, tuple[int, int | None, bytes, LookupResult] | None]:
        """The binding scan's group and its terminal call (seq, end, key, result), from
        `keytrace.judge.definitions.binding_rank`."""
        if not scans:
            return None, None
        ranked = max(
            enumerate(scans),
            key=lambda i_sc: d.binding_rank(
                i_sc[1].counts[LookupResult.HIT], len(i_sc[1].seqs), i_sc[0]
            ),
        )
        sc = ranked[1]
        i = sc.terminal
        if i is None:
            return sc.gid, None
        return sc.gid, (sc.seqs[i], sc.ends[i], sc.keys[i], sc.results[i])

    def _needed(self, ep: Episode, S: int, E: int) -> list[_Needed]:
        """Every needed chunk of a hit at E, in (group, chunk) order, with what the episode
        knew of it: the last lookup of it by sequence number, else its listed key. Only the
        calls of the needed groups' scans inside their needed ranges are read (a shortfall
        episode's full-attention scans, most of its calls, are not needed on a CPU tier)."""
        ranges: dict[int, tuple[int, int]] = {}
        for g in self.groups:
            if not d.lists_needed(g, self.tiered):
                continue
            plain = d.keyed_chunks(g, ep.hashes, self.tph)
            keyed = d.keyed_chunks(g, ep.hashes, self.tph, plain in ep.proofs.get(g.gid, {}))
            ranges[g.gid] = needed_range(g, S, E, keyed)
        seen: dict[tuple[int, int], tuple[int, bytes, LookupResult]] = {}
        for sc in ep.scans:
            gid = sc.gid
            if gid not in ranges:
                continue
            lo, hi = ranges[gid]
            tpc = self.by_gid[gid].tpc
            # chunk_ending_at(end) in [lo, hi), without a call per lookup: an end on a
            # chunk boundary from the end of chunk lo to the end of chunk hi - 1
            first_end, last_end = (lo + 1) * tpc, hi * tpc
            for seq, end, key, result in zip(sc.seqs, sc.ends, sc.keys, sc.results, strict=True):
                if end is not None and first_end <= end <= last_end and not end % tpc:
                    seen[(gid, end // tpc - 1)] = (seq, key, result)
        out = []
        for gid, (lo, hi) in ranges.items():
            listed = ep.unqueried.get(gid, {})
            for chunk in range(lo, hi):
                hit = seen.get((gid, chunk))
                if hit is not None:
                    out.append(_Needed(gid, chunk, hit[1], hit[2], hit[0]))
                else:
                    out.append(_Needed(gid, chunk, listed.get(chunk), None, None))
        return out

    def _probe_at(self, ep: Episode, E: int) -> list[tuple[int, bytes, LookupResult, int]]:
        """The episode's calls at boundary E (gid, key, result, seq), in call order: the
        probe of a partial E (the differ: `keytrace.analysis.partial_tails._probes_at_E`)."""
        calls = [
            (sc.gid, key, result, seq)
            for sc in ep.scans
            for seq, end, key, result in zip(sc.seqs, sc.ends, sc.keys, sc.results, strict=True)
            if end == E
        ]
        return sorted(calls, key=lambda c: c[3])

    def _partial_binding(
        self, ep: Episode, E: int, bind_gid: int | None, term: Any
    ) -> tuple[int | None, Any]:
        """The probe at a partial E binds where it has a terminal call
        (`keytrace.judge.partial.probe_terminal`); else the scans' binding stands."""
        calls = self._probe_at(ep, E)
        i = pt.probe_terminal([str(c[2]) for c in calls])
        if i is None:
            return bind_gid, term
        gid, key, result, seq = calls[i]
        return gid, (seq, E, key, result)

    def _partial_needed(self, ep: Episode, S: int, E: int, needed: list[_Needed]) -> list[_Needed]:
        """What a hit at a partial E needs (`keytrace.judge.partial.partial_needed`): the
        full-attention chunks `_needed` lists, a recurrent group's state at E's block start
        on vLLM 0.33.0, and every group's key at E (asked by the probe, or derived from the
        block hash its keys share), in (group, chunk) order as the differ sorts them."""
        bs = self.partial_bs
        chunks, _ = pt.partial_needed(self.groups, self.partial_rule, S, E, bs)
        out = [n for n in needed if not self.by_gid[n.gid].recurrent]
        for gid, rng in chunks.items():
            if not self.by_gid[gid].recurrent:
                continue
            for chunk in rng:
                seen = None
                for sc in ep.scans:
                    if sc.gid != gid:
                        continue
                    for seq, end, key, result in zip(
                        sc.seqs, sc.ends, sc.keys, sc.results, strict=True
                    ):
                        if chunk_ending_at(end, bs) == chunk:
                            seen = (seq, key, result)
                if seen is not None:
                    out.append(_Needed(gid, chunk, seen[1], seen[2], seen[0]))
                else:
                    listed = ep.unqueried.get(gid, {}).get(chunk)
                    out.append(_Needed(gid, chunk, listed, None, None))
        calls = self._probe_at(ep, E)
        asked = {c[0]: c for c in calls}
        base = key_hash(bytes(calls[0][1])) if calls else None
        at = E // self.tph - 1
        for g in self.groups:
            if g.gid in asked:
                _gid, key, result, seq = asked[g.gid]
                out.append(_Needed(g.gid, at, key, result, seq, E))
            else:
                derived = bytes(base) + gid_tail(g.gid) if base is not None else None
                out.append(_Needed(g.gid, at, derived, None, None, E))
        return sorted(out, key=lambda n: (n.gid, n.chunk))

    def _shortfall(
        self, st: InstanceState, ep: Episode, E: int, chain_P: int | None, forgotten: bool
    ) -> Judged:
        S, s = ep.local, ep.seq
        bind_gid, term = self._binding(ep.scans)
        at_tail = bool(self.partial_bs) and pt.is_partial(E, self.partial_bs)
        if at_tail:
            bind_gid, term = self._partial_binding(ep, E, bind_gid, term)
        needed = self._needed(ep, S, E)
        if at_tail:
            needed = self._partial_needed(ep, S, E, needed)
        inside = [n for n in needed if d.terminal_candidate(n.gid == bind_gid, n.result)]
        if inside:
            first = min(inside, key=lambda n: d.terminal_rank(n.result, n.seq or 0))
            term = (
                first.seq or 0,
                first.end or (first.chunk + 1) * self.by_gid[first.gid].tpc,
                first.key or b"",
                first.result,
            )  # type: ignore[assignment]
        term_chunk = None
        if term is not None and bind_gid is not None and term[1] is not None:
            g = self.by_gid.get(bind_gid)
            term_chunk = chunk_ending_at(term[1], g.tpc) if g is not None else None
            if at_tail and term[1] == E:  # a key at the tail: its chunk of h tokens
                term_chunk = E // self.tph - 1
        total = d.needed_total(len(needed), S, E, self.groups, self.tiered)
        at = _Moment(
            st,
            s,
            ep.ts,
            chain_P,
            ep.req_id,
            bool(d.fits_primary(total, self.primary_chunks)),
            bool(d.crowded(total, self.primary_chunks, st.crowd.get(s, 0))),
            self.excluded(ep.load_tiers),
        )
        unknown = False
        causes: list[tuple[int, Cause]] = []
        known_causes: dict[tuple[bytes, int, int | None, LookupResult | None], Cause] = {}

        def cause_of(key: bytes, gid: int, end: int | None, result: LookupResult | None) -> Cause:
            """`cause`, once per key and moment (the terminal key is a needed one too)."""
            found = known_causes.get((key, gid, end, result))
            if found is None:
                found = known_causes[(key, gid, end, result)] = self.cause(
                    at, key, gid, end, result
                )
            return found

        for n in needed:
            tpc = self.by_gid[n.gid].tpc
            end = n.end or (n.chunk + 1) * tpc
            # the key's cause, asked for only where chunk_cause reads it (not for a HIT)
            key_cause = partial(cause_of, n.key, n.gid, end, n.result) if n.key else None
            # the alarm sees no other request's records: no key is settled as unoffered
            recurrent = self.by_gid[n.gid].recurrent
            cause = Cause(
                d.chunk_cause(n.result, n.key is not None, False, False, key_cause, recurrent)
            )
            proof = ep.proofs.get(n.gid, {}).get(n.chunk)
            if proof is not None and cause is not Cause.RESIDENT:
                cause = Cause(d.better_cause(cause, cause_of(proof, n.gid, end, n.result)))
            unknown = unknown or cause is UNSEEN
            causes.append((n.gid, cause))
        term_cause = None
        if term is not None and term[2] and bind_gid is not None and term_chunk is not None:
            end = (term_chunk + 1) * self.by_gid[bind_gid].tpc
            if at_tail and term[1] == E:
                end = E
            term_cause = cause_of(term[2], bind_gid, end, term[3])
        elif self.partial_bs and term is not None and term[2] and bind_gid is not None:
            # the binding scan ended at a probe of another tail (no chunk): the differ
            # reads its key's cause with no chunk end, and so does the alarm
            term_cause = cause_of(term[2], bind_gid, None, term[3])
        rule = [c for _, c in causes if c in d.RULE_CAUSES]
        candidates = d.candidates_of(causes, bind_gid)
        decisive = d.decisive(candidates)
        term_result = term[3] if term is not None else None
        verdict = Verdict(plain_of(d.shortfall_verdict(d.shortfall_facts(candidates, term_result))))
        if verdict is Verdict.MISMATCH and not rule and (unknown or forgotten):
            # nothing absent: a mismatch unless a needed key is unknown here (vLLM never
            # keyed it for this request; the differ may derive it from other requests in the
            # whole trace) or a record was forgotten: then it is not known, and not warned
            verdict = Verdict.UNDETERMINED
        if (
            verdict is Verdict.MISMATCH
            and forgotten
            and any(
                c in (Cause.NO_CHECKPOINT, Cause.NEVER_OFFERED, Cause.NOT_KEYABLE) for c in rule
            )
        ):
            # a forgotten record could have been this key's offer: do not cry wolf
            verdict = Verdict.UNDETERMINED
        return Judged(
            verdict,
            st.name,
            ep.req_id,
            s,
            S,
            E,
            ep.external,
            binding_group=bind_gid,
            cause=Cause(d.shortfall_cause(decisive, term_result)),
            term_chunk=term_chunk,
            term_key=term[2] if term is not None else None,
            term_result=term_result,
            term_cause=term_cause,
            decisive=tuple(decisive),
            limit=d.limit_of_causes(decisive) if verdict is Verdict.LIMITED else None,
        )

    def cause(
        self,
        at: _Moment,
        key: bytes,
        gid: int,
        token_end: int | None,
        result: LookupResult | None,
    ) -> Cause:
        """`keytrace.judge.definitions.cause` of one key at an episode, from its record
        (``result``: the episode's own lookup result for it). The facts that read more
        than the key's own record are gathered only when `cause`'s table reaches them
        (`_Facts`): most needed keys are settled by their record's first tests."""
        rec = self.keys.get(at.st, key)
        return Cause(plain_of(d.cause(_Facts(self, at, key, gid, token_end, result, rec))))

    def excluded(self, load_tiers: str | None) -> frozenset[int]:
        """The secondary tiers a request's ``kv_load_tiers`` keeps its lookup from
        (`keytrace.judge.rules.excluded_tiers`), once per distinct filter."""
        if load_tiers is None:
            return frozenset()
        found = self._excluded.get(load_tiers)
        if found is None:
            found = frozenset(excluded_tiers(load_tiers, self.secondary_tiers))
            if len(self._excluded) < 1024:
                self._excluded[load_tiers] = found
        return found

    instances: Sequence[InstanceState] = ()
    """Every instance of the alarm (set by it): ``other_engine`` reads their records."""


class _lazy(Generic[T]):
    """A fact computed at its first read and kept in the instance's ``__dict__`` (which
    then answers every later read): `functools.cached_property` without the lock Python
    3.11 takes on each first read (a third of a shortfall's fact gathering)."""

    def __init__(self, compute: Callable[[Any], T]) -> None:
        self.compute = compute
        self.name = compute.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _lazy[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T | _lazy[T]:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.compute(obj)
        return value


class _Facts(d.KeyFacts):
    """`keytrace.judge.definitions.KeyFacts` of one key at an episode, for `Judge.cause`:
    the key record's own facts set at once, the others (another engine's offers, a
    sibling group's stores, the secondary tiers, the episode's promotions) read from the
    records the first time `keytrace.judge.definitions.cause` asks for them. The same
    facts, so the same cause: only fewer of them gathered."""

    _judge: Judge
    _at: _Moment
    _key: bytes
    _gid: int

    def __init__(
        self,
        judge: Judge,
        at: _Moment,
        key: bytes,
        gid: int,
        token_end: int | None,
        result: LookupResult | None,
        rec: KeyRecord | None,
    ) -> None:
        st, s = at.st, at.s
        g = judge.by_gid.get(gid)
        # the frozen dataclass's fields, set as its __init__ would (without a
        # `object.__setattr__` call per field)
        self.__dict__.update(
            s=s,
            completed=rec.completed if rec else None,
            evicted=rec.evicted if rec else None,
            reset=st.reset if st.reset is not None and st.reset < s else None,
            prepared=rec.prepared if rec else None,
            failed=rec.failed if rec else None,
            rejected=bool(rec and rec.rejected),
            own_first_prepared=st.first_prep.get(gid),
            token_end=token_end,
            keyable_end=at.keyable_end,
            recurrent=g.recurrent if g is not None else False,
            fits=at.fits,
            crowded=at.crowded,
            unsettled=bool(d.unsettled(result)),
            unasked=result is None,
            # what the lazy facts read: in the same update (an attribute set on a frozen
            # dataclass's subclass is a Python call of its generated ``__setattr__``)
            _judge=judge,
            _at=at,
            _key=key,
            _gid=gid,
        )

    @_lazy
    def other_engine(self) -> bool:
        j, at = self._judge, self._at
        return j.keys.offered_elsewhere(at.st, self._key, at.t, j.instances)

    @_lazy
    def sibling_stored(self) -> bool:
        j = self._judge
        return j.keys.sibling_stored(self._at.st, self._key, self._gid, j.group_ids)

    @_lazy
    def durable(self) -> bool:
        return self._judge.keys.durable(self._at.st, self._key, self._at.excluded)

    @_lazy
    def excluded(self) -> bool:
        at, keys = self._at, self._judge.keys
        return (
            bool(at.excluded)
            and keys.durable(at.st, self._key)
            and not keys.durable(at.st, self._key, at.excluded)
        )

    @_lazy
    def held(self) -> bool:
        return bool(d.resident(*self._at.st.held))

    @_lazy
    def no_room(self) -> bool:
        return self._key in self._at.st.no_room.get(self._at.s, ())

    @_lazy
    def own_promotion_evicted(self) -> bool:
        return self._key in self._at.st.promoted_out.get(self._at.req_id, ())

    @_lazy
    def evicted_now(self) -> bool:
        return self._key in self._at.st.promoted_now.get(self._at.s, ())
