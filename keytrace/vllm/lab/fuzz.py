"""Property-based search for store/lookup disagreements over hybrid geometries, on the real
scheduler: Hypothesis draws a geometry and a traffic shape, `keytrace.vllm.lab.replay.replay`
records and diffs it, and the property is "no episode is a mismatch". A failure shrinks
(fewest groups, smallest blocks, windows and lengths) to a minimal case.

What is drawn (every value a multiple of what vLLM requires, so a case is a real config):

- one full-attention or MLA group (block 16..256), plus 1..3 sliding-window groups whose
  blocks divide it (4..the full-attention block), windows of 1..4 blocks (plus 0..block-1
  tokens unless ``aligned_windows``), at most one of them the EAGLE/MTP draft group, optional
  ``extra_retained_tokens`` on that one;
- blocks per chunk 1 or 2; a step budget of 2..32 full-attention blocks (chunked prefill
  when the prompt is longer);
- traffic: an identical resend after a GPU-only reset, or the next turn (the same prompt
  plus 1..3 full-attention blocks of new tokens);
- a prompt of 2..48 full-attention blocks plus 0..block-1 tokens;
- a speculative drafter among those asked for (none by default): vLLM builds its own
  ``SpeculativeConfig`` and, on 0.34.0, hashes every block over the next L tokens.

With ``recurrent`` (`_recurrent_case_strategy`), recurrent hybrids instead: one
full-attention group and 1..3 recurrent (Mamba, gated DeltaNet) groups of one block size
(16..64: vLLM's ``align`` cache mode), with or without the prefill checkpoints Mamba2 asks
for, a hash unit of the block or a quarter or half of it (partial tails), decode context
parallelism 1 or 2; the same chunking, budgets and traffic.

A case vLLM refuses to build (a geometry it does not support) is rejected, counted and
reported, never a failure; so is one keytrace has no rules for (its verdict would be
``no_verdict``: `keytrace.judge.trust.uncovered`). Imports vLLM (through replay) and
Hypothesis lazily.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from keytrace.analysis.geometry import Drafter, Geometry, GroupGeom, describe
from keytrace.analysis.results import NO_VERDICT

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Case:
    """One drawn scenario: a geometry and its traffic (prime lengths, then the episode)."""

    geometry: Geometry
    shape: str  # "resend" | "next_turn"
    prime: int
    episode: int

    def describe(self) -> str:
        """One line: the groups, chunking, budget and traffic."""
        return (
            f"{describe(self.geometry)}; {self.shape}: prime {self.prime:,}, "
            f"episode {self.episode:,} tokens"
        )


@dataclass
class FuzzResult:
    """What a fuzz run found: the minimal failing case (None: none found), counts, speed."""

    failure: Case | None = None
    verdict: dict[str, Any] = field(default_factory=dict)
    cases: int = 0
    rejected: int = 0
    first_rejection: str | None = None
    seconds: float = 0.0
    stopped_by_budget: bool = False
    seed: int = 0

    @property
    def cases_per_second(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


def _case_strategy(aligned_windows: bool, drafters: tuple[Drafter | None, ...] = (None,)) -> Any:
    from hypothesis import strategies as st

    @st.composite
    def case(draw: Any) -> Case:
        fa_block = draw(st.sampled_from([16, 32, 64, 128, 256]))
        fa_kind = draw(st.sampled_from(["full_attention", "mla"]))
        n_swa = draw(st.integers(1, 3))
        divisors = [b for b in (4, 8, 16, 32, 64, 128, 256) if b <= fa_block and fa_block % b == 0]
        eagle_at = draw(st.one_of(st.none(), st.integers(0, n_swa - 1)))
        swa = []
        for i in range(n_swa):
            b = draw(st.sampled_from(divisors))
            slack = 0 if aligned_windows else draw(st.integers(0, b - 1))
            window = b * draw(st.integers(1, 4)) + slack
            eagle = eagle_at == i
            extra = b * draw(st.integers(0, 1)) if eagle else 0
            swa.append(
                GroupGeom(
                    "sliding_window",
                    b,
                    sliding_window=window,
                    eagle=eagle,
                    extra_retained_tokens=extra,
                )
            )
        bpc = draw(st.integers(1, 2))
        A = fa_block * bpc
        budget = fa_block * draw(st.integers(2, 32))
        prime = A * draw(st.integers(2, 48)) + draw(st.integers(0, A - 1))
        shape = draw(st.sampled_from(["resend", "next_turn"]))
        episode = prime if shape == "resend" else prime + fa_block * draw(st.integers(1, 3))
        drafter = draw(st.sampled_from(drafters))  # shrinks towards the first given
        geo = Geometry(
            name="fuzz",
            groups=(GroupGeom(fa_kind, fa_block), *swa),
            blocks_per_chunk=bpc,
            max_num_batched_tokens=budget,
            max_model_len=episode + 4 * A + 1024,
            cpu_chunks=100_000,
            drafter=drafter,
        )
        return Case(geo, shape, prime, episode)

    return case()


def _recurrent_case_strategy() -> Any:
    from hypothesis import strategies as st

    @st.composite
    def case(draw: Any) -> Case:
        block = draw(st.sampled_from([64, 32, 16]))  # shrinks towards the presets' 64
        checkpoints = draw(st.booleans())
        states = tuple(
            GroupGeom(
                "mamba",
                block,
                name=f"r{i}",
                prefill_checkpoint_alignment=1 if checkpoints else None,
            )
            for i in range(draw(st.integers(1, 3)))
        )
        unit = draw(st.sampled_from([None, block // 4, block // 2]))
        bpc = draw(st.integers(1, 2))
        A = block * bpc
        budget = block * draw(st.integers(2, 32))
        prime = A * draw(st.integers(2, 48)) + draw(st.integers(0, A - 1))
        shape = draw(st.sampled_from(["resend", "next_turn"]))
        episode = prime if shape == "resend" else prime + block * draw(st.integers(1, 3))
        geo = Geometry(
            name="fuzz",
            groups=(*states, GroupGeom("full_attention", block, name="fa")),
            blocks_per_chunk=bpc,
            max_num_batched_tokens=budget,
            max_model_len=episode + 4 * A * 2 + 1024,
            cpu_chunks=100_000,
            prefix_match_unit=unit,
            dcp=draw(st.sampled_from([1, 2])),
        )
        return Case(geo, shape, prime, episode)

    return case()


def run_case(case: Case, *, trace_dir: str | None = None) -> dict[str, Any]:
    """Record and diff one case on the real scheduler; the episode's verdict as a dict.
    Without ``trace_dir`` the trace goes to a temporary directory, removed after the diff
    (a fuzz run replays hundreds of cases)."""
    from keytrace.vllm.lab.replay import replay

    if trace_dir is not None:
        return replay(case.geometry, [case.prime], case.episode, trace_dir=trace_dir).outcome()
    with tempfile.TemporaryDirectory(prefix="keytrace-fuzz-") as d:
        return replay(case.geometry, [case.prime], case.episode, trace_dir=d).outcome()


def fuzz(
    out_dir: str,
    *,
    seed: int = 0,
    max_examples: int = 100,
    budget_seconds: float | None = None,
    inject: str | None = None,
    fix: str | None = None,
    aligned_windows: bool = False,
    drafters: tuple[Drafter | None, ...] = (None,),
    recurrent: bool = False,
    progress: ProgressFn | None = None,
) -> FuzzResult:
    """Search for a mismatch; shrink the first one found. Writes ``out_dir/fuzz.json`` (and
    the minimal case's trace under ``out_dir/minimal-trace``); the Hypothesis example
    database lives in ``out_dir/hypothesis`` so a rerun starts from what it found.
    ``drafters``: each case runs one of these (None: no drafter), drawn; ``recurrent``:
    draw recurrent hybrids instead (no drafter: keytrace judges a recurrent group under a
    drafter only with lookahead hashes, which `RECURRENT_MTP`'s oracle layouts cover)."""
    if not drafters:
        raise ValueError("fuzz needs at least one drafter choice (None: no drafter)")
    if recurrent and drafters != (None,):
        raise ValueError("fuzz draws recurrent hybrids without a drafter")
    from hypothesis import HealthCheck, given, reject, settings
    from hypothesis import seed as hseed
    from hypothesis.database import DirectoryBasedExampleDatabase
    from hypothesis.errors import Unsatisfiable

    from keytrace.vllm.hook.patches import fixed, injected

    os.makedirs(out_dir, exist_ok=True)
    res = FuzzResult(seed=seed)
    failures: list[tuple[Case, dict[str, Any]]] = []
    t0 = time.monotonic()

    # Every case's outcome, so a replay is never a fresh run: Hypothesis replays cases it
    # has seen (the minimal failure at the end, and others), and a replay that differs
    # (rejected for the budget, say) is reported as a "flaky" test instead of the result.
    seen: dict[str, dict[str, Any] | None] = {}  # by repr: a Geometry holds a dict

    @hseed(seed)
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=DirectoryBasedExampleDatabase(os.path.join(out_dir, "hypothesis")),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )
    @given(_recurrent_case_strategy() if recurrent else _case_strategy(aligned_windows, drafters))
    def prop(case: Case) -> None:
        key = repr(case)
        if key not in seen:
            # the budget stops the search, never a shrink of a failure already found
            over = budget_seconds is not None and time.monotonic() - t0 > budget_seconds
            if over and not failures:
                res.stopped_by_budget = True
                raise _BudgetSpent  # not an Exception: Hypothesis lets it through at once
            seen[key] = _outcome(case, res, progress, max_examples)
        v = seen[key]
        if v is None or v["verdict"] == NO_VERDICT:  # vLLM does not build it, or no rules
            reject()
        if v["verdict"] == "mismatch":
            failures.append((case, v))
            raise AssertionError(case.describe())

    with fixed(fix), injected(inject):
        with contextlib.suppress(AssertionError, Unsatisfiable, _BudgetSpent):
            prop()
        res.seconds = time.monotonic() - t0
        if failures:
            res.failure, res.verdict = failures[-1]  # Hypothesis replays the minimal one last
            run_case(res.failure, trace_dir=os.path.join(out_dir, "minimal-trace"))
    with open(os.path.join(out_dir, "fuzz.json"), "w") as fh:
        json.dump(_jsonable(res), fh, indent=2)
    return res


class _BudgetSpent(BaseException):
    """Raised from the property when ``--budget`` is spent: a rejection would only make
    Hypothesis draw (and reject) until its own limit, minutes later."""


def _outcome(
    case: Case, res: FuzzResult, progress: ProgressFn | None, max_examples: int
) -> dict[str, Any] | None:
    """One case on the real scheduler, counted; None when vLLM refuses the configuration."""
    try:
        v = run_case(case)
    except Exception as exc:
        res.rejected += 1
        res.first_rejection = res.first_rejection or f"{type(exc).__name__}: {exc}"[:300]
        return None
    if v["verdict"] == NO_VERDICT:
        res.rejected += 1
        res.first_rejection = res.first_rejection or f"no verdict: {case.describe()}"[:300]
        return v
    res.cases += 1
    if progress is not None:
        progress("cases", res.cases, max_examples)
    return v


def _jsonable(res: FuzzResult) -> dict[str, Any]:
    out = asdict(res)
    out["cases_per_second"] = res.cases_per_second
    if res.failure is not None:
        out["failure"]["describe"] = res.failure.describe()
    return out
