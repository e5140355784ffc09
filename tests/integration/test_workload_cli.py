"""`keytrace workload`: every option reaches the real scheduler run; the oracle reports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.cli import main  # noqa: E402
from keytrace.format.reader import open_trace  # noqa: E402


def test_workload_with_every_option_and_the_oracle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "wl"
    args = ["workload", "-o", str(out), "--geometry", "small", "--seed", "0"]
    args += ["--conversations", "6", "--turns", "2:3", "--system-prompts", "1"]
    args += ["--system-chunks", "2:4", "--message-chunks", "0.5:3", "--output-tokens", "1:8"]
    args += ["--arrival-steps", "5", "--think-steps", "2:6", "--resend-rate", "0.3"]
    args += ["--engines", "2", "--reroute-rate", "0.3", "--cpu-chunks", "400"]
    args += ["--gpu-prompts", "3", "--store-delay", "2", "--gpu-flush-steps", "15"]
    args += ["--no-async", "--budget", "256", "--oracle", "--no-progress"]
    code = main(args)
    text = capsys.readouterr().out
    assert code in (0, 1)
    assert ("MISMATCH" in text) == (code == 1)
    m = re.search(r"recorded (\d+) requests .* on 2 engines in ", text)
    assert m is not None and int(m.group(1)) >= 12
    assert re.search(r"oracle: \d+ shortfall episodes? .* 0 disagreements", text)
    assert "where the tokens to prefill came from" in text
    trace = open_trace(str(out))
    assert trace.header["max_num_batched_tokens"] == 256
    assert trace.header["cpu_num_chunks"] == 400
    assert trace.header["async_scheduling"] is False
    assert len({p.source["instance"] for p in trace.parts}) == 2


def test_bad_range_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["workload", "--think-steps", "9:2"]) == 2
    err = capsys.readouterr().err
    assert "LOW must not exceed HIGH" in err and err.count("\n") == 1


def test_workload_with_the_live_alarm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="keytrace")
    args = ["workload", "-o", str(tmp_path / "wl"), "--geometry", "small", "--seed", "0"]
    args += ["--conversations", "6", "--inject", "short_window_tail", "--alarm", "--no-progress"]
    assert main(args) == 1
    text = capsys.readouterr().out
    m = re.search(r"live alarm: (.*) \(the same as the differ's\); (\d+) warnings?,", text)
    assert m is not None, text
    assert "mismatch" in m.group(1) and int(m.group(2)) >= 1
    warned = [r.getMessage() for r in caplog.records if "write-only offload" in r.getMessage()]
    assert len(warned) == int(m.group(2))
