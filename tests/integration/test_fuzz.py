"""`keytrace fuzz` on the real scheduler: it finds both vLLM 0.33.0 store/lookup
disagreements from a seed and shrinks each to a two-group case.

- windows that are whole blocks: the EAGLE/MTP peek miss (docs/findings.md): the minimal
  case has one MTP group and satisfies P - E < tpc(MTP);
- any window: a sliding window of k*block + 1 tokens, where the store keeps
  cdiv(w - 1, block) blocks (the prefix cache's need) but lookup wants
  cdiv(w, tokens_per_chunk) chunks, one more.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import require_vllm

require_vllm()

from keytrace.cli import main  # noqa: E402
from keytrace.vllm.lab.fuzz import fuzz  # noqa: E402


def test_finds_and_shrinks_the_mtp_peek_miss(tmp_path: Path) -> None:
    res = fuzz(str(tmp_path / "f"), seed=1, max_examples=60, aligned_windows=True)
    assert res.failure is not None and res.cases > 0
    geo = res.failure.geometry
    assert len(geo.groups) <= 3
    mtp = [i for i, g in enumerate(geo.groups) if g.eagle]
    assert mtp == [res.verdict["binding_group"]] and res.verdict["cause"] == "never_offered"
    assert all(g.sliding_window % g.block_size == 0 for g in geo.groups if g.sliding_window)
    tpc = geo.groups[mtp[0]].block_size * geo.blocks_per_chunk
    assert res.verdict["external_tokens"] == 0
    assert res.failure.prime - res.verdict["E"] < tpc  # the rule of docs/findings.md
    # the minimal case's trace says the same through the CLI
    assert main(["diff", str(tmp_path / "f" / "minimal-trace")]) == 1
    assert (tmp_path / "f" / "fuzz.json").exists()


def test_finds_the_window_plus_one_class(tmp_path: Path) -> None:
    res = fuzz(str(tmp_path / "f"), seed=3, max_examples=60)
    assert res.failure is not None
    geo = res.failure.geometry
    bound = geo.groups[res.verdict["binding_group"]]
    assert len(geo.groups) == 2 and not bound.eagle
    assert bound.sliding_window is not None
    assert (bound.sliding_window - 1) % (bound.block_size * geo.blocks_per_chunk) == 0
    assert res.verdict["cause"] == "never_offered"


def test_cli_reports_the_minimal_case_and_exit_1(tmp_path: Path, capsys) -> None:
    out = tmp_path / "f"
    code = main(
        ["fuzz", "-o", str(out), "--seed", "1", "--max-examples", "60", "--aligned-windows"]
    )
    text = capsys.readouterr().out
    assert code == 1
    assert text.startswith("MISMATCH, shrunk to: 2 groups [") and " MTP]" in text
    assert f"next: keytrace diff {out / 'minimal-trace'}" in text


def test_with_the_candidate_fix_the_same_search_finds_nothing(tmp_path: Path) -> None:
    """The search that finds the MTP peek miss above, with eagle_proof_key applied."""
    res = fuzz(
        str(tmp_path / "f"),
        seed=1,
        max_examples=120,
        aligned_windows=True,
        fix="eagle_proof_key",
    )
    assert res.failure is None and res.cases >= 100, res


def test_with_both_candidate_fixes_the_any_window_search_finds_nothing(tmp_path: Path) -> None:
    """The search that finds the window-plus-one class above (any window), with
    eagle_proof_key and window_minus_one applied together."""
    res = fuzz(str(tmp_path / "f"), seed=3, max_examples=80, fix="eagle_proof_key,window_minus_one")
    assert res.failure is None and res.cases >= 60, res


def test_a_spent_budget_stops_the_search_at_once(tmp_path: Path) -> None:
    """A rejection after the budget made Hypothesis draw and reject until its own limit
    (minutes); the budget now ends the search at the next case."""
    res = fuzz(str(tmp_path / "f"), seed=1, max_examples=100_000, budget_seconds=0.0)
    assert res.stopped_by_budget and res.cases == 0 and res.failure is None
    assert json.loads((tmp_path / "f" / "fuzz.json").read_text())["stopped_by_budget"] is True


def test_recurrent_hybrids_find_a_state_that_ends_no_chunk(tmp_path: Path) -> None:
    """`--recurrent` draws recurrent hybrids and finds a documented write-only class: a
    prompt's last recurrent state kept where it ends no chunk the lookup reaches (under
    decode context parallelism a full-attention chunk spans two recurrent blocks, or
    chunks of two blocks: docs/findings.md), named `no_checkpoint` on a recurrent group,
    0 external tokens, shrunk to one recurrent group and the full-attention one."""
    res = fuzz(str(tmp_path / "f"), seed=1, max_examples=15, recurrent=True)
    assert res.failure is not None and res.cases > 0
    geo = res.failure.geometry
    bound = geo.groups[res.verdict["binding_group"]]
    assert bound.recurrent and res.verdict["cause"] == "no_checkpoint"
    assert [g.recurrent for g in geo.groups] == [True, False]  # shrunk to two groups
    assert res.verdict["external_tokens"] == 0 and res.verdict["E"] > 0
    # the state at the prompt's last block boundary ends no full-attention chunk
    M = (res.failure.prime - 1) // bound.block_size * bound.block_size
    assert M % (geo.groups[1].block_size * geo.dcp * geo.blocks_per_chunk) != 0
    assert main(["diff", str(tmp_path / "f" / "minimal-trace")]) == 1
