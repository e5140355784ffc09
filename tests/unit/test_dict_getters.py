"""A scan's end tokens read through the dict vLLM's method wraps (`DICT_GETTERS`): only for
a method whose code is that one line, with the same answers."""

from __future__ import annotations

from typing import Any

import pytest

from keytrace.record.events import DICT_GETTERS, Scan, direct_getter
from keytrace.vllm.hook.hooks import _positions_reference, register_dict_getter


class Ctx:
    def __init__(self) -> None:
        self._offload_key_positions = {b"a": 16, b"b": 32}

    def get_offload_key_position(self, key: Any) -> Any:
        return self._offload_key_positions.get(key)

    def with_default(self, key: Any) -> Any:
        return self._offload_key_positions.get(key, 0)

    def other_table(self, key: Any) -> Any:
        return self._other.get(key)

    def packed(self, key: Any, *rest: Any) -> Any:
        return self._offload_key_positions.get(key)


@pytest.fixture(autouse=True)
def _clean_registry() -> Any:
    saved = dict(DICT_GETTERS)
    yield
    DICT_GETTERS.clear()
    DICT_GETTERS.update(saved)


def test_the_one_line_getter_reads_its_dict_directly() -> None:
    ctx = Ctx()
    assert direct_getter(ctx.get_offload_key_position) == ctx.get_offload_key_position
    assert register_dict_getter(
        Ctx.get_offload_key_position, "_offload_key_positions", _positions_reference
    )
    get = direct_getter(ctx.get_offload_key_position)
    assert get == ctx._offload_key_positions.get  # the dict's own method, in C
    assert [get(k) for k in (b"a", b"b", b"c")] == [16, 32, None]
    sc = Scan(0, 0, "r", b"\0\0\0\0", False, 0, ctx.get_offload_key_position)
    for seq, key in enumerate((b"a", b"c", b"b")):
        sc.seqs.append(seq)
        sc.keys.append(key)
        sc.results.append("MISS")  # type: ignore[arg-type]
    sc.close()
    assert sc.ends == [16, None, 32]


@pytest.mark.parametrize("name", ["with_default", "other_table", "packed"])
def test_any_other_code_keeps_its_own_method(name: str) -> None:
    fn = getattr(Ctx, name)
    assert not register_dict_getter(fn, "_offload_key_positions", _positions_reference)
    ctx = Ctx()
    bound = getattr(ctx, name)
    assert direct_getter(bound) == bound


def test_installed_vllms_req_context_is_the_one_line_getter() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import ReqContext

    from keytrace.vllm.hook.hooks import register_key_positions

    assert register_key_positions()
    ctx = ReqContext(req_id="r")
    ctx.set_offload_key_position(b"k", 5)
    get = direct_getter(ctx.get_offload_key_position)
    assert (
        get is not ctx.get_offload_key_position
        and type(get).__name__ == "builtin_function_or_method"
    )
    assert [get(k) for k in (b"k", b"x")] == [ctx.get_offload_key_position(k) for k in (b"k", b"x")]
