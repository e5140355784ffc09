"""The arithmetic of the candidate fix ``lookahead_replay_boundary`` (vLLM 0.34.0's resend
hole, docs/findings.md): which boundaries it hands vLLM's store mask, on a stand-in for the
scheduler. Its effect on the real scheduler is measured in tests/integration/test_lookahead.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from keytrace.vllm.hook.support import FEATURE_SOURCES, REPLACED_SOURCES
from keytrace.vllm.mods.catalog import FIXES, STORE_MASK_FIXES
from keytrace.vllm.mods.fixes import lookahead_replay_boundary

WINDOW = SimpleNamespace(sliding_window_size_in_chunks=2, requires_cow_source=False)
FULL = SimpleNamespace(sliding_window_size_in_chunks=None, requires_cow_source=False)
STATE = SimpleNamespace(sliding_window_size_in_chunks=1, requires_cow_source=True)


def _sched(lookahead: int | None) -> Any:
    """A scheduler as vLLM 0.34.0 builds it (None: one without the lookahead switch, 0.33.0)."""
    if lookahead is None:
        return SimpleNamespace()
    tracker = SimpleNamespace(num_hash_lookahead_tokens=lookahead)
    return SimpleNamespace(use_lookahead_block_hashes=lookahead > 0, _events_tracker=tracker)


def _boundaries(sched: Any, group: Any, reachable: tuple[int, ...], positional: bool) -> Any:
    seen: dict[str, Any] = {}

    def mask(**kw: Any) -> str:
        seen.update(kw)
        return "vLLM's mask"

    args = (group, 3, 9, None, reachable)
    if positional:
        out = lookahead_replay_boundary(mask, sched, args, {})
    else:
        names = ("group_config", "start_chunk_idx", "end_chunk_idx")
        kwargs = dict(zip(names, args[:3], strict=True))
        kwargs |= {"final_segment_end_chunk_idx": None, "reachable_boundaries": reachable}
        out = lookahead_replay_boundary(mask, sched, (), kwargs)
    assert out == "vLLM's mask"  # vLLM's own mask, computed with the boundaries below
    assert (seen["start_chunk_idx"], seen["end_chunk_idx"]) == (3, 9)
    return seen["reachable_boundaries"]


@pytest.mark.parametrize("positional", [True, False])
@pytest.mark.parametrize(
    ("lookahead", "prompt", "junction", "expected"),
    [
        # L = 2, P = 1,025: the replay boundary 1,024 stays, and 1,023 (= P - L) joins it
        (2, 1025, 0, (1024, 1023)),
        (3, 1026, 0, (1025, 1023)),
        # a pinned junction stays where it is (a longer prompt keys it); P - L comes last
        (3, 1026, 512, (1025, 512, 1023)),
    ],
)
def test_a_window_also_keeps_its_tail_where_the_resend_s_hashes_reach(
    lookahead: int, prompt: int, junction: int, expected: tuple[int, ...], positional: bool
) -> None:
    reachable = (prompt - 1, junction) if junction else (prompt - 1,)
    got = _boundaries(_sched(lookahead), WINDOW, reachable, positional)
    assert tuple(got) == expected


@pytest.mark.parametrize(
    ("lookahead", "group", "reachable"),
    [
        (1, WINDOW, (1024,)),  # EAGLE / one MTP token: P - L is the replay boundary itself
        (0, WINDOW, (1024,)),  # no drafter
        (None, WINDOW, (1024,)),  # 0.33.0: no lookahead switch at all
        (2, FULL, (1024,)),  # full attention keeps every chunk
        (2, STATE, (1024,)),  # recurrent state exists only where a request computed one
        (2, WINDOW, ()),  # dense retention: vLLM passes no boundary and keeps every tail
    ],
)
def test_nothing_changes_where_the_replay_boundary_is_reachable(
    lookahead: int | None, group: Any, reachable: tuple[int, ...]
) -> None:
    assert tuple(_boundaries(_sched(lookahead), group, reachable, True)) == reachable


def test_the_fix_is_a_store_mask_row_pinned_to_the_masks_it_wraps() -> None:
    assert "lookahead_replay_boundary" in FIXES
    assert "lookahead_replay_boundary" in STORE_MASK_FIXES
    where = "OffloadingConnectorScheduler._reachable_store_block_mask"
    own = FEATURE_SOURCES["fix:lookahead_replay_boundary"][where]
    # the releases the other mask rows hold on, and 0.34.0's mask, which only this row wraps
    assert set(REPLACED_SOURCES[where]) < set(own)
    assert "0.34.0" in own.values() and "0.34.0" not in REPLACED_SOURCES[where].values()
