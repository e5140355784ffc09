"""Consistent sampling of prefix chains (``KEYTRACE_SAMPLE``). Imports no vLLM.

A sampled trace keeps every row of a deterministic fraction of *prefix chains* and nothing
else of the others, so the differ's verdicts on it equal the full trace's verdicts on those
chains (``docs/diff.md``, "Sampled traces"). Why chains and not requests or keys: vLLM's
block hashes are chained (each block's hash covers its parent's), so two requests can share
an OffloadKey only if they share their first block, and then they share its hash. Deciding
from the first block hash (`keytrace.format.keys.chain_sampled`) therefore samples every
request that can ever meet a sampled request's keys, on every engine of a fleet alike.

What is kept beyond the sampled chains' own rows, because the differ reads it across
chains (each listed in ``docs/diff.md``):

- evictions of keys the sampled chains stored (an eviction is reported with the request
  whose store made room, often of another chain): kept by key;
- ``reset`` rows and the keyless tier rows (``promotions_held``/``promotions_released``);
- the tier rows that count primary slots held by transfers in flight
  (`keytrace.format.schema.IN_FLIGHT_TIER_WORK`), for every chain: a promotion of a
  sampled request that found no room is judged by what *all* transfers held then (a
  promotion's deferred failure, ``promotion_deferred``, among them: it hands the slots it
  still holds from its request to none);
- the first ``prepared`` key of each group on the instance, whatever its chain (as a row
  of no request): the ``other_group`` cause reads when a group first reached the store path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from keytrace.format.keys import chain_sampled, key_tail, key_tails

MAX_FINISHED = 1 << 16
"""Decisions of finished requests remembered (oldest forgotten first): a store's completion
can arrive after its request finished. A request still running is never forgotten."""


class ChainSampler:
    """Which rows a sampled recorder writes (see the module docstring).

    Decisions are made per request at each lookup episode, from its first block hash; a
    request keyless so far (a prompt shorter than a block: nothing of it can be stored
    yet) is kept, and decided by its hash once it has one. A running request's decision is
    never forgotten; a finished one's is kept for `MAX_FINISHED` more requests. A request
    never seen at a lookup (vLLM looks every request up before it stores anything of it:
    only a test calling the manager directly does this) is kept: a sampled trace errs
    towards more rows, never towards a chain cut in half.
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._requests: dict[str, bool] = {}
        """Requests not finished yet -> recorded (bounded by what vLLM holds at once)."""
        self._finished: OrderedDict[str, bool] = OrderedDict()
        self._keys: set[bytes] = set()
        """Keys a sampled chain offered to the store path (so their evictions are kept)."""
        self._prepared_groups: set[bytes] = set()
        """Group-id tails of every key prepared on this instance so far, any chain."""
        self.tiered = False
        """Set by the hook for a tiered manager: a key evicted from the primary may still be
        on a secondary tier (its later rows are kept by key), so keys are never forgotten."""

    def decide(self, req_id: str, first_hash: bytes | None) -> bool:
        """Decide (again) for ``req_id`` at its lookup episode; True: record it."""
        keep = True if first_hash is None else chain_sampled(first_hash, self.fraction)
        self._requests[req_id] = keep
        self._finished.pop(req_id, None)
        return keep

    def finished(self, req_id: str) -> None:
        """``request_finished``: the decision is kept a while for late completions."""
        keep = self._requests.pop(req_id, None)
        if keep is None:
            return
        self._finished[req_id] = keep
        if len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)

    def request(self, req_id: str | None) -> bool:
        """Whether rows of ``req_id`` are recorded (an unknown request is)."""
        if req_id is None:
            return True
        keep = self._requests.get(req_id)
        if keep is None:
            keep = self._finished.get(req_id, True)
        return keep

    def stored(self, req_id: str | None, keys: Iterable[bytes]) -> bool:
        """Keys of ``req_id`` entered the primary (a store's ``prepared``, a promotion's):
        remembered when its chain is sampled, so their evictions are kept."""
        if self.request(req_id):
            self._keys.update(keys)
            return True
        return False

    def first_of_groups(self, keys: Sequence[bytes]) -> list[bytes]:
        """Of an unsampled chain's prepared keys, the first of each group no key of this
        instance was prepared in before (usually none: a list of every group seen is cheap
        to check: the call's tails are gathered in C, and only a call with a new group
        walks its keys in Python)."""
        fresh = set(key_tails(keys)).difference(self._prepared_groups)
        if not fresh:
            return []
        new: list[bytes] = []
        for k in keys:
            tail = key_tail(k)
            if tail in fresh:
                fresh.discard(tail)
                self._prepared_groups.add(tail)
                new.append(k)
        return new

    def note_prepared(self, keys: Iterable[bytes]) -> None:
        """Keys prepared on a sampled chain: their groups have reached the store path."""
        for k in keys:
            self._prepared_groups.add(key_tail(k))

    def sampled_keys(self, keys: Sequence[bytes | None]) -> list[bytes | None]:
        """Of ``keys``, those a sampled chain stored (an eviction's keys, a tier's)."""
        return [k for k in keys if k is not None and k in self._keys]

    def evicted(self, keys: Iterable[bytes | None]) -> None:
        """Keys left the primary: forgotten unless a secondary tier may still hold them."""
        if not self.tiered:
            self._keys.difference_update(keys)

    def reset(self) -> None:
        """Every key left the primary (``reset_cache``)."""
        if not self.tiered:
            self._keys.clear()


def sample_fraction(raw: str | None) -> float | None:
    """``KEYTRACE_SAMPLE`` as a fraction in (0, 1), or None for a full trace (unset, empty,
    1 or more). Raises ValueError for anything else, 0 and negatives included (the caller
    warns once and records everything: a typo never turns recording off)."""
    if raw is None or not raw.strip():
        return None
    value = float(raw)
    if not value > 0:
        raise ValueError(f"KEYTRACE_SAMPLE must be a fraction in (0, 1], got {raw!r}")
    return None if value >= 1 else value
