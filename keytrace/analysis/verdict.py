"""Verdicts over polars frames: `keytrace.judge.definitions`' verdict rules, evaluated
for every episode at once. Both work on frames held in memory (no Parquet), so every branch
is unit-testable:

- `base_verdict`: ``deferred`` (vLLM returned None), ``cold`` (no expected boundary E),
  ``hit`` (external tokens reach E), else ``shortfall``;
- `shortfall_verdicts`: a shortfall is a ``mismatch`` when any needed chunk, in any group,
  is absent for a rule cause (with perfect timing, capacity and routing vLLM would still
  fall short there, even if the scan never got that far); otherwise ``explained`` when the
  binding key was seen as HIT_PENDING or RETRY (the store had not finished) or some needed
  chunk is absent for a timing/capacity/routing cause; otherwise a ``mismatch`` too: every
  chunk vLLM's rule needs was resident and lookup still fell short.

  The *decisive* causes shown with a verdict: the rule causes when there are any, else the
  binding group's absent chunks' causes, else every absent chunk's.
"""

from __future__ import annotations

import polars as pl

from keytrace.judge import definitions as d
from keytrace.judge.definitions import RULE_CAUSES, TIER_CAUSES, UNSEEN, Limit
from keytrace.judge.ops import as_expr, plain

CAUSE_TEXT = {
    "resident": "resident",
    "on_tier": "on a secondary tier (this lookup never got to it)",
    "in_flight": "store in flight at the lookup (prepared before it, not yet completed)",
    "promoting": "on a secondary tier, being promoted (or looked up) when the lookup ran",
    "promotions_held": "on a secondary tier while promotions were held after a reset",
    "promotion_evicted": "on a secondary tier; a promotion of this request evicted it from the CPU tier",
    "promotion_no_room": "on a secondary tier; no CPU slot to promote it into (the request needs more chunks than the CPU tier holds)",
    "primary_busy": "on a secondary tier; no CPU slot to promote it into: write-throughs and other requests' promotions in flight held too many (the CPU tier was busy)",
    "promotion_starved": "on a secondary tier; no CPU slot to promote it into, though the request fits the CPU tier beside the transfers in flight",
    "secondary_resident": "on a secondary tier, yet the tiered lookup answered MISS",
    "tier_excluded": "only on secondary tiers the request's kv_load_tiers excluded from its lookup",
    "evicted": "evicted before the episode",
    "other_engine": "offered on another engine before the lookup (a routing miss)",
    "store_failed": "offered, but the store's allocation or transfer failed",
    "rejected": "offered but declined by prepare_store",
    "no_checkpoint": "no recurrent state kept at this boundary (kept only where a request computed one)",
    "other_group": "same hash stored under another group id",
    "never_offered": "never offered by the store path",
    "not_keyable": "never complete in any earlier request on the chain (not keyable)",
    UNSEEN: "not looked up in this episode (key unknown)",
}


def base_verdict() -> pl.Expr:
    """Over columns S, X (external; null = deferred), E (null = none), and for deferred
    episodes deferrals and waited: `keytrace.judge.definitions.base_verdict`."""
    c = pl.col
    numbers = d.EpisodeNumbers(
        S=c("S"),
        X=c("X"),
        E=c("E"),
        deferrals=c("deferrals").fill_null(0),
        waited=c("waited").fill_null(0),
        E_free=c("E_free"),
        stored_limit=c("stored_limit"),
    )
    return as_expr(d.base_verdict(numbers))


def shortfall_verdicts(needed: pl.DataFrame, terminals: pl.DataFrame) -> pl.DataFrame:
    """One row per shortfall episode: ``verdict`` and the ``decisive`` causes.

    ``needed``: (inst, s, gid, cause, binding) per needed chunk; ``terminals``: (inst, s,
    term_result) for every shortfall episode (term_result null when there was none).
    """
    cause = pl.col("cause")
    names = [f"c{i}" for i in range(len(d.DECISIVE_ORDER))]
    lists = [
        cause.filter(
            (cause.is_in(plain(kind)) if kind is not None else d.absent(cause))
            & (pl.col("binding") if bound else pl.lit(True))
        ).alias(name)
        for (kind, bound), name in zip(d.DECISIVE_ORDER, names, strict=True)
    ]
    flags = needed.group_by("inst", "s").agg(*lists)
    empty = pl.lit([], dtype=pl.List(pl.String))
    candidates = [pl.col(n) for n in names]
    verdict = as_expr(d.shortfall_verdict(d.shortfall_facts(candidates, pl.col("term_result"))))
    return (
        terminals.join(flags, on=["inst", "s"], how="left")
        .with_columns(pl.col(names).fill_null(empty))
        .with_columns(d.decisive(candidates).alias("decisive"))
        .with_columns(verdict.alias("verdict"))
        .select("inst", "s", "verdict", "decisive", "term_result")
    )


def reason(verdict: str, decisive: list[str], term_result: str | None) -> str:
    """The one-line ``why`` printed for a shortfall episode."""
    if d.unsettled(term_result):
        return f"lookup saw {term_result} at the binding key: the store had not finished"
    texts = sorted({CAUSE_TEXT.get(c, c) for c in decisive})
    if verdict == "explained":
        return "shortfall explained by timing/capacity/routing: " + "; ".join(texts)
    if verdict == "limited":
        limits = sorted({str(d.LIMIT_OF_CAUSE[c]) for c in decisive if c in d.LIMIT_OF_CAUSE})
        labels = [d.LIMIT_LABELS[Limit(x)] for x in limits]
        return "; ".join(labels) + ": " + "; ".join(texts)
    if not decisive:
        return "every chunk vLLM's rule needs for a hit at E was resident, yet lookup fell short"
    rule = sorted({CAUSE_TEXT[c] for c in decisive if c in RULE_CAUSES})
    if any(c in TIER_CAUSES for c in decisive if c in RULE_CAUSES):
        return "the tiered manager did not serve chunks a tier held: " + "; ".join(rule)
    return "lookup needed chunks the store path did not keep: " + "; ".join(rule or texts)
