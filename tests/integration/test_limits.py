"""Per-request limits and store admission on the real vLLM 0.33.0 scheduler: what a request
asked of the OffloadingConnector (``kv_transfer_params``: ``max_load_tokens``,
``max_offload_tokens``) and the CPU spec's ``store_threshold`` are recorded, and an episode
they kept from the tier is ``limited`` with the limit's name, in its verdict and in the
token account; never ``cold: not stored anywhere``, never a write-only warning. The live
alarm agrees with the differ on every episode.

Geometry ``hybrid``: FA tpc 64 (= A) + SWA tpc 16, window 32 (W = 2 chunks); prompt
P = 18,877 tokens, so an identical resend's own boundary is L = round_down(18,876, 64) =
18,816 (294 FA chunks). Retention 0 (vLLM's default): the prime keeps the SWA tail only at
its own boundary, chunks 1174-1175 (tokens 18,784-18,816). The GPU prefix cache is reset
before every resend (S = 0), so the cap is all that limits it.
(/work/notes/vllm-request-limits-hashing.md §1.5, §2.1 derive each number below.)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.alarm_checks import SETTINGS, assert_alarm_agrees
from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import builtin  # noqa: E402
from keytrace.analysis.results import DiffReport, EpisodeVerdict  # noqa: E402
from keytrace.live.registry import alarms  # noqa: E402

P = 18_877
OWN = 18_816  # the prime's own boundary: round_down(P - 1, 64)
HYBRID = builtin("hybrid").with_(max_model_len=65_536)


TOKENS: dict[str, list[int]] = {}
"""The token ids of the requests `_record` sent last (for the oracle)."""


def _record(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    sends: list[dict[str, Any] | None],
    geometry: Any = HYBRID,
    skip: tuple[bool, ...] = (),
    inject: str | None = None,
    warned: int = 0,
) -> tuple[DiffReport, list[int]]:
    """Send the same prompt once per entry of ``sends`` (its kv_transfer_params), the GPU
    prefix cache reset before each resend; the differ's report (the alarm agreeing on
    every episode, and no write-only warning) and each send's external tokens. ``skip``:
    which sends set the sampling params' ``skip_reading_prefix_cache``; ``inject``: a
    historical store bug (`keytrace.vllm.mods.inject`), then ``warned`` warnings."""
    from keytrace.vllm.hook.patches import injected, recording
    from keytrace.vllm.lab.harness import Harness

    caplog.set_level(logging.WARNING, logger="keytrace")
    d = str(tmp_path / "trace")
    with injected(inject), recording(d, SETTINGS):
        h = Harness(geometry, max_prompt_tokens=P)
        rids = []
        for i, params in enumerate(sends):
            if i:
                h.reset_gpu_prefix_cache()
            rids.append(
                h.submit_tokens(
                    h.tokens(P),
                    kv_transfer_params=params,
                    skip_reading_prefix_cache=True if i < len(skip) and skip[i] else None,
                )
            )
            h.run_until_idle()
        TOKENS.clear()
        TOKENS.update(dict.fromkeys(rids, h.tokens(P)))
        external = [h.observations[r].external_tokens for r in rids]
    warnings = [r.getMessage() for r in caplog.records if "write-only" in r.getMessage()]
    assert len(warnings) == warned
    return assert_alarm_agrees(d, alarms(), warnings), external


def _episodes(report: DiffReport) -> list[EpisodeVerdict]:
    return sorted(report.episodes, key=lambda v: v.episode)


def _rows(report: DiffReport) -> dict[str, int]:
    """The token account of every engine together: label -> tokens."""
    assert report.lost is not None
    return {r.label: r.tokens for r in report.lost.rows if r.engine == "all"}


@pytest.mark.parametrize("cap", [0, 1024])
def test_a_resend_that_asked_to_load_less_is_limited_by_max_load_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cap: int
) -> None:
    # cap 0: no external load at all (L = 0). cap 1024 on 0.33.0: min(18,877, 0 + 1,024)
    # = 1,024, then - 1 (a sliding-window group) = 1,023, rounded down to 64: L = 960; the
    # SWA group needs chunks 58-59 (tokens 928-960), never stored (the tail is at 18,816),
    # so vLLM returns 0 (the oracle agrees: test_the_oracle_says_the_1024_cap_works_as_coded).
    # Without the cap E would be 18,816: the resend is limited, its 18,816 tokens "by
    # request", and only the prime (nothing stored before it) is cold.
    report, external = _record(tmp_path, caplog, [None, {"max_load_tokens": cap}])
    prime, resend = _episodes(report)
    assert external == [0, 0]
    assert prime.verdict == "cold"
    assert (resend.verdict, resend.limit, resend.E, resend.E_free) == (
        "limited",
        "max_load_tokens",
        None,
        OWN,
    )
    assert (cap, resend.L) in ((0, 0), (1024, 960))
    assert resend.reason.startswith("by request: max_load_tokens")
    rows = _rows(report)
    assert rows["by request: max_load_tokens"] == OWN
    assert rows["cold: not stored anywhere"] == P  # the prime's alone
    assert rows["recomputed past E (by design)"] == P - OWN
    assert report.counts == {"cold": 1, "limited": 1}


def test_a_resend_that_asked_not_to_read_external_kv_is_limited_by_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # skip_reading_prefix_cache (a sampling parameter, not kv_transfer_params): vLLM
    # 0.33.0's connector answers 0 without a lookup (0.34.0 reads it as
    # skip_reading_external_kv). As max_load_tokens 0: L = 0, E without it 18,816.
    report, external = _record(tmp_path, caplog, [None, None], skip=(False, True))
    prime, resend = _episodes(report)
    assert external == [0, 0]
    assert prime.verdict == "cold"
    assert (resend.verdict, resend.limit, resend.L, resend.E_free) == (
        "limited",
        "skip_reading_prefix_cache",
        0,
        OWN,
    )
    rows = _rows(report)
    assert rows["by request: skip_reading_prefix_cache"] == OWN
    assert rows["cold: not stored anywhere"] == P


def test_a_cap_that_serves_what_it_allows_names_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Dense retention (every SWA block kept): every chunk boundary stands. Cap 1,024 on
    # 0.33.0: L = 960 (the - 1 after the cap) and vLLM serves 960 = E; without the cap
    # E = 18,816. Limited: 960 loaded, 18,816 - 960 = 17,856 by request.
    report, external = _record(
        tmp_path,
        caplog,
        [None, {"max_load_tokens": 1024}],
        HYBRID.with_(retention_interval=None),
    )
    _, resend = _episodes(report)
    assert external == [0, 960]
    assert (resend.verdict, resend.limit, resend.E, resend.E_free) == (
        "limited",
        "max_load_tokens",
        960,
        OWN,
    )
    rows = _rows(report)
    assert rows["offload tier (loaded)"] == 960
    assert rows["by request: max_load_tokens"] == OWN - 960


def test_a_shortfall_below_the_cap_is_still_a_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # geometry small (FA 64, SWA 16 and an MTP SWA group 16), retention 1,024, the store
    # bug pre48911 injected (the MTP group keeps only chunks c % 4 >= 2). Cap 1,025 on
    # 0.33.0: 1,025 - 1 -> L = 1,024, a standing boundary (retention): E = 1,024 under the
    # cap, E = 18,816 without it. The MTP group needs chunks 62-64 for a hit at 1,024 and
    # the bug never offered 64: a mismatch (warned), judged against the boundary the cap
    # allows; past it the cap's own tokens are counted apart.
    from keytrace.analysis.geometry import SMALL

    report, external = _record(
        tmp_path,
        caplog,
        [None, {"max_load_tokens": 1025}],
        SMALL.with_(retention_interval=1024, max_model_len=65_536),
        inject="pre48911",
        warned=1,
    )
    _, resend = _episodes(report)
    assert external == [0, 0]
    assert (resend.verdict, resend.E, resend.E_free, resend.limit) == (
        "mismatch",
        1024,
        OWN,
        "max_load_tokens",
    )
    assert resend.terminal is not None and (resend.binding_group, resend.terminal.chunk) == (2, 64)
    rows = _rows(report)
    assert rows["short of E (RULE): never_offered, group 2"] == 1024
    assert rows["by request: max_load_tokens"] == OWN - 1024


def test_a_prime_that_asked_to_store_less_names_the_resend_max_offload_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The prime asks max_offload_tokens 1,000: it offers FA chunks 0-14 (960 tokens), no
    # SWA tail (the store's reachable boundary stays at 18,876), and its FA chunk 15 and
    # SWA chunk 62 are withheld (recorded as such). The uncapped resend's FA scan hits 15
    # chunks and ends at chunk 15, the withheld key: limited by the prime's request.
    report, external = _record(tmp_path, caplog, [{"max_offload_tokens": 1000}, None])
    prime, resend = _episodes(report)
    assert external == [0, 0]
    assert prime.verdict == "cold"
    assert (resend.verdict, resend.limit, resend.E) == ("limited", "max_offload_tokens", None)
    assert resend.F == 960
    rows = _rows(report)
    assert rows["by request: max_offload_tokens"] == OWN
    assert rows["cold: not stored anywhere"] == P


def test_a_resend_the_threshold_filtered_names_store_threshold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # store_threshold 2: the first offer of every key only counts it (296 keys filtered:
    # 294 FA + the SWA tail's 2); the resend misses FA chunk 0, filtered: limited by the
    # admission filter, and its own offer stores them; the third send hits 18,816.
    geometry = HYBRID.with_(extra={**HYBRID.extra, "store_threshold": 2})
    report, external = _record(tmp_path, caplog, [None, None, None], geometry)
    first, second, third = _episodes(report)
    assert external == [0, 0, OWN]
    assert first.verdict == "cold"
    assert (second.verdict, second.limit) == ("limited", "store_threshold")
    assert third.verdict == "hit"
    rows = _rows(report)
    assert rows["filtered: store_threshold"] == OWN
    assert rows["cold: not stored anywhere"] == P


@pytest.mark.parametrize(("retention", "served"), [(0, 0), (None, 960)])
def test_the_oracle_says_the_1024_cap_works_as_coded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, retention: int | None, served: int
) -> None:
    # The case: an 18,877-token prompt stored, resent with max_load_tokens 1,024,
    # gets 0 (retention 0). Alone on a fresh real scheduler holding every key the prime
    # offered, the request gets 0 again with the cap and 18,816 without it: vLLM's cap
    # arithmetic as coded (0.33.0: 1,024 - 1 -> 960, where no SWA tail was stored), not a
    # disagreement under the cap. With dense retention the cap serves 960, as recorded.
    from keytrace.vllm.lab.oracle import check_limits

    _, external = _record(
        tmp_path,
        caplog,
        [None, {"max_load_tokens": 1024}],
        HYBRID.with_(retention_interval=retention),
    )
    assert external == [0, served]
    [case] = check_limits(str(tmp_path / "trace"), TOKENS)
    assert (case.max_load_tokens, case.capped_external, case.free_external) == (1024, served, OWN)
    assert case.agree, case.describe()


ON_034 = """
import json, logging
logging.disable(logging.WARNING)
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import builtin
from keytrace.format.reader import open_trace
from keytrace.vllm.hook.patches import recording
from keytrace.vllm.lab.harness import Harness
d = {d!r}
with recording(d):
    h = Harness(builtin("hybrid").with_(max_model_len=65_536), max_prompt_tokens={P})
    external = []
    for i, params in enumerate([None, {{"max_load_tokens": 1024}}, {{"max_load_tokens": 1024}}, None]):
        if i:
            h.reset_gpu_prefix_cache()
        r = h.submit({P}, kv_transfer_params=params)
        h.run_until_idle()
        external.append(h.observations[r].external_tokens)
    h.close()
t = open_trace(d)
report = diff(t, all_episodes=True)
print(json.dumps({{
    "trim": t.header.get("lookup_trims_before_caps"),
    "external": external,
    "episodes": [
        [v.verdict, v.limit, v.L, v.E, v.E_free]
        for v in sorted(report.episodes, key=lambda v: v.episode)
    ],
}}))
"""


def test_on_0_34_the_cap_is_a_boundary_and_a_second_capped_resend_gets_it(tmp_path: Path) -> None:
    # vLLM 0.34.0 takes the recomputed token off before the cap (the header says so:
    # lookup_trims_before_caps), so L = 1,024; the first capped resend still gets 0 (no SWA
    # tail at 1,024) but pins a junction there, whose tail its own store keeps: the second
    # capped resend gets 1,024 = E, limited (18,816 without the cap); an uncapped one hits.
    import json

    from tests.integration.test_lookahead import _where
    from tests.integration.vllm_builds import run_python

    r = run_python(ON_034.format(d=str(tmp_path / "trace"), P=P), **_where())
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["trim"] is True
    assert found["external"] == [0, 0, 1024, OWN]
    assert found["episodes"] == [
        ["cold", None, OWN, None, None],
        ["limited", "max_load_tokens", 1024, None, OWN],
        ["limited", "max_load_tokens", 1024, 1024, OWN],
        ["hit", None, OWN, OWN, None],
    ]


def test_a_replay_resends_what_the_requests_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # keytrace replay of the capped resend (dense retention: served 960 of 18,816): the plan
    # carries the resend's max_load_tokens, so the replay gets 960 and limited again, not
    # the 18,816 an uncapped resend would get.
    from keytrace.analysis.plan import plan_from_trace
    from keytrace.format.reader import open_trace
    from keytrace.vllm.lab.replay import replay_trace

    _, external = _record(
        tmp_path,
        caplog,
        [None, {"max_load_tokens": 1024}],
        HYBRID.with_(retention_interval=None),
    )
    assert external == [0, 960]
    trace = open_trace(str(tmp_path / "trace"))
    resend = max(TOKENS)  # r2, the later request
    plan = plan_from_trace(trace, request=resend)
    assert plan.prime_lengths == [P]
    assert [a["max_load_tokens"] for a in plan.request_limits] == [None, 1024]
    again = replay_trace(trace, request=resend, out_dir=str(tmp_path / "replay"))
    assert (again.result.external_tokens, again.result.verdict) == (960, "limited")
