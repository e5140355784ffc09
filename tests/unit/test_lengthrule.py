"""The failing-length rule of a sweep (`keytrace.analysis.lengthrule`)."""

from __future__ import annotations

from keytrace.analysis.lengthrule import length_rule
from keytrace.analysis.sweep import SweepRow


def _rows(verdicts: dict[int, str]) -> list[SweepRow]:
    return [
        SweepRow(
            length=n,
            budget=8192,
            blocks_per_chunk=1,
            E=None,
            external=0,
            verdict=v,
            binding_group=None,
            terminal_chunk=None,
            cause=None,
            seconds=0.0,
        )
        for n, v in verdicts.items()
    ]


def test_sampled_residues_merge_into_one_range() -> None:
    # A = 256, sampled every 8 tokens: residues 1..63 mismatch, the rest hit
    rows = _rows({n: "mismatch" if 1 <= n % 256 <= 63 else "hit" for n in range(17_700, 18_212, 8)})
    rule = length_rule(rows, 256)
    # 17,700 = 69*256 + 36: the sampled residues are 4, 12, ..., 252 (all = 4 mod 8)
    assert rule.residues == [(4, 60)]
    assert rule.holds and rule.violations == []
    # a range's ends are as sampled: the true one (1..63) reaches into the unswept residues
    assert rule.unswept == [(0, 3), (61, 67)]
    assert rule.text() == (
        "mismatch iff P mod 256 in {4..60} as sampled (residues 0..3 and 61..67 were not "
        "swept: a range may reach into them): holds for all 64 swept lengths"
    )
    # every residue swept: the range is exact, said plainly
    every = _rows({n: "mismatch" if 1 <= n % 256 <= 63 else "hit" for n in range(17_920, 18_176)})
    assert length_rule(every, 256).text() == (
        "mismatch iff P mod 256 in {1..63}: holds for all 256 swept lengths"
    )


def test_a_residue_that_both_fails_and_passes_is_a_violation() -> None:
    rule = length_rule(_rows({300: "mismatch", 556: "hit", 310: "hit"}), 256)
    assert rule.violations == [556] and not rule.holds
    assert "violated by 1 length(s)" in rule.text()


def test_no_mismatch() -> None:
    rule = length_rule(_rows({300: "hit", 301: "hit"}), 256)
    assert not rule.holds and rule.text() == "no swept length mismatched (2 lengths)"


def test_ranges_and_singletons_and_the_first_three_violations() -> None:
    verdicts = {259: "mismatch", 261: "hit", 263: "mismatch", 264: "mismatch", 265: "mismatch"}
    rule = length_rule(_rows(verdicts), 256)
    assert rule.text() == (
        "mismatch iff P mod 256 in {3, 7..9} as sampled (residues 0..2 and 4 and 6 and 10..255 "
        "were not swept: a range may reach into them): holds for all 5 swept lengths"
    )
    # residue 3 mismatched once and passed four times: all four are violations, three shown
    mixed = {259: "mismatch", 515: "hit", 771: "hit", 1027: "hit", 1283: "hit"}
    assert (
        length_rule(_rows(mixed), 256)
        .text()
        .endswith("violated by 4 length(s), e.g. [515, 771, 1027]")
    )
