"""`compare_fix`: what a candidate fix closes and what it breaks, from two sweeps."""

from __future__ import annotations

import pytest

from keytrace.analysis.sweep import SweepRow, compare_fix


def _row(n: int, verdict: str, external: int, E: int = 100) -> SweepRow:
    return SweepRow(n, 512, 1, E, external, verdict, None, None, None, 0.0)


def test_closed_reaching_E_and_new_mismatches() -> None:
    stock = [
        _row(1, "mismatch", 0),
        _row(2, "mismatch", 0),
        _row(3, "hit", 100),
        _row(4, "hit", 100),
    ]
    fixed = [
        _row(1, "hit", 100),  # closed at E
        _row(2, "hit", 64, E=64),  # closed, but the fix moved E: short of stock's E
        _row(3, "mismatch", 0),  # new
        _row(4, "hit", 100),
    ]
    c = compare_fix(stock, fixed, "f")
    assert (c.failing, c.closed, c.reach_E, c.new) == ([1, 2], [1, 2], [1], [3])
    assert not c.closes_all
    assert c.text() == (
        "with fix f: 2 of 2 failing lengths hit (1 reach E), 1 new mismatch(es), e.g. [3] "
        "among 4 lengths"
    )


def test_closes_all_needs_failing_lengths_and_no_new_one() -> None:
    stock = [_row(1, "mismatch", 0), _row(2, "hit", 100)]
    assert compare_fix(stock, [_row(1, "hit", 100), _row(2, "hit", 100)], "f").closes_all
    assert not compare_fix(stock[1:], [_row(2, "hit", 100)], "f").closes_all
    still = compare_fix(stock, [_row(1, "mismatch", 0), _row(2, "hit", 100)], "f")
    assert (still.closed, still.closes_all) == ([], False)


def test_sweeps_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        compare_fix([_row(1, "hit", 100)], [_row(2, "hit", 100)], "f")
