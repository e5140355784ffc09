"""`keytrace.judge.definitions.GATES`: a cause's gate only saves work. Where the gate fact is
plainly false its test never holds, so `cause` (which skips gated tests there) answers as
the ungated first-that-holds over `CAUSES` does, on plain facts drawn at random."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from keytrace.judge import definitions as d
from keytrace.judge.ops import plain_of

S = 100
SEQS = (None, 40, 60, 100, 140)
"""Sequence numbers around ``s`` (before it, at it, after it, unknown)."""


def draw(rng: random.Random, **fixed: Any) -> d.KeyFacts:
    """Plain facts with every field drawn: sequence numbers from `SEQS`, truths from
    False/True, token ends around the chain's reach."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(d.KeyFacts):
        if f.name == "s":
            values[f.name] = S
        elif f.name in ("token_end", "keyable_end"):
            values[f.name] = rng.choice((None, 64, 128, 256))
        elif f.type in ("MaybeNum",):
            values[f.name] = rng.choice(SEQS)
        else:
            values[f.name] = rng.random() < 0.5
    values.update(fixed)
    return d.KeyFacts(**values)


def ungated(facts: d.KeyFacts) -> d.Cause:
    """The first of `CAUSES` that holds, every test run."""
    for name, test in d.CAUSES:
        if plain_of(test(facts)):
            return name
    return d.LAST_CAUSE


@pytest.mark.parametrize("cause", sorted(d.GATES))
def test_a_gated_test_never_holds_without_its_gate(cause: d.Cause) -> None:
    rng = random.Random(str(cause))
    test = dict(d.CAUSES)[cause]
    gate = d.GATES[cause]
    for _ in range(5_000):
        facts = draw(rng, **{gate: False})
        assert not plain_of(test(facts)), (cause, facts)


def test_gates_name_facts_and_causes_of_the_table() -> None:
    fields = {f.name for f in dataclasses.fields(d.KeyFacts)}
    assert set(d.GATES.values()) <= fields
    assert set(d.GATES) <= set(dict(d.CAUSES))
    assert d.GATES, "no gate: the alarm runs every test of every key"


def test_cause_with_gates_is_the_ungated_first_that_holds() -> None:
    rng = random.Random(0)
    seen: set[d.Cause] = set()
    for i in range(20_000):
        # a third of the draws with no secondary tier (every gate false), as on a CPU tier
        fixed = {"durable": False, "excluded": False} if i % 3 == 0 else {}
        facts = draw(rng, **fixed)
        got = d.cause(facts)
        assert got == ungated(facts), facts
        seen.add(d.Cause(got))
    # the draws reach both sides of the gates: causes before, among and after them
    assert {d.Cause.RESIDENT, d.Cause.ON_TIER, d.Cause.TIER_EXCLUDED, d.Cause.EVICTED} <= seen
