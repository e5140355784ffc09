"""Partial tails on a tiered manager: vLLM's CPU primary asserts on a load
(docs/findings.md). A partial-tail probe's promotion evicts the complete hit the same
lookup confirmed and answers; ``update_state_after_alloc`` then asks ``prepare_load`` for
a chunk the primary no longer holds.

Reproduced on vLLM's real scheduler with the minimal sequence
(tests/integration/tiered_partial_sequence.py: three prompts, a CPU primary of 8 chunks
over the ``example`` tier, or the ``fs`` tier and a preemption) and, importing only vLLM,
on the real tiered manager (tests/integration/tiered_partial_repro.py). vLLM 0.33.0 runs
in this process, 0.34.0 from its own source tree in a fresh interpreter. Strict xfails
ask for what a fixed vLLM does; the candidate fix does it: keytrace's
``promotion_pins_prefix`` on the scheduler (the tiered livelock's fix: a promotion never
evicts what its request's lookups found ready in this step), the same patch in vLLM-only
form (``protect_step_hits``) on the manager.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import require_vllm

require_vllm()

from tests.integration.tiered_partial_repro import protect_step_hits, reproduce  # noqa: E402
from tests.integration.tiered_partial_sequence import run  # noqa: E402
from tests.integration.vllm_builds import DEFAULT_CACHE, run_python  # noqa: E402

pytestmark = pytest.mark.vllm

ENV_034 = {"VLLM_CACHE_ROOT": str(DEFAULT_CACHE / "vllm-cache-0.34")}
TIERS = ("example", "fs")
FIXED = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="vLLM's tiered manager evicts a chunk its lookup answered HIT in the same step "
    "(docs/findings.md): red once vLLM serves the resend",
)

ALL_034 = """
import json
import vllm
from tests.integration.tiered_partial_repro import protect_step_hits, reproduce
from tests.integration.tiered_partial_sequence import run

found = {"version": vllm.__version__, "repro": reproduce()}
with protect_step_hits():
    found["repro_fix"] = reproduce()
for tier in ("example", "fs"):
    found[tier] = run(tier)
    found[tier + "_fix"] = run(tier, fix=True)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def on_034() -> dict[str, Any]:
    """Everything below on vLLM 0.34.0's own code, in one fresh interpreter (one start-up
    of 0.34.0 serves every 0.34.0 test)."""
    r = run_python(ALL_034, release="0.34.0", env=ENV_034)
    assert r.returncode == 0, r.stderr[-4000:]
    found: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.34.0"
    return found


# ------------------------------------------------------------------- expectations


def _assert_manager_asserts(found: dict[str, Any]) -> None:
    """The resend's step on the real tiered manager: four HITs, then four promotions that
    evict exactly those four chunks, then the load of them fails."""
    assert found["evicted_by_b"] == ["A@80/g0", "A@80/g1", "A@80/g2", "A@80/g3"]
    assert found["complete_results"] == ["HIT"] * 4
    assert found["probe_results"] == ["HIT_PENDING"] * 4
    assert found["evicted_by_probe"] == ["A@64/g0", "A@64/g1", "A@64/g2", "A@64/g3"]
    assert found["error"] == "Chunk b'A@64\\x00\\x00\\x00\\x00' not found in cache"
    assert found["missing"] == "A@64/g0"


def _assert_manager_loads(found: dict[str, Any]) -> None:
    """With the fix: the promotions evict other idle chunks (B's), the load succeeds."""
    assert found["probe_results"] == ["HIT_PENDING"] * 4
    assert found["evicted_by_probe"] == ["B@16/g0", "B@16/g1", "B@16/g2", "B@16/g3"]
    assert found["error"] is None


def _assert_scheduler_asserts(found: dict[str, Any]) -> None:
    """The minimal sequence on the real scheduler: the resend's keys at 64 resident and its
    tail at 80 on the tier only; the load of the complete hit (64) raises inside
    ``update_state_after_alloc``, naming group 0's state at 64, whose place (with every
    other key at 64) the tail's promotions took."""
    assert found["a_in_primary"] == 8
    assert found["before"] == {"64": [0, 1, 2, 3], "80": []}
    assert found["error"] is not None and found["error"].endswith("not found in cache")
    assert found["missing_group0_at_64"] is True
    raised_in = found["raised_in"]
    assert raised_in[-3:] == ["prepare_load", "prepare_load", "_prepare_load"]
    assert "update_state_after_alloc" in raised_in[-5:-3]
    assert found["after"] == {"64": [], "80": [0, 1, 2, 3]}
    assert found["finished"] is False
    if found["tier"] == "example":
        # the tier answers at once: the resend's first lookup asserts
        assert found["lookups"] == [[0, 64]] and found["accepted"] == [None]
    else:
        # fs answers RETRY first: the first lookup loads 64 and is accepted; after the
        # preemption the second answers 64 again and asserts before it is accepted
        assert found["lookups"] == [[0, 64], [0, 64]] and found["accepted"] == [64, None]


def _assert_served(found: dict[str, Any]) -> None:
    """What a fixed vLLM does: nothing raises and the resend finishes."""
    assert found["error"] is None, found["error"]
    assert found["finished"] is True


# ----------------------------------------------------------------- vLLM 0.33.0


def test_on_0_33_the_manager_evicts_what_its_lookup_answered_hit_and_the_load_asserts() -> None:
    _assert_manager_asserts(reproduce())


def test_on_0_33_with_the_candidate_fix_the_manager_load_succeeds() -> None:
    with protect_step_hits():
        _assert_manager_loads(reproduce())


@pytest.mark.parametrize("tier", TIERS)
def test_on_0_33_the_resend_asserts_on_the_real_scheduler(tier: str) -> None:
    _assert_scheduler_asserts(run(tier))


@FIXED
@pytest.mark.parametrize("tier", TIERS)
def test_on_0_33_a_fixed_vllm_serves_the_resend(tier: str) -> None:
    _assert_served(run(tier))


@pytest.mark.parametrize("tier", TIERS)
def test_on_0_33_with_the_candidate_fix_the_resend_loads_its_complete_hit(tier: str) -> None:
    found = run(tier, fix=True)
    _assert_served(found)
    # the promotions find nothing idle but the protected keys: MISS, and the complete hit
    # (64) is loaded, each time the resend is looked up
    assert found["accepted"] == ([64] if tier == "example" else [64, 64])


# ----------------------------------------------------------------- vLLM 0.34.0


def test_on_0_34_the_manager_evicts_what_its_lookup_answered_hit_and_the_load_asserts(
    on_034: dict[str, Any],
) -> None:
    _assert_manager_asserts(on_034["repro"])


def test_on_0_34_with_the_candidate_fix_the_manager_load_succeeds(
    on_034: dict[str, Any],
) -> None:
    _assert_manager_loads(on_034["repro_fix"])


@pytest.mark.parametrize("tier", TIERS)
def test_on_0_34_the_resend_asserts_on_the_real_scheduler(
    on_034: dict[str, Any], tier: str
) -> None:
    _assert_scheduler_asserts(on_034[tier])


@FIXED
@pytest.mark.parametrize("tier", TIERS)
def test_on_0_34_a_fixed_vllm_serves_the_resend(on_034: dict[str, Any], tier: str) -> None:
    _assert_served(on_034[tier])


@pytest.mark.parametrize("tier", TIERS)
def test_on_0_34_with_the_candidate_fix_the_resend_loads_its_complete_hit(
    on_034: dict[str, Any], tier: str
) -> None:
    found = on_034[tier + "_fix"]
    _assert_served(found)
    assert found["accepted"] == ([64] if tier == "example" else [64, 64])
