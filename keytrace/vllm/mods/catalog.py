"""The names of every modification keytrace can make to vLLM, and what each does: imports
nothing from vLLM, torch or the rest of keytrace, so the command line lists and checks them
(``--inject``, ``--fix``, ``KEYTRACE_FIX``) without loading what applies them.

- *injections* (`keytrace.vllm.mods.inject`): historical store-side bugs, reintroduced;
- *candidate fixes* (`keytrace.vllm.mods.fixes`): changes that close a disagreement
  keytrace found (docs/findings.md).

Both are testing tools: an active one logs a WARNING naming itself and is written into every
trace header (``vllm_modified``).
"""

from __future__ import annotations

INJECTIONS: dict[str, str] = {
    "pre48911": "store keeps c % (A/tpc) >= A/tpc - W (the rule PR #48911 replaced)",
    "no_eagle_plus1": "store-side reachability computed as if no group were EAGLE/MTP",
    "short_window_tail": "store keeps one chunk fewer of every sliding-window tail than lookup needs",
}
"""Injection name -> what it does to vLLM's store path (shown in warnings and ``--help``)."""

FIXES: dict[str, str] = {
    "mtp_left_chunk": (
        "store side, EAGLE/MTP groups only: also keep the chunk left of a tail whose peek "
        "chunk the prompt cannot key"
    ),
    "unkeyable_peek_fallback": (
        "store side, every group: when the prompt cannot key the EAGLE/MTP peek chunk of its "
        "final boundary E, also keep every group's tail for the boundary before it (E - A)"
    ),
    "eagle_proof_key": (
        "both sides, EAGLE/MTP sliding-window groups: a peek chunk the prompt cannot key is "
        "proven by a key of the chain hash at the boundary and the token after it; store "
        "writes it, lookup accepts it where the full peek misses"
    ),
    "window_minus_one": (
        "lookup side, sliding-window groups: ask for the chunks the window's w - 1 tokens of "
        "context cover, cdiv(w - 1 + extra, tpc), as the store side (and vLLM's GPU prefix "
        "cache) keep, not cdiv(w, tpc): one chunk fewer when w - 1 is a multiple of a chunk"
    ),
    "lookahead_replay_boundary": (
        "store side, sliding-window groups under lookahead hashes (L >= 2): also keep the "
        "window's tail at P - L, the boundary a resend of the prompt can key, besides vLLM's "
        "replay boundary P - 1"
    ),
    "promotion_pins_prefix": (
        "tiered managers: while a lookup promotes a key from a secondary tier, the keys the "
        "same request found in the CPU tier this step are pinned, so the promotion cannot "
        "evict them (no room left: vLLM's own MISS)"
    ),
}
"""Fix name -> what it changes in vLLM's offload path (shown in warnings and ``--help``)."""

STORE_MASK_FIXES = ("mtp_left_chunk", "unkeyable_peek_fallback", "lookahead_replay_boundary")
"""The fixes that replace the store path's mask (one patch-table row each)."""

PROOF_FIX = "eagle_proof_key"
"""The fix whose lookups accept a second key per EAGLE peek chunk (its *proof*): the
recorder then lists those keys, and the differ and the alarm judge a peek by both."""


def check_injection(name: str) -> str:
    """``name`` if it is a known injection, else `UsageError` listing the known ones."""
    from keytrace.errors import UsageError

    if name not in INJECTIONS:
        raise UsageError(f"unknown injection {name!r}; known: {', '.join(INJECTIONS)}")
    return name


def check_fix(name: str) -> str:
    """``name`` if it is a known candidate fix, else `UsageError` listing the known ones."""
    from keytrace.errors import UsageError

    if name not in FIXES:
        raise UsageError(f"unknown fix {name!r}; known: {', '.join(sorted(FIXES))}")
    return name


def fix_names(spec: str | None) -> list[str]:
    """The candidate fixes of ``spec``: one name, or several joined by commas (each
    checked, `check_fix`); none for None or an empty string. The one parser of ``--fix``
    and ``KEYTRACE_FIX``."""
    return [check_fix(n.strip()) for n in (spec or "").split(",") if n.strip()]
