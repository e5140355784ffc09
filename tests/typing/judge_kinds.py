"""What mypy must infer for keytrace's definitions: the kind they are given, back.

The live alarm calls each rule with ints, bools, None and enum members and reads plain
results; the differ calls the same rule with polars expressions and reads expressions.
The overloads in `keytrace.judge` say so; ``tests/unit/test_judge_types.py`` runs mypy
(strict) on this file, so a signature that loses a kind (or falls back to ``Any``) fails.
Never imported at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_type

import polars as pl

from keytrace.judge import definitions as d
from keytrace.judge import ops, rules
from keytrace.judge.definitions import Cause, Limit
from keytrace.judge.rules import Group

G: list[Group] = []
g = Group(gid=0, kind="sliding_window", tpc=16, window=2, sliding_window=32)
c = pl.col("x")

# ops: plain in, plain out; an expression anywhere in, an expression out
assert_type(ops.lt(1, None), bool)
assert_type(ops.lt(c, 1), pl.Expr)
assert_type(ops.lt(1, c), pl.Expr)
assert_type(ops.eq("HIT", "HIT"), bool)
assert_type(ops.eq(c, "HIT"), pl.Expr)
assert_type(ops.known(None), bool)
assert_type(ops.known(c), pl.Expr)
assert_type(ops.least(1, 2), int)
assert_type(ops.greatest_known(1, None), int | None)
assert_type(ops.negate(True), bool)
assert_type(ops.negate(c), pl.Expr)
assert_type(ops.member("MISS", ("MISS",)), bool)

# rules: vLLM's arithmetic
assert_type(rules.cdiv(5, 2), int)
assert_type(rules.cdiv(c, 2), pl.Expr)
assert_type(rules.lookup_cap(G, 100), int)
assert_type(rules.lookup_cap(G, c, c), pl.Expr)
assert_type(rules.store_boundary(G, 100), int)
assert_type(rules.needed_range(g, 0, 64, 4), tuple[int, int])
assert_type(rules.load_cap(None, False), int | None)

# definitions: keytrace's own
assert_type(d.boundary_chunk(64, 16), int)
assert_type(d.boundary_chunk(c, 16), pl.Expr)
assert_type(d.match_ceiling(96, None), int)
assert_type(d.resident_prefix(0, G, lambda gid: None), int | None)
assert_type(d.standing_boundaries(96, G, None), list[int])
assert_type(d.standing_boundaries(c, G, None), list[pl.Expr])
assert_type(d.keyed_chunks(g, 6, 16), int)
assert_type(d.resident(3, None), bool)
assert_type(d.resident(c, None), pl.Expr)
assert_type(d.held_by_others(1, 2, 0), int)
assert_type(d.served(0, 100, None, 64), tuple[int, int])
assert_type(d.served(c, c, c, c), tuple[pl.Expr, pl.Expr])
assert_type(d.short_of_E(96, 0, 64), int)
assert_type(d.store_limit("withheld"), Limit | None)
assert_type(d.store_limit(c), pl.Expr)
assert_type(d.limit_of(64, 96, None, False), Limit | None)
assert_type(d.limit_of_causes([Cause.TIER_EXCLUDED]), Limit | None)
assert_type(d.unsettled("HIT_PENDING"), bool)
assert_type(d.unsettled(c), pl.Expr)
assert_type(d.better_cause(Cause.EVICTED, Cause.RESIDENT), Cause)
assert_type(d.chunk_cause("MISS", True, False, False, Cause.EVICTED), Cause)
causes = d.candidates_of([(0, Cause.EVICTED)], 0)
assert_type(causes, list[list[Cause]])
assert_type(d.decisive(causes), Sequence[Cause])
assert_type(d.decisive([c, c]), pl.Expr)
assert_type(d.shortfall_cause([Cause.EVICTED], None), Cause)
assert_type(d.base_verdict(d.EpisodeNumbers(S=0, X=0, E=None)), d.Verdict | pl.Expr)
assert_type(ops.plain_of(d.base_verdict(d.EpisodeNumbers(S=0, X=0, E=None))), d.Verdict)
