"""`--json` output: the compact writer encodes plain episodes from their columns (no object
per episode); it must parse to exactly what the object path gives."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from keytrace.analysis.diff import diff
from keytrace.analysis.results import EpisodeList
from keytrace.format.reader import open_trace
from keytrace.report.jsonout import to_jsonable, write_json
from tests.unit.test_chunkmap import two_shortfalls


def _report(tmp_path: Path):
    return diff(open_trace(str(two_shortfalls(tmp_path / "t"))), all_episodes=True)


def test_compact_columns_parse_to_the_object_path(tmp_path: Path) -> None:
    report = _report(tmp_path)
    assert isinstance(report.episodes, EpisodeList)
    assert {v.verdict for v in report.episodes} == {"cold", "mismatch", "explained"}
    assert 0 < len(report.episodes.detailed) < len(report.episodes)
    fast = io.StringIO()
    write_json(report, fast, compact=True)
    assert "\n" not in fast.getvalue().rstrip("\n")
    assert json.loads(fast.getvalue()) == json.loads(json.dumps(to_jsonable(report)))
    assert fast.getvalue() == json.dumps(to_jsonable(report), separators=(",", ":")) + "\n"
    indented = io.StringIO()
    write_json(report, indented)  # a small report: indented, same content
    assert indented.getvalue().count("\n") > 20
    assert json.loads(indented.getvalue()) == json.loads(fast.getvalue())


def test_episode_list_reads_like_a_list(tmp_path: Path) -> None:
    eps = _report(tmp_path).episodes
    as_list = list(eps)
    assert len(as_list) == len(eps) == 4
    with pytest.raises(IndexError):
        eps[4]
    assert eps != as_list[:3] and eps == as_list
    assert [eps[i] for i in range(len(eps))] == as_list
    assert eps[-1] == as_list[-1] and eps[1:3] == as_list[1:3]
    assert eps == as_list
    plain = next(v for v in eps if v.verdict == "cold")
    assert (plain.binding_group, plain.terminal, plain.needed, plain.chain) == (None, None, [], [])
    assert plain.reason == "no intended boundary is resident: a cold lookup"
    short = next(v for v in eps if v.verdict == "mismatch")
    assert short.terminal is not None and short.needed


def test_a_hits_reason_names_E_with_thousands(tmp_path: Path) -> None:
    from tests.factories import TINY, new_builder

    b = new_builder(tmp_path / "t", geometry=TINY.with_(groups=TINY.groups[:2]))
    b.prime("r1", "c", 2000, swa_chunks={1: [122, 123]})
    fa = [(c, "HIT") for c in range(124)]
    b.episode(
        "r2", 2000, external=1984, chain="c", scans=[(0, fa), (1, [(123, "HIT"), (122, "HIT")])]
    )
    b.close()
    report = diff(open_trace(str(tmp_path / "t")), all_episodes=True)
    hit = next(v for v in report.episodes if v.req_id == "r2")
    assert (hit.verdict, hit.reason) == ("hit", "external tokens reach E=1,984")


@pytest.mark.parametrize("per_write", [1, 3])
def test_the_compact_document_written_in_slices_is_the_same_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_write: int
) -> None:
    """Episodes are encoded and written a slice at a time (bounded memory); slice edges,
    detailed episodes inside a slice and the last short slice change nothing."""
    from keytrace.report import jsonout

    report = _report(tmp_path)
    monkeypatch.setattr(jsonout, "EPISODES_PER_WRITE", per_write)
    out = io.StringIO()
    write_json(report, out, compact=True)
    assert out.getvalue() == json.dumps(to_jsonable(report), separators=(",", ":")) + "\n"
