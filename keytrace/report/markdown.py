"""``report.md``: the upstream-ready write-up of one mismatch, from the visible template
``templates/report.md.j2``. Pure: everything it says comes in as `ReportPage` (the lab's
`keytrace.vllm.lab.upstream` runs the sweeps and the minimizer that fill it), so equal pages
give byte-equal files (the golden test renders a fixed one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keytrace.analysis.lengthrule import LengthRule
from keytrace.analysis.results import EpisodeVerdict
from keytrace.analysis.sweep import FixComparison
from keytrace.report.templates import render


@dataclass(frozen=True)
class ReportPage:
    """What ``report.md`` says about one mismatch episode ``v`` of a trace with ``header``."""

    v: EpisodeVerdict
    header: dict[str, Any]
    keytrace_version: str
    prime_lengths: Sequence[int]
    episode_length: int
    evidence: str
    """The differ's text for the episode (`keytrace.report.text.render_episode`)."""
    rule: LengthRule
    step: int
    """Tokens between the swept lengths."""
    fixture: str
    standalone: str | None
    trace: str
    """The trace as given on the command line (for the reproduce line)."""
    html: str | None = None
    plot: str | None = None
    minimal: Any = None
    """`keytrace.vllm.lab.minimize.MinimizeResult` (duck-typed: ``replays``,
    ``result.describe()``, ``verdict``), or None when not computed."""
    minimal_trace: str | None = None
    fix: FixComparison | None = None
    fix_text: str = ""
    no_standalone: str = ""
    """Why there is no vLLM-only test (`keytrace.report.standalone.unsupported`)."""
    standalone_recurrent: bool = False
    """The vLLM-only test is the recurrent one (it runs vLLM's scheduler:
    `keytrace.report.standalone.is_recurrent_plan`)."""


def _case(page: ReportPage | StalledPage) -> dict[str, Any]:
    """What both report templates say of the case alike: versions, the offloaded groups, the
    traffic, the differ's text, the files written beside the report."""
    header = page.header
    return {
        "v": page.v,
        "keytrace_version": page.keytrace_version,
        "vllm_version": header.get("vllm_version", "?"),
        "modified": header.get("vllm_modified") or [],
        "groups": [g for g in header.get("groups", []) if g.get("offloaded", True)],
        "traffic": traffic(page.prime_lengths, page.episode_length),
        "evidence": page.evidence.rstrip(),
        "html": page.html,
        "fix": page.fix,
        "fix_text": page.fix_text,
        "fixture": page.fixture,
        "standalone": page.standalone,
        "no_standalone": page.no_standalone,
        "trace": page.trace,
    }


def render_report(page: ReportPage) -> str:
    """``report.md``'s text for ``page``."""
    v, header = page.v, page.header
    t = v.terminal
    return render(
        "report.md.j2",
        **_case(page),
        binding_label=v.binding_label or "?",
        cause=t.cause if t else "?",
        header=header,
        rule=page.rule,
        step=page.step,
        plot=page.plot,
        minimal=page.minimal,
        minimal_trace=page.minimal_trace,
        standalone_recurrent=page.standalone_recurrent,
    )


def traffic(primes: Sequence[int], episode: int) -> str:
    """The recorded traffic in words."""
    if not primes:
        return f"a cold request of {episode:,} tokens"
    before = " then ".join(f"{p:,}" for p in primes)
    same = len(primes) == 1 and primes[0] == episode
    how = "an identical resend" if same else f"a {episode:,}-token request"
    return f"requests of {before} tokens (stores acknowledged), a GPU-only prefix-cache reset, then {how}"


@dataclass(frozen=True)
class CapacityRow:
    """One replay of a stalled case with the CPU tier at ``cpu_chunks`` (and, with a
    candidate fix, the same replay with it)."""

    cpu_chunks: int
    verdict: str
    external: int
    fixed_verdict: str | None = None
    fixed_external: int | None = None


@dataclass(frozen=True)
class StalledPage:
    """What ``report.md`` says about a stalled request ``v`` on a tiered manager."""

    v: EpisodeVerdict
    header: dict[str, Any]
    keytrace_version: str
    prime_lengths: Sequence[int]
    episode_length: int
    evidence: str
    rows: Sequence[CapacityRow]
    give_up: int
    fixture: str
    standalone: str | None
    trace: str
    html: str | None = None
    fix: str | None = None
    fix_text: str = ""
    no_standalone: str = ""
    """Why there is no vLLM-only test (`keytrace.report.standalone.unsupported`)."""


def render_stalled_report(page: StalledPage) -> str:
    """``report.md``'s text for a stalled request (``templates/report_stalled.md.j2``)."""
    from keytrace.judge.definitions import STALL_EPISODES

    header = page.header
    tiers = header.get("secondary_tiers") or []
    return render(
        "report_stalled.md.j2",
        **_case(page),
        spec=header.get("offload_spec") or "?",
        cpu_chunks=header.get("cpu_num_chunks"),
        tiers=" and ".join(f"a `{t.get('type')}` tier" for t in tiers) or "no tier",
        stall_episodes=STALL_EPISODES,
        rows=page.rows,
        give_up=page.give_up,
    )
