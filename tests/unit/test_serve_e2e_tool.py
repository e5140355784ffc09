"""tools/serve_e2e.py's own checks, without a server: a chunk that is no multiple of the
model's block is refused before vLLM starts, the oracle refuses traffic it cannot map to
token ids, and a server that dies is one line naming its cause and its log."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import serve_e2e  # noqa: E402


@pytest.mark.parametrize(
    ("model", "block"), [("gemma2", 100), ("qwen3next", 100), ("qwen3next", 0)]
)
def test_a_chunk_off_the_block_is_refused_before_any_server(
    model: str, block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_venv(_venv: Path) -> Path:
        raise AssertionError("the venv was asked for: refused too late")

    monkeypatch.setattr(serve_e2e, "ensure_venv", no_venv)
    with pytest.raises(ValueError, match=r"multiple of its \d+-token block"):
        serve_e2e.run(tmp_path / "venv", tmp_path, model=model, offload_block=block)


def test_the_cli_refuses_them_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    for argv in (
        ["--model", "qwen3next", "--offload-block-size", "100"],
        ["--oracle"],
        ["--model", "qwen3next", "--oracle", "--tier-cpu-mib", "4"],
    ):
        monkeypatch.setattr(sys, "argv", ["serve_e2e.py", *argv])
        with pytest.raises(SystemExit) as exc:
            serve_e2e.main()
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("serve_e2e.py: error: "), err


def test_the_oracle_needs_prompts_told_apart_by_length(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two share one"):
        serve_e2e.oracle(tmp_path / "python", tmp_path / "trace", [[1, 2], [3, 4]])


def test_a_dead_server_is_one_line_with_its_cause_and_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "INFO starting\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "    raise ValueError('y')\n"
        "ValueError: 'block_size'=100 in kv_connector_extra_config must be a multiple of "
        "the GPU KV cache block size (128 tokens)\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    server = object.__new__(serve_e2e.Server)
    server.log_path = log
    server.log = open(log)  # noqa: SIM115 (the server keeps its log open)
    try:
        cause = server.cause()
    finally:
        server.log.close()
    assert cause.startswith("ValueError: 'block_size'=100") and "128 tokens" in cause
