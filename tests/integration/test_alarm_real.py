"""The live alarm on the real vLLM 0.33.0 scheduler: the live stock miss warns at exactly the
group and chunk the differ names, stock traffic on a geometry where vLLM's rules agree
raises nothing through evictions, in-flight stores and two engines, and the metrics
scraped over HTTP equal the offline diff of the same trace.

(Every oracle workload, stock and injected, also runs with the alarm on and must agree
with the differ episode by episode: tests/integration/test_oracle.py.)
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.request
from pathlib import Path

import pytest

from tests.alarm_checks import SETTINGS, assert_alarm_agrees
from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import builtin  # noqa: E402
from keytrace.live import metrics  # noqa: E402
from keytrace.live.registry import alarms  # noqa: E402
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload  # noqa: E402


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]


def test_the_live_17975_miss_warns_at_group_2_chunk_277(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # dsv4, an identical resend of 17,975 tokens after a GPU-only reset (docs/findings.md):
    # E = 17,920 leaves 55 tokens, less than one 64-token MTP chunk, so the peek chunk 280
    # is not keyable; vLLM's MTP lookup then needs chunk 277 (tokens 17,728-17,792) one
    # further left, which the store, keeping the window for a peek it never made, did not
    # keep. One warning, at the resend, with the differ's group and chunk.
    from keytrace.vllm.hook.patches import recording
    from keytrace.vllm.lab.harness import Harness

    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "trace")
    with recording(d, SETTINGS):
        h = Harness(builtin("dsv4"), max_prompt_tokens=17_975)
        h.submit(17_975, chain=0)
        h.run_until_idle()
        h.reset_gpu_prefix_cache()
        resend = h.submit(17_975, chain=0)
        h.run_until_idle()
    [warning] = _warnings(caplog)
    assert f"request {resend} " in warning
    assert "got 0 external tokens, expected E=17,920 from S=0" in warning
    assert "group 2 (SWA, MTP) ended the match at chunk 277 (tokens 17,728-17,792)" in warning
    assert f"Details: keytrace diff {d} --request {resend}" in warning
    report = assert_alarm_agrees(d, alarms(), _warnings(caplog))
    assert report.first_mismatch is not None and report.first_mismatch.req_id == resend


def test_stock_traffic_where_the_rules_agree_raises_nothing_and_http_metrics_match(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "trace")
    # hybrid (no MTP group): stock vLLM 0.33.0 keeps what lookups need. A small CPU tier
    # (evictions), acknowledgements three steps late (in-flight stores), two engines with
    # rerouting (another engine's stores), GPU cache drops (preemption, resumed requests).
    spec = WorkloadSpec(geometry="hybrid", seed=21, cpu_chunks=60, reroute_rate=0.4)
    settings = dataclasses.replace(SETTINGS, metrics_port=0, metrics_addr="127.0.0.1")
    run_workload(spec, d, alarm=settings)
    assert _warnings(caplog) == []
    report = assert_alarm_agrees(d, alarms(), [])
    assert report.counts.get("mismatch", 0) == 0
    # the traffic had what must not raise an alarm: explained shortfalls (evictions), stores
    # in flight at lookups (HIT_PENDING: vLLM defers the request), two engines
    assert report.counts["explained"] > 0 and report.counts["deferred"] > 0
    causes = {c for a in alarms() for j in a.judged or [] for c in j.decisive}
    assert causes == {"evicted"}
    assert len({j.instance for a in alarms() for j in a.judged or []}) == 2
    # scraped over HTTP from this process's endpoint, parsed by prometheus_client
    port = metrics.serving_port()
    assert port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    scraped: dict[str, float] = {}
    for s in families["keytrace_episodes"].samples:
        scraped[s.labels["verdict"]] = scraped.get(s.labels["verdict"], 0.0) + s.value
    assert scraped == {k: float(v) for k, v in report.counts.items()}
    pending = [
        s.value
        for s in families["keytrace_keys_looked_up"].samples
        if s.labels["result"] == "HIT_PENDING"
    ]
    assert sum(pending) > 0
    assert report.lost is not None
    short = {
        (s.labels["engine"], s.labels["cause"], s.labels["group"]): s.value
        for s in families["keytrace_short_of_expected_tokens"].samples
    }
    assert short == {
        (r.engine, r.cause, str(r.group)): float(r.tokens)
        for r in report.lost.rows
        if r.category == "short" and r.engine != "all"
    }


SEQ_COLUMNS = ("seq", "episode", "term_seq", "last_hit_seq")
SEQ_LISTS = ("head_seqs", "tail_seqs")
WHO = ("ts_ns", "instance", "instance_id", "engine_id", "pid")
"""Columns that name the process, the engine (vLLM gives each a random id) or the wall
clock: what two runs of one workload cannot share."""


def _rows(trace_dir: str) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every kind, as comparable tuples: the columns of `WHO` dropped, sequence
    numbers counted from the trace's first (two runs in one process share one counter)."""
    import polars as pl

    from keytrace.format.reader import open_trace

    trace = open_trace(trace_dir)
    frames = {k: trace.frame(k).collect() for k in ("store", "lookup", "load", "step", "tier")}
    frames = {k: f for k, f in frames.items() if f.height}
    base = min(int(f.get_column("seq").min()) for f in frames.values())  # type: ignore[arg-type]
    out = {}
    for kind, f in frames.items():
        f = f.drop([c for c in WHO if c in f.columns])
        f = f.with_columns(
            *(pl.col(c) - base for c in SEQ_COLUMNS if c in f.columns),
            *(pl.col(c).list.eval(pl.element() - base) for c in SEQ_LISTS if c in f.columns),
        )
        out[kind] = sorted(
            map(
                tuple,
                f.cast({c: pl.String for c in f.columns if f[c].dtype == pl.Categorical}).rows(),
            ),
            key=repr,
        )
    return out


@pytest.mark.parametrize(
    "spec",
    [
        WorkloadSpec(geometry="dsv4", seed=3, cpu_chunks=120),
        # the example tier is synchronous: a run repeats exactly (fs tier threads do not)
        WorkloadSpec(geometry="small", seed=2, tiers=("example",), cpu_chunks=14),
    ],
    ids=["dsv4", "small-tiered"],
)
def test_the_trace_does_not_depend_on_the_alarm(spec: WorkloadSpec, tmp_path: Path) -> None:
    """The same seeded traffic recorded with the live alarm off and on writes the same rows,
    every kind, every column but who wrote them and when: the keys a lookup needs and never
    asked for are listed from the recorder's own chain book, not from the alarm's E."""
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    run_workload(spec, off)
    run_workload(spec, on, alarm=SETTINGS)
    rows_off, rows_on = _rows(off), _rows(on)
    assert rows_off.keys() == rows_on.keys()
    for kind in rows_off:
        assert rows_off[kind] == rows_on[kind], kind
    # the comparison covers keys an episode needed and never looked up
    from keytrace.format.reader import open_trace
    from keytrace.format.schema import SCAN_UNQUERIED

    scans = open_trace(off).frame("lookup").select("scan").collect().get_column("scan")
    assert (scans == SCAN_UNQUERIED).sum() > 0
