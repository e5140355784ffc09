"""The vllm.general_plugins entry point, exercised the way vLLM loads it, in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl

from tests.conftest import require_vllm

require_vllm()

from keytrace.format.reader import open_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()          # vLLM may load plugins more than once: must be idempotent
from keytrace.vllm.hook.compat import load_targets
cls, _, _ = load_targets()
print("patched", hasattr(cls.__init__, "__wrapped__"), flush=True)
print("double", hasattr(getattr(cls.__init__, "__wrapped__", None), "__wrapped__"), flush=True)
from keytrace.analysis.geometry import SMALL
from keytrace.vllm.lab.harness import Harness
print("external", Harness(SMALL, dp_rank=int(sys.argv[1])).scenario(1000).external_tokens, flush=True)
"""


def _child(rank: int, **env: str) -> subprocess.CompletedProcess[str]:
    """`CODE` in a fresh interpreter as DP rank ``rank``, with ``env`` as keytrace's
    settings (none inherited)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    r = subprocess.run(
        [sys.executable, "-c", CODE, str(rank)],
        capture_output=True,
        text=True,
        env={**full, **env},
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _run(rank: int, trace_dir: Path | None) -> str:
    return _child(rank, **({"KEYTRACE_DIR": str(trace_dir)} if trace_dir else {})).stdout


def test_plugin_records_per_process_and_rank(tmp_path: Path) -> None:
    d = tmp_path / "kt"
    out0 = _run(0, d)
    out1 = _run(1, d)
    assert "patched True" in out0 and "double False" in out0 and "patched True" in out1
    trace = open_trace(str(d))
    # two processes, two recorder instances, separate files
    by_part = {p.path: p.source for p in trace.parts}
    assert len({s["pid"] for s in by_part.values()}) == 2
    assert {s["dp_rank"] for s in by_part.values()} == {0, 1}
    for p in trace.parts:
        ranks = pl.read_parquet(p.path, columns=["dp_rank"])["dp_rank"].unique().to_list()
        assert ranks == [p.source["dp_rank"]]
    assert trace.rows("lookup") > 0 and trace.rows("store") > 0


def test_plugin_inert_without_variable(tmp_path: Path) -> None:
    out = _run(0, None)
    assert "patched False" in out
    assert "external 960" in out


def test_one_startup_warning_says_where_and_the_cap(tmp_path: Path) -> None:
    """vLLM shows WARNING, not keytrace's INFO: the operator sees one line, once, however
    often vLLM loads its plugins."""
    d = tmp_path / "kt"
    r = _child(0, KEYTRACE_DIR=str(d), KEYTRACE_MAX_BYTES="512M")
    lines = [x for x in r.stderr.splitlines() if "keytrace: recording offload keys" in x]
    assert lines == [f"keytrace: recording offload keys to {d} (cap 0.5 GiB, alarm on, no metrics)"]
