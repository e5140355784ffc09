"""The lab on vLLM 0.34.0, the newest release (its sdist's own Python over the installed
dependencies, in a fresh interpreter: vllm_builds), and the same drafters on the installed
0.33.0.

0.34.0 refuses an x86 CPU without triton-cpu while building a config, and hashes each block
over the next L tokens when an EAGLE/MTP drafter runs with an OffloadingConnector
(``VllmConfig.num_hash_lookahead_tokens``). So the lab must get past the first (its own
patch row, never a server's) and build the drafter as vLLM does, so that L, the request
hashes and the trace header are vLLM's own. Each 0.34.0 case costs an interpreter and an
import of vLLM: one script checks the harness, L and a recorded scenario; the CLI and the
doctor have one each."""

from __future__ import annotations

import csv
import inspect
import json
import platform
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_vllm

require_vllm()

from keytrace.analysis.geometry import HYBRID, Drafter  # noqa: E402
from tests.integration.vllm_builds import (  # noqa: E402
    DEFAULT_CACHE,
    capability_table,
    doctor,
    run_python,
)

pytestmark = pytest.mark.vllm

RELEASE = "0.34.0"
P = 1025
"""A prompt one token past 64 blocks of 16: with L = 2 its 64th block hash needs two tokens
it does not have, so it has 63 ((P - L) // tph); with L = 0 or 1, 64."""

LOOKAHEAD = {"none": 0, "eagle:2": 1, "mtp:1:3": 1, "mtp:2:3": 2, "mtp:3:3": 3, "mtp:2:1": 1}
"""vLLM 0.34.0's own L with the OffloadingConnector (docs of record: the 0.34.0 notes, §1.1):
EAGLE 1 for any k; MTP with n_predict 3 modules k; a single-module MTP drafter 1."""

HEADER_KEYS = (
    "spec_method",
    "num_speculative_tokens",
    "spec_mtp_modules",
    "num_hash_lookahead_tokens",
    "use_lookahead_block_hashes",
    "eagle_proof_margins",
    "hash_algo",
    "retention_interval",
    "vllm_version",
)

LAB = """
import json, tempfile
import vllm
import vllm.triton_utils as triton_utils
from vllm.platforms import current_platform
from keytrace.analysis.geometry import HYBRID, parse_drafter
from keytrace.format.reader import open_trace
from keytrace.vllm.hook import layers, patches
from keytrace.vllm.lab.config import build_vllm_config
from keytrace.vllm.lab.harness import Harness
from keytrace.vllm.lab.replay import replay

P, KEYS, DRAFTERS = {P}, {keys!r}, {drafters!r}
had_triton = triton_utils.HAS_TRITON


def refusal(cfg):
    try:
        current_platform.check_and_update_config(cfg)
    except RuntimeError as exc:
        return str(exc)
    return None


out = {{"version": vllm.__version__, "had_triton": had_triton}}
out["lookahead"] = {{
    d: build_vllm_config(HYBRID.with_(drafter=parse_drafter(d)), cpu_bytes_to_use=1 << 20)
    .num_hash_lookahead_tokens
    for d in DRAFTERS
}}
out["hashes"] = {{}}
for d in ("none", "mtp:2:3"):
    with Harness(HYBRID.with_(drafter=parse_drafter(d)), max_prompt_tokens=P) as h:
        rid = h.submit(P)
        out["hashes"][d] = [
            h.num_hash_lookahead_tokens, h.hash_block_size,
            len(h.scheduler.requests[rid].block_hashes),
        ]
        cfg = h.vllm_config
out["lab_after_build"] = layers.active("lab")
out["triton_after_build"] = triton_utils.HAS_TRITON
out["refused_outside_the_lab"] = refusal(cfg)
with tempfile.TemporaryDirectory() as d:
    out["server_installed"] = patches.install(d)  # what the plugin does in a server
    out["lab_in_server"] = layers.active("lab")
    out["refused_in_server"] = refusal(cfg)
    patches.uninstall()
with tempfile.TemporaryDirectory() as d:
    r = replay(HYBRID.with_(drafter=parse_drafter("mtp:2:3")), [P], P, trace_dir=d)
    header = open_trace(d).header
    out["header"] = {{k: header.get(k) for k in KEYS}}
    out["resend_external"] = r.external_tokens
print(json.dumps(out))
"""

TRITON_REFUSAL = "vLLM on x86 CPUs requires Triton (triton-cpu)."


def _where() -> dict[str, Any]:
    """0.34.0's code, with a model-info cache of its own (vLLM inspects each architecture in
    a subprocess and caches it; shared with 0.33.0's it would mix the two releases)."""
    return {"release": RELEASE, "env": {"VLLM_CACHE_ROOT": str(DEFAULT_CACHE / "vllm-cache-0.34")}}


@pytest.fixture(scope="module")
def lab() -> dict[str, Any]:
    code = LAB.format(P=P, keys=HEADER_KEYS, drafters=tuple(LOOKAHEAD))
    r = run_python(code, **_where())
    assert r.returncode == 0, r.stderr[-4000:]
    found: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["version"] == RELEASE
    return found


def test_the_harness_builds_on_0_34_with_the_triton_row_only_in_the_lab(
    lab: dict[str, Any],
) -> None:
    assert lab["lab_after_build"] is False  # switched on around the lab's config only
    assert lab["triton_after_build"] == lab["had_triton"]  # the flag put back
    assert lab["server_installed"] is True and lab["lab_in_server"] is False
    if platform.machine().lower() in ("x86_64", "amd64") and not lab["had_triton"]:
        # the check the lab's row lets pass is intact outside it, and in a server
        assert lab["refused_outside_the_lab"] == TRITON_REFUSAL
        assert lab["refused_in_server"] == TRITON_REFUSAL


def test_the_hash_lookahead_is_vllm_s_own(lab: dict[str, Any]) -> None:
    assert lab["lookahead"] == LOOKAHEAD


def test_a_request_has_one_hash_per_block_before_its_last_L_tokens(lab: dict[str, Any]) -> None:
    for drafter, (lookahead, tph, hashes) in lab["hashes"].items():
        assert lookahead == LOOKAHEAD[drafter]
        assert hashes == (P - lookahead) // tph, drafter
    assert [n for _, _, n in lab["hashes"].values()] == [64, 63]


def test_a_recorded_scenario_s_header_says_what_decides_the_rules(lab: dict[str, Any]) -> None:
    assert lab["header"] == {
        "spec_method": "mtp",
        "num_speculative_tokens": 2,
        "spec_mtp_modules": 3,
        "num_hash_lookahead_tokens": 2,
        "use_lookahead_block_hashes": True,
        "eagle_proof_margins": {},  # no partial tails on this geometry
        "hash_algo": "sha256",
        "retention_interval": 0,
        "vllm_version": RELEASE,
    }


SWEEP = """
import sys
from keytrace.cli import main
codes = [
    main(["sweep", "--geometry", "hybrid", "--lengths", "1024:1027", "--drafter", drafter,
          "--quiet", "--csv", {out!r} + "/" + drafter.replace(":", "_") + ".csv"])
    for drafter in ("mtp:2:3", "mtp:3:3")
]
codes.append(main(["sweep", "--geometry", "hybrid", "--lengths", "1024:1027,1088:1091",
                   "--drafter", "mtp:3:3", "--fix", "lookahead_replay_boundary", "--quiet",
                   "--csv", {out!r} + "/fixed.csv"]))
sys.exit(max(codes))
"""


def test_the_0_34_resend_hole_is_vllm_s_and_keytrace_names_it(tmp_path: Path) -> None:
    """docs/findings.md, vLLM 0.34.0: with multi-module MTP (lookahead L >= 2), an identical
    resend of P tokens gets 0 external tokens exactly when P mod A is in [1, L - 1] (A = 64
    here): the store kept the windows' tails at its own boundary (P - 1 rounded down), which
    the resend's hashes (P - L) no longer reach. On stock 0.34.0 this is red, as a strict
    xfail would be: when vLLM fixes it, the external counts change and this test says so."""
    r = run_python(SWEEP.format(out=str(tmp_path)), **_where())
    assert r.returncode == 1, r.stderr[-4000:]  # 1: a length mismatched (and nothing else)
    found = {}
    for drafter in ("mtp_2_3", "mtp_3_3"):
        with (tmp_path / f"{drafter}.csv").open() as fh:
            found[drafter] = {
                int(row["length"]): (int(row["external"]), row["verdict"], row["cause"])
                for row in csv.DictReader(fh)
            }
    hit, hole = (960, "hit", ""), (0, "mismatch", "never_offered")
    # vLLM's own outcome with L = 2: 1,024 tokens key 63 hashes (15 full-attention chunks);
    # 1,025 stored the windows' tails at 1,024, which a resend hashing 63 blocks never reaches
    assert found["mtp_2_3"] == {
        1024: hit,
        1025: hole,
        1026: (1024, "hit", ""),
        1027: (1024, "hit", ""),
    }
    # L = 3: P mod 64 in [1, 2]
    assert found["mtp_3_3"] == {1024: hit, 1025: hole, 1026: hole, 1027: (1024, "hit", "")}
    # the candidate fix (the windows also keep their tails at P - L) closes every one of
    # them, at the boundary the resend reaches, and changes no other length
    with (tmp_path / "fixed.csv").open() as fh:
        fixed = {
            int(row["length"]): (int(row["external"]), row["verdict"], row["cause"])
            for row in csv.DictReader(fh)
        }
    assert fixed == {
        1024: hit,
        1025: hit,
        1026: hit,
        1027: (1024, "hit", ""),
        1088: (1024, "hit", ""),
        1089: (1024, "hit", ""),
        1090: (1024, "hit", ""),
        1091: (1088, "hit", ""),
    }


FUZZ = """
import sys
from keytrace.cli import main
sys.exit(main(["fuzz", "-o", {out!r}, "--drafter", "mtp:2:3", "--seed", "1",
               "--max-examples", "40", "--aligned-windows", "--no-progress"]))
"""


def test_fuzz_with_a_drafter_finds_and_shrinks_the_0_34_resend_hole(tmp_path: Path) -> None:
    """`keytrace fuzz --drafter` draws cases with vLLM's own SpeculativeConfig: on 0.34.0
    with multi-module MTP it finds the resend hole above by itself, shrunk to two groups."""
    r = run_python(FUZZ.format(out=str(tmp_path / "f")), **_where())
    assert r.returncode == 1, r.stderr[-4000:]
    found = json.loads((tmp_path / "f" / "fuzz.json").read_text())
    case, verdict = found["failure"], found["verdict"]
    geometry = case["geometry"]
    assert geometry["drafter"] == {"method": "mtp", "num_speculative_tokens": 2, "mtp_modules": 3}
    assert case["shape"] == "resend" and len(geometry["groups"]) == 2
    A = geometry["groups"][0]["block_size"] * geometry["blocks_per_chunk"]
    assert case["episode"] % A == 1  # P mod A in [1, L - 1], L = 2
    assert verdict["external_tokens"] == 0 and verdict["cause"] == "never_offered"
    _report_is_red_in_vllms_own_tree(tmp_path / "f" / "minimal-trace", tmp_path / "report", A)


REPORT = """
import sys
from keytrace.cli import main
sys.exit(main(["report", {trace!r}, "-o", {out!r}, "--no-minimize", "--sweep-points", "8",
               "--no-progress"]))
"""


def _report_is_red_in_vllms_own_tree(trace: Path, out: Path, A: int) -> None:
    """`keytrace report` of the shrunk case writes a test that imports only vLLM: dropped
    into 0.34.0's own offloading tests it fails the way the bug does (0 external tokens
    where the store kept E), and the same test without the recorded lookahead (L = 0) passes:
    the red is the lookahead's, not the test's."""
    import re
    import subprocess

    from tests.integration.vllm_builds import cpu_env, release_sources

    r = run_python(REPORT.format(trace=str(trace), out=str(out)), **_where())
    assert r.returncode == 1, r.stderr[-4000:]
    [test] = out.glob("test_offload_regression_*.py")
    text = test.read_text()
    assert "LOOKAHEAD_TOKENS = 2" in text and "num_hash_lookahead_tokens=LOOKAHEAD_TOKENS" in text
    expected = int(re.search(r"^EXPECTED_EXTERNAL_TOKENS = (\d+)$", text, re.M)[1])  # type: ignore[index]
    tree = release_sources(RELEASE)
    here = tree / "tests" / "v1" / "kv_connector" / "unit" / "offloading_connector"
    as_recorded, without = (
        here / f"test_kt_{out.parent.name}_l2.py",
        here / f"test_kt_{out.parent.name}_l0.py",
    )
    as_recorded.write_text(text)
    # the same store and lookup without lookahead: every block hashed, E = the whole prime
    prime = int(re.search(r"^PRIME_TOKENS = (\d+)$", text, re.M)[1])  # type: ignore[index]
    whole = prime // A * A
    without.write_text(
        text.replace("LOOKAHEAD_TOKENS = 2", "LOOKAHEAD_TOKENS = 0").replace(
            f"EXPECTED_EXTERNAL_TOKENS = {expected}", f"EXPECTED_EXTERNAL_TOKENS = {whole}"
        )
    )
    try:
        ran = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:keytrace",
                "--confcutdir=tests/v1/kv_connector",
                "--tb=line",
                "-rA",
                str(as_recorded.relative_to(tree)),
                str(without.relative_to(tree)),
            ],
            cwd=tree,
            env=cpu_env(tree),
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        as_recorded.unlink(missing_ok=True)
        without.unlink(missing_ok=True)
    assert f"assert 0 == {expected}" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert (
        f"FAILED tests/v1/kv_connector/unit/offloading_connector/{as_recorded.name}" in ran.stdout
    )
    assert f"PASSED tests/v1/kv_connector/unit/offloading_connector/{without.name}" in ran.stdout


def test_doctor_says_the_lab_works_on_0_34() -> None:
    code, found = doctor(**_where())
    assert found["vllm"]["version"] == RELEASE and code == 0
    assert capability_table(found)["harness"] and capability_table(found)["record"]
    harness = next(c for c in found["capabilities"] if c["name"] == "harness")
    checks = {c["check"]: c["ok"] for c in harness["checks"]}
    row = "CpuPlatform.check_and_update_config is the code keytrace's wrapper was written against"
    assert (
        checks[row] and checks["ModelRunnerOutput(req_ids, sampled_token_ids, kv_connector_output)"]
    )
    assert "lab" not in capability_table(found)  # part of the harness, not a capability


# ----------------------------------------------------------- the installed 0.33.0
def test_on_0_33_a_drafter_leaves_the_hashes_legacy(tmp_path: Path) -> None:
    """0.33.0 keeps legacy hashes with any connector: L 0 whatever the drafter, and the
    header says so."""
    from keytrace.format.reader import open_trace
    from keytrace.vllm.lab.harness import Harness
    from keytrace.vllm.lab.replay import replay

    geo = HYBRID.with_(drafter=Drafter("mtp", 3, 3))
    with Harness(geo, max_prompt_tokens=P) as h:
        rid = h.submit(P)
        assert h.num_hash_lookahead_tokens == 0
        assert len(h.scheduler.requests[rid].block_hashes) == P // h.hash_block_size
    replay(geo, [P], P, trace_dir=tmp_path / "t")
    header = open_trace(str(tmp_path / "t")).header
    assert {k: header[k] for k in HEADER_KEYS[:5]} == {
        "spec_method": "mtp",
        "num_speculative_tokens": 3,
        "spec_mtp_modules": 3,
        "num_hash_lookahead_tokens": 0,
        "use_lookahead_block_hashes": None,  # 0.33.0's connector has no such switch
    }


def test_the_lab_row_is_scoped_idempotent_and_never_a_server_s(tmp_path: Path) -> None:
    from keytrace.vllm.hook import layers, patches
    from keytrace.vllm.hook.compat import cpu_platform_class

    cls = cpu_platform_class()
    original = inspect.getattr_static(cls, "check_and_update_config")
    with patches.lab_platform():
        assert layers.active("lab")
        wrapped = inspect.getattr_static(cls, "check_and_update_config")
        assert wrapped is not original and wrapped.__wrapped__ is original
        with patches.lab_platform():  # nested: the outer block keeps it on
            pass
        assert layers.active("lab")
    assert inspect.getattr_static(cls, "check_and_update_config") is original
    assert not layers.active("lab")
    assert patches.install(tmp_path / "t")
    try:
        assert not layers.active("lab")
        assert inspect.getattr_static(cls, "check_and_update_config") is original
    finally:
        patches.uninstall()


def test_the_lab_row_sees_triton_only_while_the_check_runs() -> None:
    import vllm.triton_utils as triton_utils

    from keytrace.vllm.hook.wrappers import with_triton_seen

    before = triton_utils.HAS_TRITON
    seen = []
    with_triton_seen(lambda: seen.append(triton_utils.HAS_TRITON), None, (), {})
    assert (seen, triton_utils.HAS_TRITON) == ([True], before)

    def refuses() -> None:
        raise RuntimeError("vLLM says no")

    with pytest.raises(RuntimeError, match="vLLM says no"):
        with_triton_seen(refuses, None, (), {})
    assert (triton_utils.HAS_TRITON, sys.modules["vllm.triton_utils"]) == (before, triton_utils)


ORACLE = """
import json, sys, tempfile
from collections import Counter
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import parse_drafter
from keytrace.format.reader import open_trace
from keytrace.live.registry import alarms
from keytrace.vllm.lab.oracle import check
from keytrace.vllm.lab.workload import WorkloadSpec, run_workload
from tests.alarm_checks import SETTINGS, field_differences

spec = WorkloadSpec(geometry="small", seed=32, conversations=10, tiers=("fs",), cpu_chunks=14,
                    drafter=parse_drafter("mtp:2:3"))
with tempfile.TemporaryDirectory() as d:
    result = run_workload(spec, d, alarm=SETTINGS)
    trace = open_trace(d)
    report = diff(trace, all_episodes=True)
    oracle = check(d, result.prompts)
    live = alarms()
    fields = field_differences(trace, report, live)
    judged = sum(len(a.judged or ()) for a in live)
print(json.dumps({
    "lookahead": report.header.get("num_hash_lookahead_tokens"),
    "checked": len(oracle),
    "disagreements": [c.describe() for c in oracle if not c.agree],
    "alarm": dict(sum((Counter(a.counts()) for a in live), Counter())),
    "differ": report.counts, "episodes": len(report.episodes), "judged": judged,
    "fields": [repr(f) for f in fields],
}))
"""


def test_the_oracle_agrees_on_0_34_under_mtp_lookahead_on_a_tiered_manager() -> None:
    """The lab's truth on 0.34.0 (tools/verify_rules.py runs the full plan): every
    shortfall of a seeded workload, looked up again alone, agrees with the differ, and the
    live alarm says what the differ says, episode by episode; multi-module MTP (L = 2), a CPU tier over a real
    fs tier small enough to promote."""
    r = run_python(ORACLE, **_where())
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["lookahead"] == 2
    assert found["checked"] >= 10 and found["disagreements"] == []
    # the live alarm judged every episode the differ did, and agrees field by field
    # (tests/alarm_checks.py: verdict, E, causes, binding group, terminal key, tokens short)
    assert found["judged"] == found["episodes"] > found["checked"]
    assert found["fields"] == []
    assert found["alarm"] == found["differ"]


RECURRENT_MTP = """
import json, sys, tempfile
from keytrace.analysis.diff import diff
from keytrace.analysis.geometry import RECURRENT_MTP
from keytrace.format.reader import open_trace
from keytrace.vllm.lab.replay import replay
out = {{}}
for n in (700, 760):
    with tempfile.TemporaryDirectory() as d:
        r = replay(RECURRENT_MTP.with_(blocks_per_chunk=2), [n], n, trace_dir=d)
        rules = diff(open_trace(d)).rules
        out[n] = [r.external_tokens, r.verdict, r.cause, rules.as_json(), open_trace(d).header["num_hash_lookahead_tokens"]]
print(json.dumps(out))
"""


def test_a_recurrent_model_with_its_mtp_drafter_is_judged_on_0_34() -> None:
    """Qwen3-Next-like with its MTP drafter: vLLM 0.34.0 hashes each block over the next
    token (L = 1) and drops no block, so keytrace judges it, verified by the shipped oracle
    run that covered recurrent groups under lookahead; the state that ends no chunk is the
    same finding as without a drafter."""
    r = run_python(RECURRENT_MTP.format(), **_where())
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    hit, miss = found["700"], found["760"]
    assert hit[:3] == [640, "hit", None] and hit[4] == 1
    assert miss[:3] == [0, "mismatch", "no_checkpoint"]
    assert miss[3]["trust"] == "verified"
    assert miss[3]["needs"] == ["recurrent", "recurrent+lookahead"]


DEFERRED = """
import sys
sys.path.insert(0, {tools!r})
from regen_test_data import record_tiered
record_tiered({out!r})
"""


def test_a_deferred_release_is_recorded_on_0_34(tmp_path: Path) -> None:
    """vLLM 0.34.0's tiering manager fails a promotion whose tier may still write its slots
    at once and frees the slots later (``defer_write_release``/``release_deferred_write``):
    recorded live, as the committed v5 trace shows it (tools/regen_test_data.py's scenario),
    the keys leave the primary with their promotion's request and job, and the same
    request's slots come back after."""
    import polars as pl

    from keytrace.format.reader import open_trace

    tools = str(Path(__file__).resolve().parents[2] / "tools")
    r = run_python(DEFERRED.format(tools=tools, out=str(tmp_path / "t")), **_where())
    assert r.returncode == 0, r.stderr[-4000:]
    tier = (
        open_trace(str(tmp_path / "t"))
        .collect("tier")
        .with_columns(pl.col("event", "req_id").cast(pl.String))
    )
    rows = {
        ev: tier.filter(pl.col("event") == ev)
        for ev in ("promotion_prepared", "promotion_deferred", "deferred_released")
    }
    assert [f.height for f in rows.values()] == [16, 16, 16]
    assert set(rows["promotion_deferred"]["key"]) == set(rows["promotion_prepared"]["key"])
    assert set(rows["deferred_released"]["key"]) == set(rows["promotion_prepared"]["key"])
    jobs = rows["promotion_deferred"].select("req_id", "tier", "job_id").unique().rows()
    assert len(jobs) == 1 and jobs[0][:2] == ("r3", 0) and jobs[0][2] is not None
    assert rows["deferred_released"].select("req_id", "tier", "job_id").unique().rows() == jobs
    assert rows["promotion_deferred"]["seq"].max() < rows["deferred_released"]["seq"].min()  # type: ignore[operator]


TWO_LOOKAHEADS = """
from keytrace.analysis.geometry import HYBRID, parse_drafter
from keytrace.vllm.hook.patches import recording
from keytrace.vllm.lab import config as lab_config
from keytrace.vllm.lab.config import tiered
from keytrace.vllm.lab.harness import Harness

make = lab_config.speculative_config
for disable in (False, True):
    # the second engine as a user sets it: --speculative-config
    # '{{"disable_lookahead_block_hashes": true, ...}}'
    def spec(*a, _disable=disable, **kw):
        cfg = make(*a, **kw)
        cfg.disable_lookahead_block_hashes = _disable
        return cfg

    lab_config.speculative_config = spec
    geo = tiered(HYBRID.with_(drafter=parse_drafter("mtp:2:3")), ("fs",), {disk!r})
    with recording({trace!r}):
        h = Harness(geo, max_prompt_tokens=2_000)
        try:
            h.submit({P})
            h.run_until_idle()
            h.settle_tiers()
        finally:
            h.close()
"""


def test_engines_sharing_a_tier_with_another_lookahead_are_one_finding(tmp_path: Path) -> None:
    """Two engines on 0.34.0 share one fs root, the second with the same MTP drafter but
    ``disable_lookahead_block_hashes``: their block hashes of one prompt differ (L = 2 vs
    0), so the second can never read what the first wrote. `keytrace diff` reads the trace
    (the lookahead is an engine's own setting, not a mixed configuration), names the
    engines and the field (``lookahead_tokens``) as one hash-identity finding, exit 1, and
    judges each engine under its own header."""
    from keytrace.analysis.diff import diff
    from keytrace.cli import main
    from keytrace.format.reader import engine_headers, open_trace
    from keytrace.judge.identity import Finding

    trace, disk = tmp_path / "t", tmp_path / "disk"
    r = run_python(TWO_LOOKAHEADS.format(trace=str(trace), disk=str(disk), P=P), **_where())
    assert r.returncode == 0, r.stderr[-4000:]
    t = open_trace(str(trace))
    lookaheads = sorted(h["num_hash_lookahead_tokens"] for h, _ in engine_headers(t).values())
    assert lookaheads == [0, 2]
    report = diff(t, all_episodes=True)
    (finding,) = report.identity
    assert finding.finding is Finding.HASH_IDENTITY and finding.field == "lookahead_tokens"
    assert finding.tier.startswith("fs:") and len(finding.engines) == 2
    assert "disable_lookahead_block_hashes" in finding.fix
    assert report.verdict == "mismatch"
    assert main(["diff", str(trace)]) == 1
    # each engine's episodes judged under its own header: its own lookup cap
    caps = {
        header["num_hash_lookahead_tokens"]: sorted(
            {v.L for v in report.episodes if v.instance_id in insts}
        )
        for header, insts in engine_headers(t).values()
    }
    # P = 1,025, A = 64: N - 2 = 1,023 -> 960 under L = 2; N - 1 = 1,024 without
    assert caps == {2: [960], 0: [1024]}
    # the second engine's prompt: named for the cause, not "not stored anywhere"
    assert report.lost is not None
    rows = {r.label: r.tokens for r in report.lost.rows if r.engine == "all"}
    assert rows == {"cold: an engine on its shared tier hashes differently (hash identity)": 2 * P}
