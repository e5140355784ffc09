"""The served CPU-time measure of tools/bench_serve.py: the engine core's own CPU time is
its threads' time less what the wait meter (tools/bench_wait_meter) counted in vLLM's
message-queue reads, and the paired ratios come with a reproducible interval."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_serve  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_interval_is_reproducible_and_holds_the_mean() -> None:
    ratios = [1.01, 0.99, 1.03, 1.02, 1.00, 1.04, 0.98, 1.02]
    mean, lo, hi = bench_serve.mean_interval(ratios)
    assert bench_serve.mean_interval(ratios) == (mean, lo, hi)
    assert lo < mean < hi and mean == pytest.approx(sum(ratios) / len(ratios))
    assert min(ratios) < lo and hi < max(ratios)  # the mean's interval, not the data's range
    assert bench_serve.mean_interval([1.1] * 5) == pytest.approx((1.1, 1.1, 1.1))


def test_thread_cpu_time_counts_this_threads_work() -> None:
    pid = os.getpid()
    before, main_before = bench_serve.cpu_seconds(pid), bench_serve.thread_cpu_seconds(pid, pid)
    _spin(0.05)
    assert bench_serve.thread_cpu_seconds(pid, pid) - main_before >= 0.045
    assert bench_serve.cpu_seconds(pid) - before >= 0.045


def _meter_module(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Any:
    monkeypatch.setenv("KEYTRACE_BENCH_WAIT_METER", str(folder / "wait"))
    spec = importlib.util.spec_from_file_location(
        "kt_wait_meter", ROOT / "tools" / "bench_wait_meter" / "sitecustomize.py"
    )
    assert spec and spec.loader
    meter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(meter)
    for finder in [f for f in sys.meta_path if type(f).__name__ == "_WrapOnImport"]:
        sys.meta_path.remove(finder)  # this test wraps a stand-in module itself
    return meter


def test_the_wait_meter_counts_the_cpu_time_of_message_queue_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's reader spins in ``MessageQueue.dequeue``: the meter's cell holds the CPU time
    spent there, and the engine core's own work is the rest."""
    meter = _meter_module(monkeypatch, tmp_path)

    class MessageQueue:
        def dequeue(self) -> str:
            _spin(0.05)
            return "answer"

    (tmp_path / "wait").mkdir()  # bench_serve's layout: <server folder>/wait/<pid>
    meter._meter(types.SimpleNamespace(MessageQueue=MessageQueue), str(tmp_path / "wait"))
    server = types.SimpleNamespace(log_path=tmp_path / "server.log")
    pid = os.getpid()
    work0 = bench_serve.work_seconds(server, pid)  # type: ignore[arg-type]
    assert MessageQueue().dequeue() == "answer"
    _spin(0.02)  # the process's own work
    waited = bench_serve.waiting_seconds(server, pid)  # type: ignore[arg-type]
    assert 0.045 <= waited < 0.2
    _all, main = bench_serve.work_seconds(server, pid)  # type: ignore[arg-type]
    assert 0.015 <= main - work0[1] < 0.045  # the spin is not counted as work


class _StandIn:
    """A server for `together_round`: its engine core's CPU seconds grow by ``cost`` per
    prompt it answers, and it records what it was sent and when its cache was reset."""

    def __init__(self, name: str, cost: float, cpu: float) -> None:
        self.name, self.cost, self.cpu, self.prompts, self.resets = name, cost, cpu, [], 0

    def engine_pid(self) -> int:
        return id(self)

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def url(self, path: str) -> str:
        return f"http://{self.name}{path}"


def test_together_round_sends_every_prompt_to_every_server_and_keeps_each_ones_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # engine cores that have run for different times before the round
    servers = {"off": _StandIn("off", 0.001, 5.0), "record": _StandIn("record", 0.0013, 9.0)}
    by_url = {s.url(""): s for s in servers.values()}

    def ttft(base: str, ids: list[int]) -> float:
        s = by_url[base]
        s.prompts.append(ids)
        s.cpu += s.cost
        return 0.01

    monkeypatch.setattr(bench_serve, "ttft", ttft)
    monkeypatch.setattr(
        bench_serve,
        "work_seconds",
        lambda server, pid: (server.cpu, server.cpu / 2),
    )
    batch = [[i, i + 1] for i in range(12)]
    out = bench_serve.together_round(servers, batch, clients=3, pause=0.0)  # type: ignore[arg-type]
    assert set(out) == {"off", "record"}
    for name, s in servers.items():
        assert sorted(s.prompts) == sorted(batch) and s.resets == 1
        _tput, first, cpu_ms, main_ms = out[name]
        assert cpu_ms == pytest.approx(1000 * s.cost) and main_ms == pytest.approx(500 * s.cost)
        assert first == pytest.approx(0.01)
    assert out["record"][2] / out["off"][2] == pytest.approx(1.3)


def test_blocks_resample_whole_servers() -> None:
    """Two fresh starts of the servers that disagree by 6% while each one's rounds agree
    within 1%: the rounds alone give an interval that rules out what either start
    measured, whole blocks one that covers both."""
    ratios = [1.00, 1.01, 0.99, 1.00, 1.06, 1.07, 1.05, 1.06]
    blocks = [0, 0, 0, 0, 1, 1, 1, 1]
    mean, lo, hi = bench_serve.mean_interval(ratios)
    b_mean, b_lo, b_hi = bench_serve.mean_interval(ratios, blocks=blocks)
    assert b_mean == pytest.approx(mean)
    assert b_lo <= 1.0 and b_hi >= 1.06  # both blocks' own means are inside
    assert lo > 1.0 and hi < 1.06  # the rounds alone rule both out
    # one block: the rounds are all there is
    assert bench_serve.mean_interval(ratios, blocks=[0] * 8) == (mean, lo, hi)
