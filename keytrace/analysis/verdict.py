"""Verdicts as pure functions of an episode's numbers and its needed chunks' causes.

Both work on polars frames held in memory (no Parquet), so every branch is unit-testable:

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

from keytrace.analysis.history import RULE_CAUSES

CAUSE_TEXT = {
    "resident": "resident",
    "in_flight": "store in flight at the lookup (prepared before it, not yet completed)",
    "evicted": "evicted before the episode",
    "other_engine": "offered on another engine before the lookup (a routing miss)",
    "store_failed": "offered, but the store's allocation or transfer failed",
    "rejected": "offered but declined by prepare_store",
    "other_group": "same hash stored under another group id",
    "never_offered": "never offered by the store path",
    "not_keyable": "never complete in any earlier request on the chain (not keyable)",
    "not_looked_up": "not looked up in this episode (key unknown)",
}


def base_verdict() -> pl.Expr:
    """Over columns S, X (external; null = deferred) and E (null = none)."""
    return (
        pl.when(pl.col("X").is_null())
        .then(pl.lit("deferred"))
        .when(pl.col("E").is_null())
        .then(pl.lit("cold"))
        .when(pl.col("X") >= pl.col("E") - pl.col("S"))
        .then(pl.lit("hit"))
        .otherwise(pl.lit("shortfall"))
    )


def absent() -> pl.Expr:
    return ~pl.col("cause").is_in(["resident", "not_looked_up"])


def shortfall_verdicts(needed: pl.DataFrame, terminals: pl.DataFrame) -> pl.DataFrame:
    """One row per shortfall episode: ``verdict`` and the ``decisive`` causes.

    ``needed``: (inst, s, gid, cause, binding) per needed chunk; ``terminals``: (inst, s,
    term_result) for every shortfall episode (term_result null when there was none).
    """
    is_rule = pl.col("cause").is_in(RULE_CAUSES)
    flags = (
        needed.with_columns(absent().alias("absent"))
        .group_by("inst", "s")
        .agg(
            pl.col("cause").filter(is_rule).alias("rule"),
            pl.col("cause").filter(pl.col("absent") & pl.col("binding")).alias("binding_absent"),
            pl.col("cause").filter(pl.col("absent")).alias("all_absent"),
        )
    )
    empty = pl.lit([], dtype=pl.List(pl.String))
    decisive = (
        pl.when(pl.col("rule").list.len() > 0)
        .then(pl.col("rule"))
        .when(pl.col("binding_absent").list.len() > 0)
        .then(pl.col("binding_absent"))
        .otherwise(pl.col("all_absent"))
    )
    return (
        terminals.join(flags, on=["inst", "s"], how="left")
        .with_columns(pl.col("rule", "binding_absent", "all_absent").fill_null(empty))
        .with_columns(decisive.alias("decisive"))
        .with_columns(
            pl.when(pl.col("rule").list.len() > 0)
            .then(pl.lit("mismatch"))
            .when(pl.col("term_result").is_in(["HIT_PENDING", "RETRY"]))
            .then(pl.lit("explained"))
            .when(pl.col("all_absent").list.len() > 0)
            .then(pl.lit("explained"))
            .otherwise(pl.lit("mismatch"))
            .alias("verdict")
        )
        .select("inst", "s", "verdict", "decisive", "term_result")
    )


def reason(verdict: str, decisive: list[str], term_result: str | None) -> str:
    """The one-line ``why`` printed for a shortfall episode."""
    if term_result in ("HIT_PENDING", "RETRY"):
        return f"lookup saw {term_result} at the binding key: the store had not finished"
    texts = sorted({CAUSE_TEXT.get(c, c) for c in decisive})
    if verdict == "explained":
        return "shortfall explained by timing/capacity/routing: " + "; ".join(texts)
    if not decisive:
        return "every chunk vLLM's rule needs for a hit at E was resident, yet lookup fell short"
    rule = sorted({CAUSE_TEXT[c] for c in decisive if c in RULE_CAUSES})
    return "lookup needed chunks the store path did not keep: " + "; ".join(rule or texts)
