"""What the recorder emits: typed records of episodes, scans, store and tier calls, and the
one narrow interface (`Listener`) through which a live judge receives them.

The recorder turns hook calls into these records; the writer gets their rows, a listener
(the live alarm, `keytrace.live.alarm`) the records themselves: under sampling the same
subset the writer keeps. Nothing here imports vLLM or polars: it runs in every serving process that records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from keytrace.format.keys import key_tail, tail_gid
from keytrace.format.schema import SCAN_ENDING, LookupResult, StoreEvent, TierEvent
from keytrace.judge.rules import load_cap

DICT_GETTERS: dict[Callable[..., object], str] = {}
"""Functions known to be ``return self.<attr>.get(key)``, by that attribute's name: a
scan's end tokens are then read through the dict's own ``get`` (in C), not a Python frame
per key (about a tenth of the lookup row's cost). The layer that knows the host fills it
after comparing the function's code with that one line's
(`keytrace.vllm.hook.hooks.register_dict_getter`)."""


def direct_getter(get: Callable[[bytes], int | None]) -> Callable[[bytes], int | None]:
    """``get``, or the dict ``get`` it is known to wrap (`DICT_GETTERS`): the same answers."""
    attr = DICT_GETTERS.get(getattr(get, "__func__", None))  # type: ignore[arg-type]
    if attr is not None:
        table = getattr(getattr(get, "__self__", None), attr, None)
        if type(table) is dict:
            return table.get
    return get


class Scan:
    """One call of a per-group lookup helper (a *scan*): the raw calls in order and the
    summary the trace's scan row carries (``docs/trace-format.md``).

    While vLLM scans, a call costs three list appends (`Recorder.lookup`, the hot path);
    the end tokens and the summary are made once the scan ends (`close`), with list
    methods that run in C."""

    __slots__ = (
        "appendable",
        "counts",
        "ends",
        "episode",
        "first_nonhit",
        "gid",
        "gid_bytes",
        "keys",
        "last_hit",
        "lead",
        "position",
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
        self,
        episode: int,
        scan: int,
        req_id: str,
        gid_bytes: bytes,
        secondary: bool,
        step: int,
        position: Callable[[bytes], int | None] | None = None,
    ) -> None:
        self.episode, self.scan, self.req_id = episode, scan, req_id
        self.gid_bytes, self.secondary, self.step = gid_bytes, secondary, step
        self.gid = tail_gid(gid_bytes)
        """The group id its calls' keys end with (read per call by the judgements: kept)."""
        self.position = position
        """Key -> its end token (the request's own map, read when the scan closes)."""
        self.appendable = position is not None and not secondary
        """A later call of the same request and group is three appends, nothing else: the
        scan reads its end tokens from the request's map, and it is not a secondary tier's
        (`Recorder.open_scan`)."""
        self.ts = time.time_ns()
        self.seqs: list[int] = []
        self.ends: list[int | None] = []
        self.keys: list[bytes] = []
        self.results: list[LookupResult] = []
        self.counts: dict[LookupResult, int] = dict.fromkeys(LookupResult, 0)
        self.lead = 0
        """HITs before the first non-HIT."""
        self.last_hit: int | None = None
        self.term: int | None = None
        """Index of the first MISS or RETRY."""
        self.first_nonhit: int | None = None

    @property
    def terminal(self) -> int | None:
        """Index of the scan's terminal call: its first MISS or RETRY, else its first
        non-HIT (None: every call hit)."""
        return self.term if self.term is not None else self.first_nonhit

    def add(self, seq: int, end: int | None, key: bytes, result: LookupResult) -> None:
        """One call with its end token known (a hand-built scan); `close` summarises."""
        self.seqs.append(seq)
        self.ends.append(end)
        self.keys.append(key)
        self.results.append(result)

    def close(self) -> None:
        """The end tokens (from ``position``, where the calls did not give them) and the
        summary: counts per result, the leading HITs, the terminal call, the last HIT."""
        results = self.results
        if self.position is not None and len(self.ends) < len(self.keys):
            self.ends = list(map(direct_getter(self.position), self.keys))
            self.position = None
        n = len(results)
        for r in LookupResult:
            self.counts[r] = results.count(r)
        first = {r: results.index(r) for r in LookupResult if self.counts[r]}
        nonhit = [i for r, i in first.items() if r != LookupResult.HIT]
        self.first_nonhit = min(nonhit) if nonhit else None
        self.lead = n if self.first_nonhit is None else self.first_nonhit
        ending = [i for r, i in first.items() if r in SCAN_ENDING]
        self.term = min(ending) if ending else None
        hits = self.counts[LookupResult.HIT]
        self.last_hit = n - 1 - results[::-1].index(LookupResult.HIT) if hits else None


Listed = dict[int, dict[int, bytes]]
"""Keys listed for an episode without a lookup: group id -> chunk -> key."""


@dataclass(slots=True)
class Episode:
    """One ``get_num_new_matched_tokens`` call of a request (an *episode*): what vLLM was
    asked and answered, its scans, and the keys the recorder listed for it. The row is
    written once the accepted count is known (or cannot come)."""

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
    max_load: int | None = None
    """The request's ``max_load_tokens`` (`keytrace.judge.rules.request_limits`)."""
    max_offload: int | None = None
    """The request's ``max_offload_tokens``."""
    load_tiers: str | None = None
    """The request's ``kv_load_tiers`` (canonical JSON of the recognised entries)."""
    skip_reading: bool = False
    """The request asked not to read external KV (vLLM's ``skip_reading_prefix_cache`` /
    ``skip_reading_external_kv``): the connector answers 0 without a lookup."""

    @property
    def load_cap(self) -> int | None:
        """The request's own cap on external tokens (`keytrace.judge.rules.load_cap`)."""
        cap: int | None = load_cap(self.max_load, self.skip_reading)
        return cap

    external: int | None = None
    load_async: bool | None = None
    accepted: int | None = None
    scans: list[Scan] = field(default_factory=list)
    unqueried: Listed = field(default_factory=dict)
    """Keys a hit needs in groups (or chunks) vLLM never looked up (``SCAN_UNQUERIED``)."""
    proofs: Listed = field(default_factory=dict)
    """Proof keys under a candidate fix (``SCAN_PROOF``)."""

    def first_scans(self) -> dict[int, Scan]:
        """Group id -> the episode's first scan of it."""
        out: dict[int, Scan] = {}
        for sc in self.scans:
            out.setdefault(sc.gid, sc)
        return out

    def seen_ends(self) -> dict[int, set[int]]:
        """Group id -> the end tokens the episode looked up."""
        out: dict[int, set[int]] = {}
        for sc in self.scans:
            out.setdefault(sc.gid, set()).update(e for e in sc.ends if e is not None)
        return out


@dataclass(frozen=True, slots=True)
class StoreCall:
    """One store-side call's rows (the ``store`` kind): every key of it had ``event``."""

    seq: int
    ts: int
    event: StoreEvent
    req_id: str | None
    keys: Sequence[bytes]
    ends: Sequence[int | None]
    job_id: int | None = None


@dataclass(frozen=True, slots=True)
class TierCall:
    """One tier-side call's rows (the ``tier`` kind, schema v3). ``episode``: the lookup
    episode in progress when it was recorded, if any; ``result``: a tier lookup's answer."""

    seq: int
    ts: int
    event: TierEvent
    req_id: str | None
    tier: int | None
    keys: Sequence[bytes | None]
    ends: Sequence[int | None]
    episode: int | None
    result: LookupResult | None = None
    job_id: int | None = None


@dataclass(frozen=True)
class Health:
    """A recorder's counters, as a live judge reports them (`keytrace.live.metrics`)."""

    failures: int
    dropped_rows: int
    dropped_parts: int
    capped: bool


@dataclass(frozen=True)
class InstanceInfo:
    """Who records: one recorder instance (one scheduler and its CPU tier)."""

    instance_id: int
    name: str
    engine: str
    dp_rank: int | None
    directory: str | None
    health: Callable[[], Health | None]
    """The recorder's counters now (None once it is gone)."""


class Listener(Protocol):
    """What a live judge receives from a recorder, in the order things happened: the
    instance, then every store and tier call and every episode the trace keeps (all of
    them unless sampling: then the sampled chains' and what they are judged by, as written;
    every request's finish). Called inside vLLM's
    scheduler: a listener must be quick, and its failures are the recorder's to count
    (`keytrace.record.recorder.Recorder.fail`), never vLLM's."""

    def instance_started(self, info: InstanceInfo, book: object) -> None:
        """A recorder began; ``book``: its `keytrace.record.chain.ChainBook`."""

    def store_called(self, inst: int, call: StoreCall) -> None:
        """A store-side call was recorded."""

    def tier_called(self, inst: int, call: TierCall) -> None:
        """A tier-side call was recorded (possibly from the tiering manager's thread)."""

    def episode_began(self, inst: int, ep: Episode) -> None:
        """An episode began (its numbers known; no scan yet)."""

    def episode_ended(self, inst: int, ep: Episode) -> None:
        """vLLM answered the episode: its scans and listed keys are complete."""

    def episode_closed(self, inst: int, ep: Episode) -> None:
        """The episode's row is final (the accepted count known, or none will come)."""

    def request_finished(self, inst: int, req_id: str) -> None:
        """vLLM finished the request: what is kept for it alone may go."""

    def recorder_closed(self, inst: int) -> None:
        """The recorder closed (the server stops)."""


def group_of(key: bytes) -> int:
    """A key's group id (the `keytrace.format.keys` layout)."""
    return tail_gid(key_tail(key))
