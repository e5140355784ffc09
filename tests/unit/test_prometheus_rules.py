"""examples/prometheus: the alert rules pass promtool (syntax, and its unit tests with
series that must fire and series that must not), and every metric they read exists: in
keytrace's exposition, and in vLLM 0.33.0's metric definitions."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from keytrace.live.metrics import AlarmCollector
from tests.conftest import promtool_path

HERE = Path(__file__).resolve().parents[2] / "examples" / "prometheus"
RULES = HERE / "keytrace-rules.yml"


def _promtool(*args: str) -> str:
    r = subprocess.run([promtool_path(), *args], cwd=HERE, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_rules_are_valid() -> None:
    assert "SUCCESS: 3 rules found" in _promtool("check", "rules", RULES.name)


def test_rules_fire_on_write_only_series_and_stay_quiet_otherwise() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "keytrace-rules.test.yml")


def test_every_metric_the_rules_read_exists() -> None:
    names = set(
        re.findall(r"\b((?:vllm:|keytrace_)[a-z_:]+?)(?:_total)?\b[\[{)]", RULES.read_text())
    )
    ours = {f.name for f in AlarmCollector().collect()}
    vllm_names = {
        "vllm:kv_offload_store_bytes",  # distributed/kv_transfer/.../offloading/metrics.py
        "vllm:external_prefix_cache_queries",  # v1/metrics/loggers.py
        "vllm:external_prefix_cache_hits",
    }
    assert names == {f"keytrace_{n}" for n in ("episodes", "short_of_expected_tokens")} | vllm_names
    assert {n for n in names if n.startswith("keytrace_")} <= ours
