"""The chain book: which boundaries each request meant later lookups to hit, and which
requests offered the anchor key of each, kept as a recorder goes (``docs/diff.md``,
"Intended boundaries").

A boundary ``b`` of an earlier request ``r'`` is intended for an episode when ``r'``
offered, before it, the same anchor-group key for the chunk ending at ``b`` as the episode
looked up (keys are chained, content-addressed hashes: equal keys mean an equal prefix).
The offline differ finds these with joins over the whole trace
(`keytrace.analysis.boundaries`); a recorder needs them as each episode ends, to list the
keys a hit at each intended boundary needs where vLLM never looked them up
(`keytrace.record.recorder.Recorder.list_needed`), and the live alarm reads the same book
for E. One book per recorder instance, fed whether the alarm runs or not: what a trace
holds never depends on the alarm.

Bounded: the offers of at most ``max_offers`` (request, boundary) pairs are kept, the
oldest forgotten first (`forgotten` counts them; a forgotten boundary is one fewer listed,
and the differ derives the keys it then lacks from the whole trace). A request's own
boundaries go when vLLM finishes it.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence

from keytrace.format.keys import gid_tail, key_tail
from keytrace.judge.definitions import anchor, boundary_chunk, carried_junction
from keytrace.judge.identity import on_shared_tier
from keytrace.judge.rules import Group, store_boundary

_BOOKS: weakref.WeakSet[ChainBook] = weakref.WeakSet()
"""Every chain book of this process: the instances `ChainBook.shared_intended` can see."""

DEFAULT_MAX_OFFERS = 65_536
"""(request, boundary) offers kept per recorder: about 300 bytes each (the key, its entry
and the offer), some 20 MB at most."""


class ChainBook:
    """See the module docstring. Not thread-safe: fed and read on vLLM's scheduler thread
    (store rows and episodes are recorded there; only tier rows come from elsewhere)."""

    def __init__(self, groups: Sequence[Group], max_offers: int = DEFAULT_MAX_OFFERS) -> None:
        self.groups = list(groups)
        self.anchor = anchor(self.groups) if self.groups else None
        self._tail = gid_tail(self.anchor.gid) if self.anchor else b""
        self.max_offers = max(1, max_offers)
        self.bounds: dict[str, dict[int, int]] = {}
        """Request -> its own boundaries' anchor chunk -> boundary, while it runs."""
        self.carried: dict[str, tuple[int, int]] = {}
        """Request -> (anchor chunk, boundary) of the junction it carries now
        (`keytrace.judge.definitions.carried_junction`: each episode replaces it)."""
        self.prompt: dict[str, int] = {}
        """Request -> its prompt tokens (the longest seen), while it runs."""
        self.offers: dict[bytes, list[tuple[str, int, int, int]]] = {}
        """Anchor key -> (request, boundary, first offer's sequence number, prompt) per
        (request, boundary) that offered it, oldest first."""
        self._count = 0
        self.forgotten = 0
        """Offers dropped to stay under ``max_offers``."""
        self.shared: dict[str, int] = {}
        """The tiers this instance shares with other engines: place -> tier index
        (`keytrace.judge.identity.shared_places` of its header; `share`)."""
        self.shared_written: dict[bytes, int] = {}
        """Anchor key -> the first sequence number its write-through to a shared tier
        completed (`written`); at most ``max_offers``, the oldest forgotten first."""
        self.partial_bs = 0
        """The partial-tail block (`keytrace.judge.partial.partial_block`; 0: partial tails
        off, and no tail is noted)."""
        self.tails: dict[bytes, tuple[int, int]] = {}
        """Partial-tail key -> (its tail T, the first sequence number it was offered): every
        request's, at most ``max_offers``, the oldest forgotten first (`intended_tails`)."""
        _BOOKS.add(self)

    @property
    def anchor_tail(self) -> bytes:
        """The 4-byte group-id tail of the anchor group's keys."""
        return self._tail

    def share(self, places: Mapping[str, int]) -> None:
        """The tiers this instance shares with other engines (place -> tier index)."""
        self.shared = dict(places)

    def written(self, tier: int | None, keys: Iterable[bytes | None], seq: int) -> None:
        """A write-through of ``keys`` to ``tier`` completed (a `DURABLE_EVENTS` row): note
        each anchor key's first such write when the tier is a shared one."""
        if tier is None or tier not in self.shared.values():
            return
        for key in keys:
            if key is not None and key_tail(key) == self._tail:
                self.shared_written.setdefault(bytes(key), seq)
        if len(self.shared_written) > self.max_offers:  # bounded as the offers are
            victims = list(itertools.islice(self.shared_written, self.max_offers // 10 + 1))
            for key in victims:
                self.shared_written.pop(key, None)

    def shared_intended(self, anchor_keys: Iterable[bytes], before: int) -> set[int]:
        """The boundaries another instance of this process meant for an episode at sequence
        number ``before`` through a tier both share: one of its requests offered the
        anchor key for the boundary and the key's write-through to the shared tier
        completed, both before the episode (`keytrace.judge.identity.on_shared_tier`; the
        differ: `keytrace.analysis.boundaries.shared_boundaries`). Engines in other
        processes are not seen here."""
        out: set[int] = set()
        if not self.shared:
            return out
        keys = [bytes(k) for k in anchor_keys]
        for other in list(_BOOKS):
            if other is self or not set(other.shared) & set(self.shared):
                continue
            for key in keys:
                written = other.shared_written.get(key)
                if written is None:
                    continue
                out.update(
                    b
                    for _req, b, first, _P in other.offers.get(key, ())
                    if on_shared_tier(max(written, first), before)
                )
        return out

    def begin(
        self, req_id: str, prompt: int, junction: int | None, computed_from: int | None = None
    ) -> None:
        """An episode of ``req_id`` began (or was answered: ``computed_from``, where its
        computation begins, known): the boundaries its stores will keep tails for, its own
        (`keytrace.judge.definitions.store_boundary`; a prompt only grows) and the junction
        it carries from this episode on (`keytrace.judge.definitions.carried_junction`)."""
        if self.anchor is None:
            return
        P = max(prompt, self.prompt.get(req_id, 0))
        self.prompt[req_id] = P
        own = store_boundary(self.groups, P)
        if own > 0:
            self.bounds.setdefault(req_id, {}).setdefault(boundary_chunk(own, self.anchor.tpc), own)
        b = carried_junction(self.groups, junction, computed_from)
        if b is None:
            self.carried.pop(req_id, None)
        else:
            self.carried[req_id] = (boundary_chunk(b, self.anchor.tpc), b)

    def offered(
        self, req_id: str | None, keys: Sequence[bytes], ends: Sequence[int | None], seq: int
    ) -> None:
        """A store call of ``req_id`` offered ``keys`` (any offer event): note each
        boundary whose anchor key is among them, once, with the first such call."""
        if self.partial_bs:
            self._tails(keys, ends, seq)
        if req_id is None or self.anchor is None:
            return
        chunks = self.bounds.get(req_id, {})
        carried = self.carried.get(req_id)
        if carried is not None and carried[0] not in chunks:
            chunks = {**chunks, carried[0]: carried[1]}
        if not chunks:
            return
        tpc = self.anchor.tpc
        for chunk, b in chunks.items():
            end = (chunk + 1) * tpc
            at = -1
            while True:
                try:
                    at = ends.index(end, at + 1)
                except ValueError:
                    break
                key = keys[at]
                if key_tail(key) == self._tail:
                    self._note(bytes(key), req_id, b, seq)
                    break

    def _tails(self, keys: Sequence[bytes], ends: Sequence[int | None], seq: int) -> None:
        """Note each partial-tail key among ``keys`` (an end inside a block:
        `keytrace.judge.partial.offer_boundary`) with the first call that offered it."""
        bs = self.partial_bs
        for key, end in zip(keys, ends, strict=False):
            if key is not None and end is not None and end % bs:
                self.tails.setdefault(bytes(key), (end, seq))
        if len(self.tails) > self.max_offers:
            victims = list(itertools.islice(self.tails, self.max_offers // 10 + 1))
            for key in victims:
                self.tails.pop(key, None)
            self.forgotten += len(victims)

    def intended_tails(self, probed: Iterable[bytes], before: int) -> set[int]:
        """The partial tails intended for an episode at sequence number ``before`` that
        probed the keys ``probed``: those some request offered before it (docs/diff.md,
        "Partial tails"; the differ: `keytrace.analysis.partial_tails.chains`)."""
        out = set()
        for key in probed:
            found = self.tails.get(bytes(key))
            if found is not None and found[1] < before:
                out.add(found[0])
        return out

    def _note(self, key: bytes, req_id: str, b: int, seq: int) -> None:
        entries = self.offers.setdefault(key, [])
        if any(r == req_id and bb == b for r, bb, _, _ in entries):
            return
        entries.append((req_id, b, seq, self.prompt.get(req_id, 0)))
        self._count += 1
        if self._count > self.max_offers:
            self._forget()

    def _forget(self) -> None:
        """Drop the oldest tenth of the offers in one pass (deleting from a dict's front
        one at a time and asking for its first key again rescans every deleted slot)."""
        victims = list(itertools.islice(self.offers, max(1, len(self.offers) // 10)))
        for key in victims:
            dropped = len(self.offers.pop(key))
            self._count -= dropped
            self.forgotten += dropped

    def intended(self, anchor_keys: Iterable[bytes], before: int) -> tuple[set[int], int | None]:
        """The boundaries intended for an episode at sequence number ``before`` that looked
        up (or had listed) ``anchor_keys``, and ``chain_P``: the longest prompt of the
        requests that intended them (how far they could key chunks)."""
        bounds: set[int] = set()
        chain_P: int | None = None
        for key in anchor_keys:
            for _req, b, first, P in self.offers.get(key, ()):
                if first < before:
                    bounds.add(b)
                    chain_P = P if chain_P is None else max(chain_P, P)
        return bounds, chain_P

    def finished(self, req_id: str) -> None:
        """vLLM finished ``req_id``: it offers nothing more, so its own boundaries go (its
        offers stay, for the requests that share its prefix later)."""
        self.bounds.pop(req_id, None)
        self.carried.pop(req_id, None)
        self.prompt.pop(req_id, None)
