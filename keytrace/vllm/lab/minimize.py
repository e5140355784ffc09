"""Shrink one recorded mismatch to the smallest geometry and lengths that still show it.

"Still show it" means: replayed on the real scheduler (`keytrace.vllm.lab.replay.replay`), the
episode is a ``mismatch`` whose binding group has the same kind and EAGLE/MTP flag, with the
same cause. The shrinking is greedy and deterministic, each step one replay:

1. drop a sliding-window group (never the full-attention group or the binding one);
2. shorten the prompt by whole alignment units A, keeping ``P mod A`` (the residue the
   store/lookup rules depend on) and the traffic shape (primes and episode move together);
3. halve every block size and window (when every one stays a whole number of tokens);
4. halve the step budget, down to two full-attention blocks.

It repeats until no step applies, so the result is a local minimum: no single step keeps
the mismatch. Imports vLLM lazily (through replay).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keytrace.analysis.geometry import Geometry, GroupGeom, describe
from keytrace.analysis.plan import ReplayPlan

if TYPE_CHECKING:
    from keytrace.vllm.lab.replay import ReplayResult

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Scenario:
    """A geometry and its traffic: prime lengths, then the episode's prompt length."""

    geometry: Geometry
    primes: tuple[int, ...]
    episode: int

    def describe(self) -> str:
        primes = ", ".join(f"{p:,}" for p in self.primes)
        return f"{describe(self.geometry)}; primes [{primes}], episode {self.episode:,} tokens"


@dataclass
class Minimized:
    start: Scenario
    result: Scenario
    signature: tuple[str, bool, str]  # binding group kind, its EAGLE flag, cause
    verdict: dict[str, Any] = field(default_factory=dict)
    replays: int = 0
    steps: list[str] = field(default_factory=list)


def scenario_from_plan(plan: ReplayPlan) -> Scenario:
    geo = Geometry.from_dict(plan.geometry)
    return Scenario(geo, tuple(plan.prime_lengths), plan.episode_length)


def check_minimizable(plan: ReplayPlan) -> None:
    """Raise `UsageError` unless ``plan``'s recorded episode is a mismatch with a binding
    group and cause (what `minimize` keeps). Needs no vLLM."""
    from keytrace.errors import UsageError

    if plan.recorded_verdict != "mismatch" or plan.binding_group is None or plan.cause is None:
        raise UsageError(
            f"request {plan.request} is a {plan.recorded_verdict}, not a mismatch: nothing to "
            "minimize"
        )


def minimize(
    plan: ReplayPlan,
    *,
    trace_dir: str | None = None,
    progress: ProgressFn | None = None,
) -> Minimized:
    """Shrink the mismatch of ``plan`` (from `keytrace.analysis.plan.plan_from_trace`).

    Raises `UsageError` when the plan's episode is not a mismatch (`check_minimizable`,
    before vLLM is loaded), or its replay no longer is one (then there is nothing to keep)."""
    from keytrace.errors import UsageError
    from keytrace.vllm import require_vllm

    check_minimizable(plan)
    assert plan.binding_group is not None and plan.cause is not None  # checked just above
    require_vllm()  # `_check` reads any replay error as "not smaller": say this one first
    start = scenario_from_plan(plan)
    bound = start.geometry.groups[plan.binding_group]
    signature = (bound.kind, bound.eagle, plan.cause)
    out = Minimized(start=start, result=start, signature=signature)
    first = _check(start, signature, out)
    if first is None:
        raise UsageError(
            f"replaying request {plan.request} no longer gives a {signature[2]} mismatch in a "
            f"{'MTP ' if signature[1] else ''}{signature[0]} group; nothing to minimize"
        )
    out.verdict = first
    current = start
    improved = True
    while improved:
        improved = False
        for label, cand in _candidates(current):
            v = _check(cand, signature, out)
            if progress is not None:
                progress("replays", out.replays, out.replays)
            if v is not None:
                current, out.verdict = cand, v
                out.steps.append(label)
                improved = True
                break
    out.result = current
    if trace_dir is not None:
        _replay(current, trace_dir)
    return out


def _check(s: Scenario, signature: tuple[str, bool, str], out: Minimized) -> dict[str, Any] | None:
    """The replay's verdict if it keeps the signature, else None (a refused config too)."""
    out.replays += 1
    try:
        r = _replay(s, None)
    except Exception:
        return None  # a geometry vLLM does not build is not a smaller case
    if r.verdict != "mismatch" or r.binding_group is None:
        return None
    g = s.geometry.groups[r.binding_group]
    if (g.kind, g.eagle, r.cause) != signature:
        return None
    return r.outcome()


def _replay(s: Scenario, trace_dir: str | None) -> ReplayResult:
    from keytrace.vllm.lab.replay import replay

    return replay(s.geometry, list(s.primes), s.episode, trace_dir=trace_dir)


def _candidates(s: Scenario) -> Iterator[tuple[str, Scenario]]:
    geo = s.geometry
    # 1. fewer groups
    for i in range(len(geo.groups) - 1, 0, -1):
        if geo.groups[i].sliding_window is not None:
            groups = geo.groups[:i] + geo.groups[i + 1 :]
            yield f"drop group {i}", dataclasses.replace(s, geometry=geo.with_(groups=groups))
    # 2. shorter prompts, same residue modulo A, primes and episode moved together
    A = geo.tokens_per_chunk(0)
    lengths = (*s.primes, s.episode)
    for k in (max(min(lengths) // A - 1, 0), 8, 1):
        if k > 0 and min(lengths) - k * A >= A:
            yield (
                f"prompts -{k * A:,} tokens",
                Scenario(geo, tuple(p - k * A for p in s.primes), s.episode - k * A),
            )
    # 3. half the blocks and windows
    halved = _halve(geo)
    if halved is not None:
        yield (
            "halve blocks and windows",
            Scenario(
                halved,
                tuple(_scale(p, A) for p in s.primes),
                _scale(s.episode, A),
            ),
        )
    # 4. a smaller step budget
    budget = geo.max_num_batched_tokens // 2
    if budget >= 2 * geo.groups[0].block_size:
        yield (
            f"budget {budget:,}",
            dataclasses.replace(s, geometry=geo.with_(max_num_batched_tokens=budget)),
        )


def _halve(geo: Geometry) -> Geometry | None:
    groups = []
    for g in geo.groups:
        if g.block_size % 2 or g.block_size <= 2:
            return None
        if g.sliding_window is not None and g.sliding_window % 2:
            return None
        groups.append(
            GroupGeom(
                g.kind,
                g.block_size // 2,
                sliding_window=None if g.sliding_window is None else g.sliding_window // 2,
                eagle=g.eagle,
                extra_retained_tokens=g.extra_retained_tokens // 2,
                name=g.name,
            )
        )
    return geo.with_(
        groups=tuple(groups), max_num_batched_tokens=max(geo.max_num_batched_tokens // 2, 32)
    )


def _scale(p: int, A: int) -> int:
    """A length for half-size blocks: half the whole alignment units, the same residue
    scaled too, so ``P mod A`` keeps its place relative to the (halved) chunks."""
    return (p // A) * (A // 2) + (p % A) // 2
