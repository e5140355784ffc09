"""Decode context parallelism in a geometry, without vLLM: the token spans vLLM gives each
group (an attention block spans block x DCP tokens, a recurrent state one block), how it
travels through plans and trace headers (absent where it is 1: every plan and header
written before reads and writes as before), and what vLLM refuses."""

from __future__ import annotations

import json

import pytest

from keytrace.analysis.geometry import (
    DSV3,
    HYBRID,
    RECURRENT,
    Geometry,
    dcp_refusal,
    describe,
    geometry_from_header,
    synthetic_header,
)


def test_attention_blocks_span_dcp_times_their_tokens_and_recurrent_states_one_block() -> None:
    geo = RECURRENT.with_(dcp=8, blocks_per_chunk=2)
    # vLLM's resolve_dcp_kv_block_size: an AttentionSpec is dcp-sharded, a MambaSpec not
    assert [geo.tokens_per_block(i) for i in range(4)] == [64, 64, 64, 512]
    assert [geo.tokens_per_chunk(i) for i in range(4)] == [128, 128, 128, 1024]
    assert geo.tokens_per_hash == 64  # the GCD of the spans (resolve_kv_cache_block_sizes)
    assert geo.alignment_unit == 1024  # the full-attention chunk: what workloads count in
    assert RECURRENT.alignment_unit == 64 == RECURRENT.tokens_per_chunk(0)
    # attention only: one hash unit of a whole (DCP-wide) block
    assert DSV3.with_(dcp=4).tokens_per_hash == 256
    assert "dcp 8" in describe(geo) and "dcp" not in describe(RECURRENT)
    with pytest.raises(ValueError, match="at least 1"):
        RECURRENT.with_(dcp=0)


def test_a_plan_and_a_header_carry_it_and_read_as_before_without() -> None:
    assert "dcp" not in RECURRENT.to_dict()  # plans written before stay byte-identical
    assert "dcp_world_size" not in synthetic_header(RECURRENT)
    geo = RECURRENT.with_(dcp=2)
    assert Geometry.from_dict(json.loads(json.dumps(geo.to_dict()))) == geo
    header = synthetic_header(geo)
    assert header["dcp_world_size"] == 2 and header["tokens_per_hash"] == 64
    assert [g["tokens_per_chunk"] for g in header["groups"]] == [64, 64, 64, 128]
    assert [g["block_size"] for g in header["groups"]] == [64] * 4  # one rank's, as vLLM's spec
    back = geometry_from_header(header)
    assert back.dcp == 2 and back.prefix_match_unit is None
    assert [(g.kind, g.block_size) for g in back.groups] == [
        (g.kind, g.block_size) for g in geo.groups
    ]
    # a hash unit finer than the blocks' spans is a --prefix-match-unit, under DCP too
    assert geometry_from_header({**header, "tokens_per_hash": 16}).prefix_match_unit == 16
    assert geometry_from_header(synthetic_header(RECURRENT)).dcp == 1


def test_vllm_refuses_it_with_sliding_window_groups() -> None:
    assert dcp_refusal(RECURRENT.with_(dcp=2)) is None
    assert dcp_refusal(DSV3.with_(dcp=4)) is None
    assert dcp_refusal(HYBRID) is None  # DCP 1
    why = dcp_refusal(HYBRID.with_(dcp=2))
    assert why is not None and "sliding-window" in why and "swa" in why
