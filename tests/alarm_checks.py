"""The live alarm against the offline differ, on one recorded workload (shared by the
integration tests that drive the real scheduler)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from keytrace.analysis import frames
from keytrace.analysis.diff import diff
from keytrace.analysis.results import DiffReport, EpisodeVerdict
from keytrace.format.reader import Trace, open_trace
from keytrace.judge import definitions as d
from keytrace.live.alarm import Alarm, Judged
from keytrace.live.registry import AlarmSettings

SETTINGS = AlarmSettings(keep_judged=True, interval=1e9)
"""Every verdict kept; repeats never summarised (a test's run is shorter than a minute)."""

FIELDS = (
    "verdict",
    "E",
    "cause",
    "decisive",
    "binding_group",
    "terminal_chunk",
    "terminal_result",
    "terminal_cause",
    "short",
    "limit",
)
"""What the alarm and the differ must agree on for every episode: the verdict and E; for a
shortfall the cause that names its tokens and every decisive cause, the binding group, the
terminal key's chunk, result and cause, and the tokens short of E; for a ``limited``
episode the limit it names."""
Fields = dict[str, Any]


def offline_fields(v: EpisodeVerdict, N: int) -> Fields:
    """`FIELDS` of the differ's verdict (``N``: the episode's num_tokens, from the trace)."""
    short = v.verdict in ("explained", "mismatch")
    # a shortfall the request's own limit explains (`LIMIT_CAUSES`) keeps its evidence
    detailed = short or (v.verdict == "limited" and bool(v.needed))
    causes = [(n.group_id, n.cause) for n in v.needed]
    decisive = d.decisive(d.candidates_of(causes, v.binding_group))
    t = v.terminal
    return {
        "verdict": v.verdict,
        "E": v.E,
        "cause": d.shortfall_cause(decisive, t.result if t else None) if detailed else None,
        "decisive": tuple(decisive) if detailed else (),
        "binding_group": v.binding_group if detailed else None,
        "terminal_chunk": t.chunk if detailed and t else None,
        "terminal_result": t.result if detailed and t else None,
        "terminal_cause": t.cause if detailed and t else None,
        "short": (
            d.short_of_E(v.E, *d.served(v.S, N, v.accepted_tokens, v.external_tokens))
            if short
            else 0
        ),
        "limit": v.limit if v.verdict == "limited" else None,
    }


def online_fields(j: Judged, alarm: Alarm) -> Fields:
    """`FIELDS` of the alarm's verdict."""
    short = j.verdict in ("explained", "mismatch", "undetermined")
    short = short or (j.verdict == "limited" and bool(j.decisive))
    return {
        "verdict": j.verdict,
        "E": j.E,
        "cause": j.cause if short else None,
        "decisive": j.decisive,
        "binding_group": j.binding_group,
        "terminal_chunk": j.term_chunk if j.term_key else None,
        "terminal_result": j.term_result if j.term_key else None,
        "terminal_cause": j.term_cause if j.term_key else None,
        "short": (alarm.shorts or {}).get((j.instance, j.episode), 0),
        "limit": j.limit,
    }


def field_differences(
    trace: Trace, report: DiffReport, alarms: list[Alarm]
) -> list[tuple[Any, str, Any, Any]]:
    """(episode, field, differ's, alarm's) for every field of every episode that differs."""
    n_tokens = {
        (inst, s): N
        for inst, s, N in frames.collect(
            frames.episodes(trace).select("inst", "s", "N")
        ).iter_rows()
    }
    online = {(j.instance, j.episode): (j, a) for a in alarms for j in a.judged or []}
    out = []
    for v in report.episodes:
        j, a = online[(v.instance, v.episode)]
        want = offline_fields(v, n_tokens[(v.instance_id, v.episode)])
        got = online_fields(j, a)
        out += [
            ((v.instance, v.req_id, v.episode), f, want[f], got[f])
            for f in FIELDS
            if want[f] != got[f]
        ]
    return out


def assert_alarm_agrees(trace_dir: str, alarms: list[Alarm], warnings: list[str]) -> DiffReport:
    """Episode by episode, every one of `FIELDS` of the alarm's verdict is the differ's; its
    counters are the differ's counts and shortfall tokens; it warned once per (engine,
    group, cause) of the differ's mismatches, at the first such episode, and about nothing
    else."""
    trace = open_trace(trace_dir)
    report = diff(trace, all_episodes=True)
    judged = {(j.instance, j.episode): j for a in alarms for j in a.judged or []}
    offline = {(v.instance, v.episode): v for v in report.episodes}
    assert judged.keys() == offline.keys()
    assert field_differences(trace, report, alarms) == []
    online_counts = sum((Counter(a.counts()) for a in alarms), Counter())
    assert online_counts == Counter(report.counts), (online_counts, report.counts)
    assert report.lost is not None
    short_offline = {
        (r.engine, r.cause, "" if r.group is None else str(r.group)): r.tokens
        for r in report.lost.rows
        if r.category == "short" and r.engine != "all"
    }
    short_online: Counter[tuple[str, str, str]] = Counter()
    for a in alarms:
        short_online.update(a.short_tokens)
    assert dict(short_online) == short_offline
    # one warning per new (engine, group, cause), at the differ's first such mismatch
    first: dict[tuple[str, Any, Any], Any] = {}
    for v in report.episodes:  # sequence order
        if v.verdict == "mismatch":
            j = judged[(v.instance, v.episode)]
            first.setdefault((v.engine_id or v.instance, v.binding_group, j.cause), v)
    warned = [j for a in alarms for j in a.first]
    assert {(j.instance, j.episode) for j in warned} == {
        (v.instance, v.episode) for v in first.values()
    }
    for j in warned:
        v = offline[(j.instance, j.episode)]
        assert v.terminal is not None and (j.binding_group, j.term_chunk) == (
            v.terminal.group_id,
            v.terminal.chunk,
        )
    assert len(warnings) == len(first)
    assert all(f"request {v.req_id} " in w for v, w in zip(first.values(), warnings, strict=False))
    # and one per engine for its first stalled request, at the differ's first stalled episode
    stalled: dict[str, Any] = {}
    for v in report.episodes:
        if v.verdict == "stalled":
            stalled.setdefault(v.engine_id or v.instance, v)
    assert {(j.instance, j.episode) for a in alarms for j in a.stalled_first} == {
        (v.instance, v.episode) for v in stalled.values()
    }
    return report
