"""`keytrace minimize` on the real scheduler: the demo's 17,975-token dsv4 miss (5 groups)
shrinks to two groups and a prompt of a few tokens with the same binding-group kind (MTP
sliding window) and cause (never offered); a hit has nothing to shrink (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import builtin  # noqa: E402
from keytrace.cli import main  # noqa: E402
from keytrace.vllm.lab.replay import replay  # noqa: E402


def test_the_17975_miss_shrinks_to_two_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "t"
    replay(builtin("dsv4"), [17_975], 17_975, trace_dir=d)
    out = tmp_path / "min"
    assert main(["minimize", str(d), "-o", str(out)]) == 1
    text = capsys.readouterr().out
    doc = json.loads((out / "minimal.json").read_text())
    groups = doc["geometry"]["groups"]
    assert len(groups) == 2 and groups[1]["eagle"] and groups[0]["sliding_window"] is None
    assert doc["signature"] == {"kind": "sliding_window", "eagle": True, "cause": "never_offered"}
    assert doc["verdict"]["binding_group"] == 1 and doc["verdict"]["external_tokens"] == 0
    assert doc["episode"] < 64 and doc["primes"] == [doc["episode"]]
    # still the stock rule: P - E < tpc(MTP)
    tpc = groups[1]["block_size"] * doc["geometry"]["blocks_per_chunk"]
    assert doc["episode"] - doc["verdict"]["E"] < tpc
    assert text.startswith("from:    5 groups") and "minimal: 2 groups" in text
    assert main(["diff", str(out / "minimal-trace")]) == 1


def test_a_hit_has_nothing_to_minimize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "t"
    replay(builtin("dsv4"), [18_000], 18_000, trace_dir=d)
    assert main(["minimize", str(d), "-o", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a mismatch" in err[0]
