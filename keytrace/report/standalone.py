"""A standalone vLLM regression for one recorded mismatch: a pytest file that imports only
vLLM (and torch), in the style of vLLM's own
``tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py``, from the visible
template ``templates/vllm_regression.py.j2`` with the geometry and lengths as literals.

It drives vLLM's store decision (``_reachable_store_block_mask``, the whole prompt at once)
into a real ``CPUOffloadingManager`` and vLLM's lookup (``get_num_new_matched_tokens``),
and asserts the expected boundary E. A *stalled* request on a tiered manager (a lookup
deferred without end) gets instead the manager-level test of
``templates/vllm_tiered_regression.py.j2``, for ``tests/v1/kv_offload/tiering/``: vLLM's
``TieringOffloadingManager`` with the recorded CPU tier size over the ``example`` tier, one
key more than it holds, the connector's lookup walk each step, which must be answered.
Deterministic: equal plans give byte-equal files.
"""

from __future__ import annotations

import hashlib
from typing import Any

from keytrace.analysis.geometry import Geometry
from keytrace.analysis.plan import ReplayPlan
from keytrace.judge.definitions import STALL_EPISODES
from keytrace.judge.rules import is_recurrent
from keytrace.report.templates import render


def unsupported(plan: ReplayPlan) -> str | None:
    """Why no vLLM-only test can be written for ``plan`` (None: one can). The test drives
    vLLM's store path by hand with attention specs; a recurrent group's states come from
    the core's boundary hand-offs, which it does not drive: a test that treated the group
    as full attention would pass on the bug."""
    recurrent = any(is_recurrent(g) for g in plan.geometry.get("groups", []))
    if recurrent and not is_tiered_stall(plan):  # the stall test uses no group spec
        return (
            "the geometry has recurrent state groups, whose states come from vLLM's core "
            "(boundary hand-offs), which a vLLM-only store-path test does not drive; the "
            "keytrace test replays the whole scheduler"
        )
    return None


def render_vllm_regression(plan: ReplayPlan, *, evidence: str = "") -> str:
    """The test file's text for ``plan`` (its last prime and its episode); `unsupported`
    plans are refused (ValueError)."""
    why = unsupported(plan)
    if why is not None:
        raise ValueError(f"no vLLM-only test: {why}")
    if plan.expected_E is None:
        raise ValueError("the episode has no expected boundary: nothing to assert")
    geo: dict[str, Any] = plan.geometry
    if is_tiered_stall(plan):
        return render(
            "vllm_tiered_regression.py.j2",
            title=f"{int(geo['cpu_chunks']) + 1} chunks on a {geo['cpu_chunks']}-chunk CPU tier.",
            keytrace_version=plan.keytrace_version,
            vllm_version=plan.vllm_version,
            episode=plan.episode_length,
            expected=plan.expected_E,
            cpu_chunks=int(geo["cpu_chunks"]),
            stall_episodes=STALL_EPISODES,
            evidence=evidence.strip(),
            test_name="test_request_needing_one_chunk_more_than_the_cpu_tier_is_answered",
        )
    groups = [
        {
            "block_size": int(g["block_size"]),
            "sliding_window": g.get("sliding_window"),
            "eagle": bool(g.get("eagle")),
        }
        for g in geo["groups"]
    ]
    prime = plan.prime_lengths[-1] if plan.prime_lengths else plan.episode_length
    return render(
        "vllm_regression.py.j2",
        title=(
            f"a {plan.episode_length:,}-token request after a {prime:,}-token prime on the "
            f"{geo.get('name')} geometry must hit E={plan.expected_E:,}."
        ),
        keytrace_version=plan.keytrace_version,
        vllm_version=plan.vllm_version,
        prime=prime,
        episode=plan.episode_length,
        expected=plan.expected_E,
        recorded=plan.recorded_external or 0,
        evidence=evidence.strip(),
        groups=groups,
        blocks_per_chunk=int(geo.get("blocks_per_chunk", 1)),
        tokens_per_hash=Geometry.from_dict(geo).tokens_per_hash,
        retention_interval=geo.get("retention_interval"),
        lookahead=plan.num_hash_lookahead_tokens,
        test_name=f"test_offload_store_lookup_agree_{plan.episode_length}",
    )


def is_tiered_stall(plan: ReplayPlan) -> bool:
    """The plan is of a stalled request on a tiered manager (the livelock's test form)."""
    from keytrace.analysis.geometry import Geometry

    return plan.recorded_verdict == "stalled" and Geometry.from_dict(plan.geometry).is_tiered


def regression_name(plan: ReplayPlan, text: str) -> str:
    """``test_offload_regression_<length>_<hash8>.py`` (content-addressed)."""
    return f"test_offload_regression_{plan.episode_length}_{hashlib.sha256(text.encode()).hexdigest()[:8]}.py"
