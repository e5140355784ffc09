"""``keytrace doctor --verify``: prove keytrace's rules against the installed vLLM.

The rules keytrace judges by restate vLLM's lookup and store arithmetic; a release (or a
commit on main) that changes that arithmetic makes them silently wrong. The oracle
(`keytrace.vllm.lab.oracle`: every shortfall looked up again alone, on a fresh real
scheduler) is the arbiter. This module runs it on seeded workloads through the installed
vLLM, as many as a time budget allows, in an order that covers the switches first (each
geometry, a CPU and a tiered manager, no drafter, EAGLE and MTP lookahead, recurrent state
groups in chunks of one and two blocks and under decode context parallelism, retention
intervals), and keeps the
outcome under the installed code's rules digest (`keytrace.vllm.hook.rulecode`): the
header of every trace recorded on that code then says whether its verdicts were verified,
and ``keytrace diff`` refuses AGREE on code where the oracle disagreed.

Also checked on each workload: the live alarm's verdict counts equal the differ's (the
alarm and the differ are one judgement; a difference is a disagreement too).
"""

from __future__ import annotations

import datetime
import logging
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from keytrace.analysis.geometry import Drafter, builtin, retention_text
from keytrace.judge.trust import Verification, features, record_run, uncovered
from keytrace.vllm.hook import rulecode
from keytrace.vllm.lab.workload import WorkloadSpec, study_workload

ProgressFn = Callable[[str, int, int], None]

DRAFTERS: tuple[Drafter | None, ...] = (
    None,
    Drafter("eagle", 2),
    Drafter("mtp", 1, 3),
    Drafter("mtp", 2, 3),
    Drafter("mtp", 3, 3),
)
"""No drafter, EAGLE (lookahead 1 on vLLM 0.34.0) and MTP with 1, 2 and 3 speculative
tokens (lookahead 1, 2, 3): every lookahead the releases resolve."""

LAYOUTS: tuple[tuple[str, tuple[str, ...], int | None], ...] = (
    ("dsv4", (), None),
    ("hybrid", (), 16),
    ("small", ("fs",), 14),
    ("dsv4", ("example",), 60),
)
"""(geometry, secondary tiers, CPU chunks): both hybrid geometries on a CPU tier small
enough to evict, and a tiered manager (vLLM's own, over a real fs tier and the in-memory
example tier) with a primary small enough to promote."""

RECURRENT_LAYOUTS: tuple[tuple[str, tuple[str, ...], int | None, int, Drafter | None], ...] = (
    ("recurrent", (), 30, 1, None),
    ("recurrent", (), 30, 2, None),
    ("recurrent", ("fs",), 40, 1, None),
    ("recurrent_mtp", (), 40, 2, None),
    ("recurrent_mtp", (), 40, 2, Drafter("mtp", 2, 3)),
)
"""(geometry, secondary tiers, CPU chunks, blocks per chunk, drafter): recurrent state
groups on a CPU tier that evicts, in chunks of one block and of two (where a prompt's last
state may fall inside a chunk), under a tiered manager, and with an MTP drafter (the
preset's, L = 1 on vLLM 0.34.0; and multi-module, L = 2). A workload keytrace does not
judge (a drafter without lookahead hashes, vLLM 0.33.0) is skipped, with why."""

DCP_LAYOUTS: tuple[
    tuple[str, tuple[str, ...], int | None, int, int, int | None, Drafter | None], ...
] = (
    ("recurrent", (), 30, 1, 2, None, None),
    ("recurrent", (), 30, 2, 2, None, None),
    ("recurrent", (), 30, 1, 4, None, None),
    ("recurrent", (), 30, 1, 2, 16, None),
    ("recurrent_mtp", (), 40, 2, 2, None, None),
    ("dsv3", (), 24, 1, 2, None, None),
    ("dsv3", (), 24, 1, 4, None, None),
    ("dsv3", ("fs",), 24, 1, 2, None, None),
    ("dsv3_mla", ("fs",), 12, 1, 2, None, None),
    ("dsv3_mla", ("fs",), 12, 2, 2, None, None),
    ("dsv3_mla", ("fs",), 12, 1, 4, None, None),
    ("dsv3", ("fs",), 12, 1, 2, None, Drafter("mtp", 2, 3)),
)
"""(geometry, secondary tiers, CPU chunks, blocks per chunk, decode context parallel
size, prefix match unit, drafter): attention groups under DCP (DeepSeek-V3-like MLA, every
block spanning 64 × DCP tokens, with its MTP draft group and without), and recurrent state
groups under DCP, where vLLM scales the full-attention block (and chunk) by the DCP size
and not the recurrent one, and its GPU cache keeps a prompt's last state at the hash unit
(``partial_hash_hits_enabled`` accepts a recurrent block equal to it under DCP): states
that end no full-attention chunk; a hash unit below the recurrent block, where the GPU
cache hits inside a block while the connector keeps partial tails off (DCP); and the MTP
drafter (lookahead hashes on vLLM 0.34.0; not judged on 0.33.0, skipped).

The attention layouts: on a CPU tier (the LRU tier evicts a prefix from its start, so
every resend is a hit, cold or deferred: nothing for the oracle to check, only the
differ's and the alarm's counts to compare) and on a tiered manager over fs with a
primary of 12 chunks, whose promotions leave shortfalls the oracle checks
(`keytrace.judge.trust.ATTENTION_DCP`): MLA alone at DCP 2 and 4 and in chunks of two
blocks, and with an MTP drafter's lookahead hashes (vLLM 0.34.0; its legacy hashes on
0.33.0 are not judged on a tiered manager, skipped, as is the MLA + MTP group without a
drafter there). Run with the recurrent layouts unless asked apart (`plan`'s ``dcp``)."""

RETENTION_LAYOUTS: tuple[
    tuple[str, tuple[str, ...], int | None, int | None, int | None, Drafter | None], ...
] = (
    ("hybrid", (), 16, None, 128, None),
    ("hybrid", (), 16, None, None, None),
    ("small", (), 24, None, 128, None),
    ("small", ("fs",), 14, None, None, None),
    ("hybrid", (), 16, 2, 192, None),
    ("dsv4", (), None, None, 512, None),
    ("hybrid", (), 16, None, 128, Drafter("mtp", 2, 3)),
)
"""(geometry, secondary tiers, CPU chunks, blocks per chunk, retention interval, drafter):
sliding-window layouts under vLLM's ``prefix_cache_retention_interval``, a positive interval
(tails every that many tokens) and dense (None: every block kept), on a CPU tier that
evicts: without and with an EAGLE/MTP group (legacy hashes: its tails shifted for the
peek), under a tiered manager, an interval that is no multiple of the full-attention chunk
(two blocks per chunk: chunk 128, interval 192), DeepSeek-V4's five groups, and an MTP
drafter's lookahead hashes (vLLM 0.34.0). Recurrent groups under a retention interval are
not judged (`keytrace.judge.trust.uncovered`): none here."""

PARTIAL_LAYOUTS: tuple[tuple[str, tuple[str, ...], int | None, int], ...] = (
    ("recurrent", (), 30, 16),
    ("recurrent", (), 20, 16),
    ("recurrent", (), 60, 32),
    ("recurrent_mtp", (), 40, 16),
)
"""(geometry, secondary tiers, CPU chunks, prefix match unit): recurrent state groups with
partial tails on (chunks of one block, a hash unit below it: vLLM stores every group's key
at a producer's tail inside a block and probes the hash boundaries past the complete hit),
on a CPU tier that evicts (two sizes), hash units of a quarter and of half the 64-token
block, and the MTP drafter (lookahead hashes on vLLM 0.34.0; on 0.33.0 a drafter's legacy
hashes are not judged: skipped). No tiered manager: vLLM's CPU primary fails an assertion
on partial tails there (docs/findings.md), and keytrace does not judge it
(`keytrace.judge.trust.uncovered`). Run only when asked (`plan`'s ``partial``)."""

CHECKPOINT_LAYOUTS: tuple[tuple[str, tuple[str, ...], int | None, int, int], ...] = (
    ("nemotron_h", (), 30, 1, 1),
    ("nemotron_h", (), 30, 2, 1),
    ("nemotron_h", ("fs",), 40, 1, 1),
    ("nemotron_h", (), 30, 1, 2),
)
"""(geometry, secondary tiers, CPU chunks, blocks per chunk, decode context parallel
size): recurrent state groups whose prompt's last state is exported from inside the final
prefill chunk (the Nemotron-H-like preset: Mamba2's prefill checkpoints,
`keytrace.judge.rules.CHECKPOINT_BLOCK`), on a CPU tier that evicts, in chunks of one
block and of two (a state that ends no chunk), under a tiered manager, and under DCP 2
(a full-attention chunk of two recurrent blocks). Run only when asked (`plan`'s
``checkpoint``)."""


def plan(
    seeds: int = 3,
    drafters: tuple[Drafter | None, ...] = DRAFTERS,
    recurrent: bool = True,
    layouts: bool = True,
    dcp: bool | None = None,
    retention: bool = True,
    partial: bool = False,
    checkpoint: bool = False,
) -> Iterator[WorkloadSpec]:
    """The workloads `verify` runs, covering every layout and drafter (``layouts``),
    every recurrent layout (``recurrent``), every DCP layout (``dcp``; None: with the
    recurrent ones), every retention layout (``retention``) and, when asked, every
    partial-tail layout (``partial``) and every prefill-checkpoint layout
    (``checkpoint``) once before any repeats with another seed."""
    dcp = recurrent if dcp is None else dcp
    for seed in range(seeds):
        for i, drafter in enumerate(drafters if layouts else ()):
            for j, (geometry, tiers, cpu_chunks) in enumerate(LAYOUTS):
                yield WorkloadSpec(
                    geometry=geometry,
                    seed=1000 * seed + 10 * i + j,
                    conversations=10,
                    tiers=tiers,
                    cpu_chunks=cpu_chunks,
                    drafter=drafter,
                )
        for j, (geometry, tiers, cpu_chunks, bpc, drafter) in enumerate(
            RECURRENT_LAYOUTS if recurrent else ()
        ):
            yield WorkloadSpec(
                geometry=geometry,
                seed=1000 * seed + 500 + j,
                conversations=10,
                tiers=tiers,
                cpu_chunks=cpu_chunks,
                blocks_per_chunk=bpc,
                drafter=drafter,
            )
        for j, (geometry, tiers, cpu_chunks, bpc, size, unit, drafter) in enumerate(
            DCP_LAYOUTS if dcp else ()
        ):
            yield WorkloadSpec(
                geometry=geometry,
                seed=1000 * seed + 600 + j,
                conversations=10,
                tiers=tiers,
                cpu_chunks=cpu_chunks,
                blocks_per_chunk=bpc,
                dcp=size,
                prefix_match_unit=unit,
                drafter=drafter,
            )
        for j, (geometry, tiers, cpu_chunks, bpc_or_none, interval, drafter) in enumerate(
            RETENTION_LAYOUTS if retention else ()
        ):
            yield WorkloadSpec(
                geometry=geometry,
                seed=1000 * seed + 700 + j,
                conversations=10,
                tiers=tiers,
                cpu_chunks=cpu_chunks,
                blocks_per_chunk=bpc_or_none,
                retention_interval=interval,
                drafter=drafter,
            )
        for j, (geometry, tiers, cpu_chunks, unit) in enumerate(PARTIAL_LAYOUTS if partial else ()):
            yield WorkloadSpec(
                geometry=geometry,
                seed=1000 * seed + 800 + j,
                conversations=10,
                tiers=tiers,
                cpu_chunks=cpu_chunks,
                blocks_per_chunk=1,
                prefix_match_unit=unit,
            )
        for j, (geometry, tiers, cpu_chunks, bpc, size) in enumerate(
            CHECKPOINT_LAYOUTS if checkpoint else ()
        ):
            yield WorkloadSpec(
                geometry=geometry,
                seed=1000 * seed + 900 + j,
                conversations=10,
                tiers=tiers,
                cpu_chunks=cpu_chunks,
                blocks_per_chunk=bpc,
                dcp=size,
            )


def first_pass(
    drafters: tuple[Drafter | None, ...],
    recurrent: bool,
    layouts: bool,
    dcp: bool | None = None,
    retention: bool = True,
    partial: bool = False,
    checkpoint: bool = False,
) -> int:
    """How many of `plan`'s workloads cover each layout once."""
    dcp = recurrent if dcp is None else dcp
    return (
        len(drafters) * len(LAYOUTS) * layouts
        + len(RECURRENT_LAYOUTS) * recurrent
        + len(DCP_LAYOUTS) * dcp
        + len(RETENTION_LAYOUTS) * retention
        + len(PARTIAL_LAYOUTS) * partial
        + len(CHECKPOINT_LAYOUTS) * checkpoint
    )


@dataclass(frozen=True)
class WorkloadRun:
    """One workload of a ``--verify`` run."""

    workload: str
    requests: int
    episodes: dict[str, int]
    """The differ's episodes by verdict."""
    checked: int
    """Shortfall episodes the oracle looked up again."""
    disagreements: int
    seconds: float


@dataclass
class VerifyOutcome:
    """What one ``--verify`` run checked on the installed code."""

    digest: str
    vllm: str
    workloads: int = 0
    episodes: int = 0
    """Shortfall episodes the oracle looked up again."""
    disagreements: list[str] = field(default_factory=list)
    """One line per oracle disagreement or alarm/differ difference."""
    runs: list[WorkloadRun] = field(default_factory=list)
    """Each workload that ran: what it was and what the differ and the oracle saw."""
    skipped: list[str] = field(default_factory=list)
    """Workloads that did not run (a drafter this vLLM cannot configure, vLLM failing on
    the workload), with why: nothing checked there."""
    seconds: float = 0.0
    covers: list[str] = field(default_factory=list)
    """`keytrace.judge.trust.features` the checked workloads exercised (``recurrent``)."""

    @property
    def verified(self) -> bool:
        return self.episodes > 0 and not self.disagreements


def verify(
    *,
    budget_seconds: float = 600.0,
    min_episodes: int = 300,
    max_workloads: int | None = None,
    progress: ProgressFn | None = None,
    keep: bool = True,
    drafters: tuple[Drafter | None, ...] = DRAFTERS,
    recurrent: bool = True,
    layouts: bool = True,
    retention: bool = True,
    seeds: int = 3,
    dcp: bool | None = None,
    partial: bool = False,
    checkpoint: bool = False,
) -> VerifyOutcome:
    """Run the oracle (and the alarm) on `plan`'s workloads through the installed vLLM
    until ``min_episodes`` shortfalls were checked after every layout and drafter ran once,
    or ``budget_seconds`` passed (a workload in progress finishes) or ``max_workloads``
    ran (a bound that does not depend on the machine's speed); with ``keep``, record the
    outcome under the installed code's rules digest. ``drafters``: the drafters to
    run (default: none, EAGLE, MTP with 1, 2, 3 tokens); ``recurrent``: also the
    recurrent layouts; ``layouts``: the attention layouts (False: recurrent only);
    ``dcp``: the recurrent layouts under decode context parallelism (None: with
    ``recurrent``); ``retention``: also the retention layouts (`RETENTION_LAYOUTS`);
    ``partial``: the partial-tail layouts; ``checkpoint``: the prefill-checkpoint layouts;
    ``seeds``: how many rounds of every layout the plan holds."""
    from keytrace.vllm import require_vllm
    from keytrace.vllm.hook.support import vllm_info

    require_vllm()  # one line, not every workload skipped for the same reason
    digest = rulecode.rules_digest()
    out = VerifyOutcome(digest=digest, vllm=vllm_info().version or "?")
    t0 = time.monotonic()
    specs = list(
        plan(
            seeds,
            drafters=drafters,
            recurrent=recurrent,
            layouts=layouts,
            dcp=dcp,
            retention=retention,
            partial=partial,
            checkpoint=checkpoint,
        )
    )
    once = first_pass(drafters, recurrent, layouts, dcp, retention, partial, checkpoint)
    for n, spec in enumerate(specs):
        elapsed = time.monotonic() - t0
        if elapsed >= budget_seconds or (n >= once and out.episodes >= min_episodes):
            break
        if max_workloads is not None and n >= max_workloads:
            break
        if progress is not None:
            progress(f"verify {_name(spec)}", n, len(specs))
        _run_one(spec, out)
    out.seconds = time.monotonic() - t0
    if keep and (out.episodes or out.disagreements):
        record_run(
            digest,
            Verification(
                vllm=out.vllm,
                episodes=out.episodes,
                covers=tuple(out.covers),
                disagreements=len(out.disagreements),
                when=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            ),
        )
    return out


def _name(spec: WorkloadSpec) -> str:
    tiers = "+".join(("cpu", *spec.tiers))
    chosen = spec.drafter or builtin(spec.geometry).drafter  # a preset may carry one
    drafter = chosen.spec if chosen is not None else "no drafter"
    bpc = f" bpc {spec.blocks_per_chunk}" if spec.blocks_per_chunk else ""
    dcp = f" dcp {spec.dcp}" if spec.dcp and spec.dcp > 1 else ""
    unit = f" hash {spec.prefix_match_unit}" if spec.prefix_match_unit else ""
    kept = spec.retention_interval
    retention = f" retention {retention_text(kept)}" if kept != 0 else ""
    return f"{spec.geometry}{bpc}{dcp}{unit} {tiers} {drafter}{retention} seed {spec.seed}"


def _alarm_lines(record: logging.LogRecord) -> bool:
    """Keep every keytrace log line but the alarm's warnings: here the alarm runs to be
    compared with the differ, not to tell an operator."""
    return not record.pathname.replace("\\", "/").endswith(("live/alarm.py", "live/warnings.py"))


def _run_one(spec: WorkloadSpec, out: VerifyOutcome) -> None:
    log = logging.getLogger("keytrace")
    log.addFilter(_alarm_lines)
    try:
        with tempfile.TemporaryDirectory(prefix="keytrace-verify-") as d:
            try:
                study = study_workload(spec, d, alarm=True, oracle=True)
            except Exception as exc:
                # a drafter or tier this vLLM cannot configure, or vLLM failing on the
                # workload itself (0.31.0 asserts when a request with a load in flight is
                # preempted): nothing checked, said as such, and the next workload runs
                out.skipped.append(f"{_name(spec)}: {_failure(exc)}")
                return
    finally:
        log.removeFilter(_alarm_lines)
    gaps = uncovered(study.report.header)
    if gaps:  # recorded, not judged: nothing to verify (and no alarm to compare)
        out.skipped.append(f"{_name(spec)}: not judged: {'; '.join(gaps)}")
        return
    out.workloads += 1
    cases = study.oracle or []
    out.episodes += len(cases)
    if cases:
        for feature in features(study.report.header):  # attention, recurrent, ...
            if feature not in out.covers:
                out.covers.append(feature)
    found = [f"{_name(spec)}: {c.describe()}" for c in study.disagreements]
    if study.alarm_counts is not None and study.alarm_counts != study.report.counts:
        found.append(
            f"{_name(spec)}: the live alarm counted {study.alarm_counts}, "
            f"the differ {study.report.counts}"
        )
    out.disagreements += found
    out.runs.append(
        WorkloadRun(
            workload=_name(spec),
            requests=study.result.requests,
            episodes=dict(study.report.counts),
            checked=len(cases),
            disagreements=len(found),
            seconds=round(study.result.seconds, 1),
        )
    )


def _failure(exc: BaseException) -> str:
    """One line for a workload that did not run: the exception and where it was raised."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}{where}: {exc}".rstrip(": ")


__all__ = [
    "CHECKPOINT_LAYOUTS",
    "DCP_LAYOUTS",
    "DRAFTERS",
    "LAYOUTS",
    "PARTIAL_LAYOUTS",
    "RECURRENT_LAYOUTS",
    "RETENTION_LAYOUTS",
    "VerifyOutcome",
    "WorkloadRun",
    "first_pass",
    "plan",
    "verify",
]
