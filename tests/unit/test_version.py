"""One version string: keytrace/_version.py. pyproject.toml reads it at build time, so the
installed distribution, the CLI and every part a writer closes say the same thing."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import keytrace
from keytrace.cli import main
from keytrace.format.schema import META_KEYTRACE_VERSION
from tests.factories import new_builder

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_takes_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "a second version string in pyproject.toml"
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "keytrace._version.__version__"}


def test_the_installed_distribution_says_the_package_version() -> None:
    # Editable in a dev checkout, a built wheel in tools/check_core_install.py's core venv
    # (whose tests import the checkout's keytrace/ from the working directory): either way
    # the metadata was written from _version.py when the checkout was installed.
    try:
        installed = importlib.metadata.version("keytrace")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("keytrace is not installed (a bare checkout on PYTHONPATH): no metadata")
    assert installed == keytrace.__version__, (
        f"installed metadata says {installed}, keytrace/_version.py {keytrace.__version__}: "
        "an install older than the checkout (pip install -e . again)"
    )


def test_the_cli_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"keytrace, version {keytrace.__version__}\n"


def test_every_part_carries_it(tmp_path: Path) -> None:
    b = new_builder(tmp_path)
    b.rec.reset()
    b.close()
    parts = sorted(tmp_path.rglob("*.parquet"))
    assert parts
    for part in parts:
        meta = pq.read_metadata(part).metadata
        assert meta[META_KEYTRACE_VERSION] == keytrace.__version__.encode(), part
