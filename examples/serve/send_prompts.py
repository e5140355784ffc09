"""Send the end-to-end traffic to a running server: a 2,000-token prompt, a GPU-only
prefix-cache reset, the same prompt again (served from the CPU tier: 1,984 cached tokens),
a next turn, three concurrent new prompts. Prints each request's cached prompt tokens."""

from __future__ import annotations

import argparse
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--model", default=None, help="served model name [default: the first]")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"

    def post(path: str, body: dict[str, object]) -> dict[str, object]:
        req = urllib.request.Request(
            base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
        return json.loads(text) if text.startswith("{") else {}

    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        model = args.model or json.loads(r.read())["data"][0]["id"]

    def complete(ids: list[int]) -> object:
        out = post("/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1})
        usage = out.get("usage") or {}
        assert isinstance(usage, dict)
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    first = prompt(1, 2_000)
    print("prompt", complete(first))
    post("/reset_prefix_cache", {})
    print("resend", complete(first))
    print("next turn", complete(first + prompt(2, 700)))
    with ThreadPoolExecutor(3) as pool:
        print("concurrent", list(pool.map(complete, [prompt(s, 1_500) for s in (3, 4, 5)])))


if __name__ == "__main__":
    main()
