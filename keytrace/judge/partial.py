"""Partial tails: vLLM's store and lookup rules for a recurrent hybrid whose hash unit is
below the block (``supports_partial_tail``), and keytrace's definitions over them.

With partial tails on, a producer whose prompt's last state falls inside a block (at its
tail boundary ``T``, a multiple of the hash unit ``h`` that is no multiple of the block
``bs``) offers, beside the complete chunks, one key per offloaded group at ``T``:
``hash[T/h - 1]`` with the group's id, no chunk index (``_build_partial_tail_store_jobs``).
A later lookup extends its complete-chunk hit ``C`` by probing the hash boundaries above
``C`` from the right, each boundary asking every group's key in ``kv_group_configs``
order (``_lookup_partial_tail``); the first boundary where every group answers HIT wins.
The window's top is one block past an anchor: the complete hit on vLLM 0.33.0 (inline in
``_lookup``), the larger of the complete hit and the full-attention hit boundary on
0.34.0 (``_lookup_partial_tail_hit``): the header's ``partial_anchor``
(`keytrace.judge.rules.partial_anchor_of`).

vLLM's lines (``offloading/scheduler.py``; 0.33.0 / 0.34.0): the partial lookup
1078-1152 / 1159-1263, ``_lookup_partial_tail`` 1160-1195 / 1283-1322, the store
1626-1760 / 1779-1918, ``_make_boundary_key`` 1056-1066 / 1130-1140. docs/diff.md,
"Partial tails", states the definitions.

Scope: no legacy EAGLE drafter (its proof margins move the keys: refused by
`keytrace.judge.trust.uncovered`), one chunk per block (vLLM's own condition), decode
context parallelism 1 (vLLM's too). Duck-typed as `keytrace.judge.rules`: ints in, an
int out; a polars expression in, an expression out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from keytrace.judge.ops import (
    MaybeNum,
    Num,
    Truth,
    greatest,
    greatest_known,
    gt,
    is_expr,
    le,
    least,
    lit,
)
from keytrace.judge.rules import PARTIAL_ANCHOR_COMPLETE, PARTIAL_ANCHOR_FA, Group

if TYPE_CHECKING:
    from polars import Expr

HIT, HIT_PENDING, RETRY, MISS = "HIT", "HIT_PENDING", "RETRY", "MISS"


def partial_tails_on(header: Mapping[str, Any]) -> bool:
    """The trace's connector stored and looked up partial tails (``supports_partial_tail``,
    vLLM's ``SchedulerOffloadConfig.from_spec``)."""
    return bool(header.get("supports_partial_tail"))


def partial_block(header: Mapping[str, Any]) -> int:
    """``bs``: the connector's ``_partial_tail_block_size`` (every offloaded group's one
    block, one chunk per block), 0 with partial tails off."""
    rec = header.get("recurrent") or {}
    return int(rec.get("partial_tail_block_size") or 0)


@overload
def partial_cap(
    P: int,
    H: int,
    tph: int,
    S: int,
    max_new: int | None = None,
    max_load: int | None = None,
) -> int: ...
@overload
def partial_cap(
    P: Num,
    H: Num,
    tph: int,
    S: Num,
    max_new: MaybeNum = None,
    max_load: MaybeNum = None,
) -> Num: ...
def partial_cap(
    P: Num,
    H: Num,
    tph: int,
    S: Num,
    max_new: MaybeNum = None,
    max_load: MaybeNum = None,
) -> Num:
    """``L_p``, the largest boundary the partial lookup may probe:
    ``round_down(min(P - 1, H * h, S + max_new, S + max_load), h)``, at least 0.

    ``P`` is the request's *prompt* tokens (not ``num_tokens``: a resumed request's output
    is never a partial tail) and the ``- 1`` comes before the caps in both releases
    (0.33.0 1087-1102, 0.34.0 1196-1209). ``H * h`` is how far the request's block hashes
    reach (0.34.0 always applies it; 0.33.0 only under an EAGLE margin, where without one
    ``P - 1 < H * h`` anyway, lookahead being 0 there). A null ``max_new`` or ``max_load``
    is no bound; a request that skips reading external KV has a load cap of 0
    (`keytrace.judge.rules.load_cap`)."""
    cap: Num = least(P - 1, H * tph)
    if max_new is not None:
        cap = least(cap, S + max_new)
    if max_load is not None:
        cap = least(cap, S + max_load)
    return greatest(0, cap // tph * tph)


@overload
def is_partial(b: int, bs: int) -> bool: ...
@overload
def is_partial(b: Expr, bs: int) -> Expr: ...
def is_partial(b: Num, bs: int) -> Truth:
    """A boundary inside a block: a partial tail's (an aligned boundary is a chunk's)."""
    return b % bs != 0


def offer_boundary(end_token: MaybeNum, chunk_idx: MaybeNum, bs: int) -> MaybeNum:
    """``T``, the partial tail a store row offered a key for: its ``end_token`` where the row
    has no chunk index and ends inside a block (`is_partial`); unknown for every other row.
    (Without a legacy EAGLE margin a group's partial key sits at ``T`` itself,
    ``_partial_tail_key_tokens``.) Read from the offers, never predicted from a prompt: a
    preempted or aborted producer, or one whose non-recurrent block the connector does not
    see yet, offers none (docs/diff.md)."""
    if not is_expr(end_token, chunk_idx):
        if end_token is None or chunk_idx is not None:
            return None
        return end_token if end_token % bs else None
    import polars as pl

    return (
        pl.when(lit(chunk_idx).is_null() & (lit(end_token) % bs != 0))
        .then(lit(end_token))
        .otherwise(None)
    )


def partial_in_reach(T: Num, S: Num, top: MaybeNum, L_p: Num, bs: int) -> Truth:
    """An intended partial boundary the episode could have hit: ``S < T <= L_p``, and the
    block ``T`` lies in starts at or below ``top = min(L_c, F)`` (the complete-chunk cap and
    the resident full-attention prefix, as for a complete boundary): a hit at ``T`` loads
    every full-attention chunk below ``T``'s block, and the window reaches ``T`` only from
    an anchor in or past that block. On vLLM 0.33.0 the anchor is the complete hit, so the
    block's start needs the aligned recurrent state too: a needed key (`partial_needed`),
    not a reach condition (the request's own boundary, which is that block's start, is
    intended whenever its tail is). The block right past ``S`` is always in reach, whatever
    ``top`` says: the window starts at the anchor, at least ``S``, even where the complete
    part loads nothing because its cap leaves less than a chunk past ``S``
    (`keytrace.judge.rules.sub_chunk_cap`: ``lookup_cap`` is then 0, below ``S``)."""
    start = T // bs * bs
    return gt(T, S) & le(T, L_p) & (le(start, S) | le(start, top))


def partial_anchor(rule: str, C: int, fa_hit: int | None) -> int:
    """``A``: where the partial window's top is measured from (``C``: local plus the
    complete hit; ``fa_hit``: 0.34.0's full-attention hit boundary, None where the lookup
    did not reach a recurrent group). vLLM 0.34.0 demotes the anchor to ``C`` while
    another request loads a full-attention chunk in ``[C, A)`` (1178-1189: timing, not
    recorded)."""
    if rule == PARTIAL_ANCHOR_FA:
        return max(C, fa_hit or 0)
    return C


def window_top(A: int, L_p: int, bs: int, tph: int) -> int:
    """``M``: the largest boundary probed, one block past the anchor at most:
    ``min(L_p, round_down(A + bs - 1, h))`` (no EAGLE margin: one search block)."""
    return min(L_p, (A + bs - 1) // tph * tph)


def probe_order(rule: str, C: int, A: int, M: int, bs: int, tph: int) -> list[int]:
    """The boundaries vLLM probes, in order: ``M, M - h, ..., C + h``; vLLM 0.34.0 skips the
    aligned ones at or below ``A`` (complete chunks the complete-chunk lookup missed,
    1244-1245). Empty when ``M <= C`` (the complete hit stands)."""
    out = []
    for b in range(M, C, -tph):
        if rule == PARTIAL_ANCHOR_FA and b <= A and b % bs == 0:
            continue
        out.append(b)
    return out


def probe_hits(results: Sequence[str]) -> bool:
    """A boundary hits when every group's key answered HIT (``_lookup_partial_tail``: a
    MISS ends the boundary, a HIT_PENDING or RETRY makes it pending, not a hit)."""
    return all(r == HIT for r in results)


def probe_terminal(results: Sequence[str]) -> int | None:
    """The index of the call that kept one boundary's probe from hitting: its first MISS
    (vLLM asks no further group), else its first HIT_PENDING or RETRY; None when every
    group answered HIT."""
    for i, r in enumerate(results):
        if r == MISS:
            return i
    return next((i for i, r in enumerate(results) if r != HIT), None)


def partial_lookup(
    rule: str,
    S: int,
    complete_hit: int | None,
    fa_hit: int | None,
    L_p: int,
    bs: int,
    tph: int,
    probe: Callable[[int], Sequence[str]],
) -> tuple[int | None, int | None]:
    """vLLM's partial part as keytrace models it (no EAGLE margin, no bridge, no sibling
    load): ``(hit tokens or None to defer, partial_tail_boundary)`` after the complete part
    returned ``complete_hit`` (None: deferred) and, on 0.34.0, ``fa_hit``. ``probe(b)``:
    each group's lookup result at ``b`` in ``kv_group_configs`` order, up to the first
    MISS. A pending boundary does not defer unless the complete hit is 0 (W2 in
    docs/findings.md). Checked against vLLM's own method text in
    ``tests/integration/test_partial_rules.py``."""
    if complete_hit is None:
        return None, None
    C = S + complete_hit
    A = partial_anchor(rule, C, fa_hit)
    M = window_top(A, L_p, bs, tph)
    pending = False
    for b in probe_order(rule, C, A, M, bs, tph):
        results = probe(b)
        if probe_hits(results):
            return b - S, b
        pending |= any(r in (HIT_PENDING, RETRY) for r in results)
    if pending and complete_hit == 0:
        return None, None
    return complete_hit, None


def served_boundary(S: int, external: int | None, bs: int) -> int | None:
    """The partial tail an episode was served: ``S + external`` when it lies inside a block
    (vLLM's ``partial_tail_boundary``; a complete hit always ends on a block)."""
    if not external:
        return None
    end = S + external
    return end if end % bs else None


def partial_needed(
    groups: Sequence[Group], rule: str, S: int, T: int, bs: int
) -> tuple[dict[int, range], list[int]]:
    """What a hit at a partial ``T`` needs, in vLLM's load order (``update_state_after_alloc``):
    ``(chunks, partial)``. ``chunks``: per group, the complete chunks: every full-attention
    group's ``[S/bs, Tb/bs)`` (``Tb`` = ``T``'s block start); on vLLM 0.33.0 also each
    recurrent group's chunk ending at ``Tb`` when ``Tb > S`` (the complete-chunk lookup must
    find that state for the window to reach ``T``; it is looked up, never loaded).
    ``partial``: every group's key at ``T``, in probe order (the groups' ``offload_index``
    order, given as ``groups``)."""
    Tb = T // bs * bs
    chunks: dict[int, range] = {}
    for g in groups:
        if g.full_attention:
            chunks[g.gid] = range(S // bs, Tb // bs)
        elif g.recurrent and rule == PARTIAL_ANCHOR_COMPLETE and Tb > S:
            chunks[g.gid] = range(Tb // bs - 1, Tb // bs)
    return chunks, [g.gid for g in groups]


def expected_partial(
    intended: Sequence[int], S: int, top: int | None, L_p: int, bs: int
) -> int | None:
    """``E_p``: the largest intended partial boundary in reach (`partial_in_reach`); None if
    none. ``intended``: the partial boundaries the episode's chain offered (the offers of
    the keys the episode probed: `offer_boundary`). ``E = max(E_c, E_p)``; a partial ``E``
    counts only above ``E_c``."""
    best = None
    for T in intended:
        if T % bs and partial_in_reach(T, S, top, L_p, bs):
            best = T if best is None else max(best, T)
    return best


def expected_with_partial(E_c: MaybeNum, E_p: MaybeNum) -> MaybeNum:
    """``E = max(E_c, E_p)`` of the known ones (unknown when both are)."""
    return greatest_known(E_c, E_p)


def probed_at(ends: Sequence[int | None], E: int) -> bool:
    """Whether the lookup probed boundary ``E`` (a call whose end token is ``E``): then its
    binding scan is that probe (`probe_terminal`); otherwise the window never reached it
    and the complete part binds, judged at ``E``'s block start as today."""
    return any(e == E for e in ends)


def pending_result(r: str | None) -> Truth:
    """A probe answer that made a boundary pending (its store or promotion not done)."""
    return r in (HIT_PENDING, RETRY)


__all__ = [
    "expected_partial",
    "expected_with_partial",
    "is_partial",
    "offer_boundary",
    "partial_anchor",
    "partial_block",
    "partial_cap",
    "partial_in_reach",
    "partial_lookup",
    "partial_needed",
    "partial_tails_on",
    "probe_hits",
    "probe_order",
    "probe_terminal",
    "probed_at",
    "served_boundary",
    "window_top",
]
