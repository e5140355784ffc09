"""Trace format: row kinds, their Arrow schemas per version, and the Parquet metadata keys.

A trace is a set of closed Parquet *parts*. Every part holds rows of exactly one *kind*
and carries, in its Parquet key-value metadata:

- ``keytrace.schema_version``: the integer below, checked on every read;
- ``keytrace.kind``: the row kind, so the reader never guesses from file names;
- ``keytrace.header``: the geometry/config header as canonical JSON (identical for every
  part recorded against the same configuration, whatever process wrote it);
- ``keytrace.source``: JSON naming the process that wrote it (instance, host, pid, engine).

``docs/trace-format.md`` is the human description; this module is the source of truth.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 5
"""What this keytrace writes. Bump on any incompatible change; keep a tiny trace of each
version under tests/data/. Readable: `READABLE_VERSIONS`."""

READABLE_VERSIONS = (1, 2, 3, 4, 5)
"""v1: one lookup row per manager.lookup call and a separate ``episode`` kind. v2: one lookup
row per scan (summary + raw lists), episodes and unqueried needed keys in the lookup kind.
v3: v2 plus the ``tier`` kind (what a tiered offloading manager does below its public
methods: secondary-tier lookups, promotions, write-through jobs) and the header's tier
layout; a v2 trace reads as a v3 trace with no tier rows. v4: v3 plus what a request asked of
the offloading connector (the episode row's ``max_load_tokens``, ``max_offload_tokens`` and
``kv_load_tiers``, the recognised ``kv_transfer_params`` keys, and ``skip_reading_kv``) and the store events
``withheld`` and ``filtered`` (a request's own ``max_offload_tokens``, the manager's
``store_threshold``); a v3 trace reads with those columns null. v5: v4 plus the tier
events ``promotion_deferred`` and ``deferred_released`` (vLLM 0.34.0's deferred release of a
failed promotion's slots); a v4 trace reads as a v5 trace with none."""

META_VERSION = b"keytrace.schema_version"
META_KIND = b"keytrace.kind"
META_HEADER = b"keytrace.header"
META_SOURCE = b"keytrace.source"
META_KEYTRACE_VERSION = b"keytrace.version"
META_FLUSH = b"keytrace.flush"
"""The flush a part was written by (`flush_manifest`): the writer's flush generation and,
for every kind that flush wrote, its row count and sequence range. Every part of a flush
carries the whole manifest, so whichever parts survive a kill name the ones that did not.
Optional: parts written before it existed, and compacted files, carry none."""
META_INCOMPLETE = b"keytrace.incomplete"
"""On a compacted file: what the trace it was compacted from was known to lack (JSON list
of strings), so compaction never turns a torn trace into a clean-looking one."""

FLUSH_ORDER: tuple[str, ...] = ("store", "tier", "load", "step", "lookup", "episode")
"""The order a flush writes its parts in. Stores first: a lookup without the stores it
depends on would read as a false ``never_offered`` mismatch, while stores without their
lookups only shrink the evidence; so a kill between two parts of a flush leaves the less
misleading half. The manifest names the missing half either way."""


def flush_manifest(gen: int, kinds: Mapping[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The manifest of flush ``gen``: kind -> (rows, first seq, last seq)."""
    return {
        "gen": gen,
        "kinds": {k: {"rows": r, "seq": [lo, hi]} for k, (r, lo, hi) in sorted(kinds.items())},
    }


KINDS: tuple[str, ...] = ("store", "lookup", "episode", "load", "step", "tier")
"""Every kind any version uses (v2 has no ``episode`` kind: episodes are lookup rows; only
v3 has ``tier``)."""


class LookupResult(StrEnum):
    """vLLM's ``LookupResult`` names. Recorded verbatim: a HIT_PENDING is never a MISS.
    Members are strings (``LookupResult.HIT == "HIT"``): traces and JSON carry the names."""

    MISS = "MISS"
    HIT = "HIT"
    HIT_PENDING = "HIT_PENDING"
    RETRY = "RETRY"


LOOKUP_RESULTS: tuple[LookupResult, ...] = tuple(LookupResult)
"""Every lookup result, in the order of the trace's enum type."""
SCAN_ENDING: tuple[LookupResult, ...] = (LookupResult.MISS, LookupResult.RETRY)
"""Results that end a scan's run of hits: a scan's *terminal* key is its first of these,
else its first non-HIT (the recorder's ``term_*`` summary; the differ and the alarm rank a
binding scan's keys the same way, `keytrace.judge.definitions.terminal_rank`)."""
NOT_SETTLED: tuple[LookupResult, ...] = (LookupResult.HIT_PENDING, LookupResult.RETRY)
"""Results that say the store had not finished: a shortfall whose binding key was one is
timing, not a rule bug (`keytrace.judge.definitions.unsettled`)."""


class StoreEvent(StrEnum):
    """What the store path did with a key (the ``store`` kind's ``event``)."""

    PREPARED = "prepared"
    """Offered to prepare_store and newly allocated: the key will be written."""
    REJECTED = "rejected"
    """Offered; prepare_store returned an output without it (already present, pending
    elsewhere, or filtered by store_threshold)."""
    FAILED = "failed"
    """Offered; prepare_store returned None (allocation failure), or the store job was
    completed with success=False."""
    COMPLETED = "completed"
    """complete_store(success=True): the key is resident and ready."""
    EVICTED = "evicted"
    """Returned in PrepareStoreOutput.evicted_keys: the key left the tier."""
    RESET = "reset"
    """manager.reset_cache(): every key left the tier (key is null)."""
    FILTERED = "filtered"
    """(schema v4) Beside its ``rejected`` row: the key was declined because the manager's
    admission filter (``store_threshold``) had not seen it offered often enough. Not an
    offer of its own."""
    WITHHELD = "withheld"
    """(schema v4) The first chunk of a group its request's ``max_offload_tokens`` keeps
    from the store path (the chunk that would cross the cap): never offered, by request.
    Not an offer."""


LIMIT_EVENTS: tuple[StoreEvent, ...] = (StoreEvent.FILTERED, StoreEvent.WITHHELD)
"""Store events that say a key was not stored because something asked so (the request's
``max_offload_tokens``, the spec's ``store_threshold``): annotations, never offers."""


STORE_EVENTS: tuple[StoreEvent, ...] = tuple(StoreEvent)
OFFERED_EVENTS: tuple[StoreEvent, ...] = (
    StoreEvent.PREPARED,
    StoreEvent.REJECTED,
    StoreEvent.FAILED,
)
"""Each offered key gets exactly one outcome row; "offered" is the union of outcomes."""

LOAD_EVENTS: tuple[str, ...] = ("prepared", "completed")


class TierEvent(StrEnum):
    """What a tiered manager did below its public methods (the ``tier`` kind, schema v3):
    one row per key, none for the promotion hold and release."""

    LOOKUP = "lookup"
    """A secondary tier answered a lookup the primary missed (``result``)."""
    PEER_LOOKUP = "peer_lookup"
    """A lookup a secondary tier made for a peer, through its parent."""
    PROMOTION_PREPARED = "promotion_prepared"
    """A primary slot taken for a key found on ``tier``."""
    PROMOTION_NO_ROOM = "promotion_no_room"
    """The primary had no slot: the lookup answered MISS."""
    PROMOTION_EVICTED = "promotion_evicted"
    """A key the primary evicted to make room for a promotion."""
    PROMOTION_COMPLETED = "promotion_completed"
    """The promoted key is readable in the primary."""
    PROMOTION_FAILED = "promotion_failed"
    """The load from ``tier`` failed: the slot is freed."""
    PROMOTION_DEFERRED = "promotion_deferred"
    """The load from ``tier`` failed while the tier may still write the slot (v5; vLLM
    0.34.0's deferred release): the key left the primary, its slot stays held."""
    DEFERRED_RELEASED = "deferred_released"
    """The slot of a ``promotion_deferred`` key is free again (v5)."""
    CASCADE_SUBMITTED = "cascade_submitted"
    """A write-through (or request-level cascade) job to ``tier``."""
    CASCADE_COMPLETED = "cascade_completed"
    """``tier`` holds the keys."""
    CASCADE_FAILED = "cascade_failed"
    CASCADE_DROPPED = "cascade_dropped"
    """Back-pressure dropped the write-through to ``tier``."""
    TIER_EVICTED = "tier_evicted"
    """``tier`` reported it no longer holds the key."""
    PROMOTIONS_HELD = "promotions_held"
    """reset_cache: lookups answer MISS for secondary keys until released."""
    PROMOTIONS_RELEASED = "promotions_released"
    """on_reset_flushed."""


TIER_EVENTS: tuple[TierEvent, ...] = tuple(TierEvent)

_STR = pa.dictionary(pa.int32(), pa.string())

COMMON_FIELDS: tuple[pa.Field[Any], ...] = (
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("ts_ns", pa.int64(), nullable=False),
    pa.field("instance", _STR, nullable=False),
    pa.field("instance_id", pa.int64(), nullable=False),
    pa.field("engine_id", _STR),
    pa.field("dp_rank", pa.int32()),
    pa.field("pid", pa.int32(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
)
"""Columns every row carries. ``instance_id`` is a random 63-bit id of the recorder instance
(the integer twin of ``instance``, so fleet-scale joins never hash strings). ``seq`` is one per-process counter shared by all kinds and
incremented once per recorded call, so "before/after" between any two rows of one process is
decidable; rows produced by one call share its ``seq``. ``step`` counts
``build_connector_meta`` calls seen by this scheduler instance."""

_KIND_FIELDS: dict[str, tuple[pa.Field[Any], ...]] = {
    "store": (
        pa.field("event", _STR, nullable=False),
        pa.field("req_id", _STR),
        pa.field("group_id", pa.int32()),
        pa.field("chunk_idx", pa.int64()),
        pa.field("end_token", pa.int64()),
        pa.field("key", pa.binary()),
        pa.field("job_id", pa.int64()),
    ),
    "lookup": (
        pa.field("episode", pa.int64(), nullable=False),
        pa.field("scan", pa.int32(), nullable=False),
        pa.field("req_id", _STR),
        pa.field("group_id", pa.int32(), nullable=False),
        pa.field("chunk_idx", pa.int64()),
        pa.field("end_token", pa.int64()),
        pa.field("key", pa.binary(), nullable=False),
        pa.field("result", _STR, nullable=False),
        pa.field("secondary", pa.bool_(), nullable=False),
    ),
    "episode": (
        pa.field("episode", pa.int64(), nullable=False),
        pa.field("req_id", _STR, nullable=False),
        pa.field("local_tokens", pa.int64(), nullable=False),
        pa.field("external_tokens", pa.int64()),  # null: deferred (vLLM returned None)
        pa.field("load_async", pa.bool_()),
        pa.field("accepted_tokens", pa.int64()),  # null: update_state_after_alloc not seen
        pa.field("num_prompt_tokens", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("num_hashes", pa.int64(), nullable=False),
        pa.field("max_new_tokens", pa.int64()),
    ),
    "load": (
        pa.field("event", _STR, nullable=False),
        pa.field("req_id", _STR),
        pa.field("group_id", pa.int32()),
        pa.field("chunk_idx", pa.int64()),
        pa.field("end_token", pa.int64()),
        pa.field("key", pa.binary()),
    ),
    "step": (
        pa.field("req_id", _STR, nullable=False),
        pa.field("computed_tokens", pa.int64(), nullable=False),
        pa.field("scheduled_tokens", pa.int64(), nullable=False),
        pa.field("num_prompt_tokens", pa.int64()),
        pa.field("num_tokens", pa.int64()),
        pa.field("finished", pa.bool_(), nullable=False),
        pa.field("preempted", pa.bool_(), nullable=False),
        pa.field("resumed", pa.bool_(), nullable=False),
    ),
}

V1_SCHEMAS: dict[str, pa.Schema] = {
    kind: pa.schema(COMMON_FIELDS + fields) for kind, fields in _KIND_FIELDS.items()
}
"""Arrow schema of each row kind in trace format v1 (read, never written)."""

SCAN_EPISODE = -1
"""``scan`` of the one lookup row per episode that carries the episode's facts."""
SCAN_UNQUERIED = -2
"""``scan`` of a row listing keys the episode needed in a group vLLM never scanned."""
SCAN_PROOF = -3
"""``scan`` of a row listing *proof keys*: under a candidate fix that lets a lookup accept a
second key for a chunk (``eagle_proof_key``: an EAGLE peek proven by the chain hash and the
next token), the keys that would have served for the chunks an episode needed."""
HEAD = 64
"""Raw entries of a scan kept in its ``head_*`` lists; the rest go to ``tail_*``. vLLM
starts every scan where a hit would end, so what a verdict needs is at the head."""


def _raw(prefix: str) -> tuple[pa.Field[Any], ...]:
    return (
        pa.field(f"{prefix}_seqs", pa.list_(pa.int64())),
        pa.field(f"{prefix}_end_tokens", pa.list_(pa.int64())),
        pa.field(f"{prefix}_chunks", pa.list_(pa.int64())),
        pa.field(f"{prefix}_keys", pa.list_(pa.binary())),
        pa.field(f"{prefix}_results", pa.list_(pa.string())),
    )


_LOOKUP_V2: tuple[pa.Field[Any], ...] = (
    pa.field("episode", pa.int64(), nullable=False),
    pa.field("scan", pa.int32(), nullable=False),
    pa.field("req_id", _STR),
    pa.field("group_id", pa.int32()),
    pa.field("secondary", pa.bool_()),
    # the episode (scan == -1): a get_num_new_matched_tokens call
    pa.field("local_tokens", pa.int64()),
    pa.field("external_tokens", pa.int64()),  # null: deferred (vLLM returned None)
    pa.field("load_async", pa.bool_()),
    pa.field("accepted_tokens", pa.int64()),  # null: update_state_after_alloc not seen
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("num_tokens", pa.int64()),
    pa.field("num_hashes", pa.int64()),
    pa.field("max_new_tokens", pa.int64()),
    pa.field("shared_prefix_boundary", pa.int64()),
    # a scan (scan >= 0): one call of a per-group lookup helper, in call order
    pa.field("n_keys", pa.int32()),
    pa.field("n_hit", pa.int32()),
    pa.field("n_pending", pa.int32()),
    pa.field("n_retry", pa.int32()),
    pa.field("n_miss", pa.int32()),
    pa.field("lead_hits", pa.int32()),
    pa.field("term_pos", pa.int32()),
    pa.field("term_seq", pa.int64()),
    pa.field("term_end_token", pa.int64()),
    pa.field("term_chunk", pa.int64()),
    pa.field("term_key", pa.binary()),
    pa.field("term_result", _STR),
    pa.field("last_hit_seq", pa.int64()),
    pa.field("last_hit_end_token", pa.int64()),
    pa.field("last_hit_chunk", pa.int64()),
    pa.field("min_chunk", pa.int64()),
    pa.field("max_chunk", pa.int64()),
    pa.field("tail_min_chunk", pa.int64()),
    pa.field("tail_max_chunk", pa.int64()),
    *_raw("head"),
    *_raw("tail"),
)

_LOOKUP_V4: tuple[pa.Field[Any], ...] = (
    *_LOOKUP_V2,
    # the episode (scan == -1): the request's kv_transfer_params the connector recognises,
    # validated as vLLM validates them (`keytrace.judge.rules.request_limits`); null: not given
    pa.field("max_load_tokens", pa.int64()),
    pa.field("max_offload_tokens", pa.int64()),
    pa.field("kv_load_tiers", pa.string()),  # canonical JSON of the recognised entries
    # the request's own "do not read external KV" flag the connector honours (vLLM 0.33.0:
    # Request.skip_reading_prefix_cache; 0.34.0: skip_reading_external_kv): no lookup at all
    pa.field("skip_reading_kv", pa.bool_()),
)

_TIER: tuple[pa.Field[Any], ...] = (
    pa.field("event", _STR, nullable=False),
    pa.field("req_id", _STR),
    pa.field("episode", pa.int64()),  # the lookup episode in progress, if any
    pa.field("tier", pa.int32()),  # secondary tier index (null: the primary / no tier)
    pa.field("group_id", pa.int32()),
    pa.field("chunk_idx", pa.int64()),
    pa.field("end_token", pa.int64()),
    pa.field("key", pa.binary()),
    pa.field("result", _STR),  # lookups: the tier's LookupResult name
    pa.field("job_id", pa.int64()),  # the tiering manager's transfer job
)

_V2: dict[str, pa.Schema] = {
    "store": V1_SCHEMAS["store"],
    "lookup": pa.schema(COMMON_FIELDS + _LOOKUP_V2),
    "load": V1_SCHEMAS["load"],
    "step": V1_SCHEMAS["step"],
}
SCHEMAS_BY_VERSION: dict[int, dict[str, pa.Schema]] = {
    1: V1_SCHEMAS,
    2: _V2,
    3: {**_V2, "tier": pa.schema(COMMON_FIELDS + _TIER)},
    4: {
        **_V2,
        "lookup": pa.schema(COMMON_FIELDS + _LOOKUP_V4),
        "tier": pa.schema(COMMON_FIELDS + _TIER),
    },
}
# v5: v4's columns; the tier kind may hold ``promotion_deferred``/``deferred_released``
# (a v4 reader would take a deferred failure for a promotion still in flight)
SCHEMAS_BY_VERSION[5] = SCHEMAS_BY_VERSION[4]
SCHEMAS: dict[str, pa.Schema] = SCHEMAS_BY_VERSION[SCHEMA_VERSION]
"""Arrow schema of each row kind this keytrace writes (without the per-part metadata)."""


def columns(kind: str, version: int = SCHEMA_VERSION) -> tuple[str, ...]:
    """The column names of ``kind`` in ``version``, in schema order."""
    return tuple(SCHEMAS_BY_VERSION[version][kind].names)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal headers compare byte-equal."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def part_metadata(
    kind: str,
    header: Mapping[str, Any],
    source: Mapping[str, Any],
    keytrace_version: str,
    *,
    version: int = SCHEMA_VERSION,
    flush: Mapping[str, Any] | None = None,
    incomplete: Sequence[str] = (),
) -> dict[bytes, bytes]:
    """The key-value metadata written into every part of ``kind`` (schema ``version``),
    with the manifest of the flush that wrote it and, for a compacted file, what its source
    trace lacked."""
    meta = {
        META_VERSION: str(version).encode(),
        META_KIND: kind.encode(),
        META_HEADER: canonical_json(header).encode(),
        META_SOURCE: canonical_json(source).encode(),
        META_KEYTRACE_VERSION: keytrace_version.encode(),
    }
    if flush is not None:
        meta[META_FLUSH] = canonical_json(flush).encode()
    if incomplete:
        meta[META_INCOMPLETE] = canonical_json(list(incomplete)).encode()
    return meta


IN_FLIGHT_TIER_WORK: dict[str, int] = {
    TierEvent.CASCADE_SUBMITTED: 1,
    TierEvent.CASCADE_COMPLETED: -1,
    TierEvent.CASCADE_FAILED: -1,
    TierEvent.PROMOTION_PREPARED: 1,
    TierEvent.PROMOTION_COMPLETED: -1,
    TierEvent.PROMOTION_FAILED: -1,
    TierEvent.PROMOTION_DEFERRED: 0,
    TierEvent.DEFERRED_RELEASED: -1,
}
"""Tier events that take (+1) or give back (-1) a primary slot per key while a transfer is
under way: a write-through job reads its chunk from the primary (a key written through to
several tiers at once holds one slot: counted while any of its jobs is in flight), a
promotion fills one. Here, beside the scan results, because the recorder reads it too (a
sampled trace keeps these rows for every chain: `keytrace.record.sampling`), and the
recording path imports no analysis; `keytrace.judge.definitions` re-exports it."""

OWN_TIER_WORK: dict[str, int] = {
    TierEvent.PROMOTION_DEFERRED: -1,
    TierEvent.DEFERRED_RELEASED: 0,
}
"""Where a row moves its request's own count of promotion slots otherwise than the total
(`IN_FLIGHT_TIER_WORK`): a promotion that fails with a deferred release gives its slots
back as its request's own at once, but they stay held, by no request, until
``deferred_released``. So a request that promotes again and finds no room is crowded by
its own earlier failure, as by anyone else's work (`definitions.held_by_others`)."""
