"""Every command explains itself; the CLI never needs vLLM to print help."""

from __future__ import annotations

import re

import click
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


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_option_says_what_it_does(name: str) -> None:
    bare = [
        "/".join(p.opts)
        for p in cli.commands[name].params
        if isinstance(p, click.Option) and not p.help and not p.hidden
    ]
    assert bare == [], f"keytrace {name}: options without a description: {bare}"


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_help_names_no_single_vllm_release_as_the_lab(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lab runs on every vLLM release keytrace supports: help says "the installed
    vLLM's", not one release's scheduler."""
    assert main([name, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"vLLM \d+\.\d+\.\d+ scheduler", out), out
