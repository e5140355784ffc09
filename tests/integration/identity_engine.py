"""One engine of `test_identity`: a process of the real scheduler (the CPU lab's Harness)
that records into a trace folder and serves one prompt, over a tiered manager whose ``fs``
tier sits in a folder other engines may share (or over a CPU tier alone).

``python -m tests.integration.identity_engine TRACE DISK TOKENS [--algo A] [--dp R]
[--cpu-only] [--alarm]``; PYTHONHASHSEED comes from the environment, as for vLLM."""

from __future__ import annotations

import argparse
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("disk")
    ap.add_argument("tokens", type=int)
    ap.add_argument("--algo", default="sha256")
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--alarm", action="store_true", help="with the live alarm on")
    args = ap.parse_args()

    from keytrace.analysis.geometry import builtin
    from keytrace.vllm.hook.patches import recording
    from keytrace.vllm.lab import config as lab_config
    from keytrace.vllm.lab import harness as lab_harness
    from keytrace.vllm.lab.config import tiered

    build = lab_config.build_vllm_config

    def with_algo(*a: Any, **kw: Any) -> Any:
        cfg = build(*a, **kw)
        cfg.cache_config.prefix_caching_hash_algo = args.algo  # --prefix-caching-hash-algo
        return cfg

    lab_harness.build_vllm_config = with_algo  # type: ignore[attr-defined]
    geo = builtin("small").with_(cpu_chunks=24)
    if not args.cpu_only:
        geo = tiered(geo, ("fs",), args.disk)
    from keytrace.live.registry import AlarmSettings

    with recording(args.trace, AlarmSettings() if args.alarm else None):
        h = lab_harness.Harness(geo, max_prompt_tokens=4_000, dp_rank=args.dp)
        try:
            h.submit(args.tokens)
            h.run_until_idle()
            if h.secondary_tiers:
                h.settle_tiers()
        finally:
            h.close()


if __name__ == "__main__":
    main()
