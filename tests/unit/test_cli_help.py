"""Every command explains itself; the CLI never needs vLLM to print help."""

from __future__ import annotations

import pytest

from keytrace.cli import cli, main


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: ") and len(out.splitlines()) > 5


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in (
        "demo",
        "diff",
        "replay",
        "fixture",
        "sweep",
        "fuzz",
        "workload",
        "summary",
        "header",
        "compact",
    ):
        assert f"  {name}" in out
    assert main(["--version"]) == 0


def test_unknown_option_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", "--bogus", "x"]) == 2
    assert "No such option" in capsys.readouterr().err
