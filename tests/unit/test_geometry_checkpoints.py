"""Prefill checkpoints in a geometry, without vLLM: the ``nemotron_h`` preset's Mamba2
groups carry them, plans and trace headers carry them back (absent where a group has none:
every plan and header written before reads and writes as before), and only a recurrent
group may have them."""

from __future__ import annotations

import json

import pytest

from keytrace.analysis.geometry import (
    NEMOTRON_H,
    RECURRENT,
    Geometry,
    GroupGeom,
    checkpoint_alignment,
    geometry_from_header,
    synthetic_header,
)


def test_the_preset_is_mamba2_with_checkpoints_and_full_attention() -> None:
    kinds = [(g.kind, g.block_size, g.prefill_checkpoint_alignment) for g in NEMOTRON_H.groups]
    assert kinds == [("mamba", 64, 1)] * 4 + [("full_attention", 64, None)]
    assert NEMOTRON_H.tokens_per_hash == 64 and NEMOTRON_H.alignment_unit == 64


def test_a_plan_and_a_header_carry_them_and_read_as_before_without() -> None:
    plain = json.dumps(RECURRENT.to_dict())
    assert "prefill_checkpoint" not in plain  # plans written before stay byte-identical
    assert Geometry.from_dict(json.loads(plain)) == RECURRENT
    again = Geometry.from_dict(json.loads(json.dumps(NEMOTRON_H.to_dict())))
    assert again == NEMOTRON_H
    header = synthetic_header(NEMOTRON_H)
    specs = header["recurrent"]["groups"]
    assert set(specs) == {"0", "1", "2", "3"}
    assert all(s["num_prefill_checkpoint_blocks"] == 1 for s in specs.values())
    assert "recurrent" not in synthetic_header(RECURRENT)  # as before
    rebuilt = geometry_from_header(header)
    assert [g.prefill_checkpoint_alignment for g in rebuilt.groups] == [1, 1, 1, 1, None]
    assert [
        g.prefill_checkpoint_alignment
        for g in geometry_from_header(synthetic_header(RECURRENT)).groups
    ] == [None] * 4


def test_a_spec_with_blocks_but_no_alignment_reads_as_none() -> None:
    # vLLM never takes an internal checkpoint without an alignment
    assert checkpoint_alignment({"num_prefill_checkpoint_blocks": 1}) is None
    assert (
        checkpoint_alignment(
            {"num_prefill_checkpoint_blocks": 0, "prefill_checkpoint_alignment": 1}
        )
        is None
    )
    assert (
        checkpoint_alignment(
            {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 16}
        )
        == 16
    )


def test_only_a_recurrent_group_has_prefill_checkpoints() -> None:
    with pytest.raises(ValueError, match="recurrent groups only"):
        GroupGeom("full_attention", 64, prefill_checkpoint_alignment=1)
    with pytest.raises(ValueError, match="positive"):
        GroupGeom("mamba", 64, prefill_checkpoint_alignment=0)
