"""The vLLM metric names keytrace's alert rules (examples/prometheus) and docs rely on exist
in the installed vLLM (unit/test_prometheus_rules.py checks the rules themselves)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import require_vllm


def test_the_vllm_metrics_exist_in_vllm() -> None:
    require_vllm()
    import vllm

    src = Path(vllm.__file__).parent
    text = (src / "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py").read_text()
    text += (src / "v1/metrics/loggers.py").read_text()
    for name in (
        "vllm:kv_offload_store_bytes",
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
    ):
        assert f'"{name}"' in text
