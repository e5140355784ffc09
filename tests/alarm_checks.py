"""The live alarm against the offline differ, on one recorded workload (shared by the
integration tests that drive the real scheduler)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from keytrace.analysis.diff import diff
from keytrace.analysis.results import DiffReport
from keytrace.format.reader import open_trace
from keytrace.live.alarm import Alarm, AlarmSettings

SETTINGS = AlarmSettings(keep_judged=True, interval=1e9)
"""Every verdict kept; repeats never summarised (a test's run is shorter than a minute)."""


def assert_alarm_agrees(trace_dir: str, alarms: list[Alarm], warnings: list[str]) -> DiffReport:
    """Episode by episode, the alarm's verdict and E are the differ's; its counters are the
    differ's counts and shortfall tokens; it warned once per (engine, group, cause) of the
    differ's mismatches, at the first such episode, and about nothing else."""
    report = diff(open_trace(trace_dir), all_episodes=True)
    judged = {(j.instance, j.episode): j for a in alarms for j in a.judged or []}
    offline = {(v.instance, v.episode): v for v in report.episodes}
    assert judged.keys() == offline.keys()
    wrong = [
        (k, v.verdict, v.E, judged[k].verdict, judged[k].E)
        for k, v in offline.items()
        if (v.verdict, v.E) != (judged[k].verdict, judged[k].E)
    ]
    assert wrong == []
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
    return report
