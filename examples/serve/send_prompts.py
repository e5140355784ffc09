"""Send the end-to-end traffic to a running server: a 2,000-token prompt, a GPU-only
prefix-cache reset, the same prompt again (served from the CPU tier: 1,984 cached tokens),
a next turn, three concurrent new prompts. Prints each request's cached prompt tokens.

`tools/serve_e2e.py` sends exactly this traffic (it imports `send`), and the other
functions here for its other modes: `send_tiered` and `send_starving` (a tiered manager),
`send_hybrid` (a recurrent hybrid, whose prompts `hybrid_prompts` gives to the oracle).
Run as a script, this file sends `send`'s traffic to a server already running."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def prompt(seed: int, n: int) -> list[int]:
    """A deterministic token-id prompt; the same seed gives the same prefix."""
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        text = r.read().decode()
    return json.loads(text) if text.startswith("{") else {}


def send(base: str, model: str) -> list[int | None]:
    """The traffic above; per request, the prompt tokens the server did not compute."""

    def complete(ids: list[int]) -> int | None:
        out = post(base, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1})
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")

    first = prompt(1, 2_000)
    cached = [complete(first)]
    post(base, "/reset_prefix_cache", {})  # GPU prefix cache only (reset_external=false)
    cached.append(complete(first))  # what it gets now comes from the CPU tier
    cached.append(complete(first + prompt(2, 700)))  # the next turn
    with ThreadPoolExecutor(3) as pool:
        cached += list(pool.map(complete, [prompt(s, 1_500) for s in (3, 4, 5)]))
    return cached


def send_tiered(base: str, model: str, settle: float = 0.0) -> list[int | None]:
    """For a server whose small CPU tier sits over a disk tier (vLLM's tiered manager): a
    prompt, two others that push it out of the CPU tier (every store is also written to
    disk), ``settle`` seconds for the disk writes, a GPU-only prefix-cache reset, then the
    first prompt again: served from disk (promoted into the CPU tier, then loaded)."""
    cached = [_complete(base, model, prompt(s, 2_000)) for s in (1, 2, 3)]
    time.sleep(settle)
    post(base, "/reset_prefix_cache", {})
    cached.append(_complete(base, model, prompt(1, 2_000)))
    return cached


def send_starving(base: str, model: str, wait: float = 20.0) -> list[int | None]:
    """A prompt larger than the CPU tier (over a disk tier), a GPU-only reset, the same
    prompt again: on vLLM 0.32.0-0.33.0 its lookup is deferred again and again while its
    promotions evict its own prefix (docs/findings.md). On a served fs tier the loop has
    ended by itself after 44 to 874 deferrals (vLLM then recomputes the prompt); the client
    gives up after ``wait`` seconds (None: no answer) and the server aborts it."""
    cached = [_complete(base, model, prompt(7, 2_000))]
    post(base, "/reset_prefix_cache", {})
    cached.append(_complete(base, model, prompt(7, 2_000), timeout=wait))
    return cached


HYBRID_PROMPTS = (300, 420)
"""`send_hybrid`'s prompt lengths, on a recurrent hybrid of 128-token blocks: the prompt's
last recurrent state stands at its last block boundary, 256 and 384; with chunks of one
block both end a chunk, with chunks of two only 256 does (docs/findings.md, "Chunks of
several blocks on a recurrent hybrid")."""


def hybrid_prompts() -> list[list[int]]:
    """`send_hybrid`'s prompts (its requests' token ids: what an oracle re-looks up)."""
    return [prompt(11 + i, n) for i, n in enumerate(HYBRID_PROMPTS)]


def send_hybrid(base: str, model: str) -> list[int | None]:
    """For a recurrent hybrid (examples/serve/qwen3next-tiny): two prompts of
    `HYBRID_PROMPTS` tokens, a GPU-only prefix-cache reset, both again: what each resend
    gets comes from the CPU tier, as far as every group (the recurrent states too) was
    offloaded there."""
    prompts = hybrid_prompts()
    cached = [_complete(base, model, ids) for ids in prompts]
    post(base, "/reset_prefix_cache", {})
    cached += [_complete(base, model, ids) for ids in prompts]
    return cached


def _complete(base: str, model: str, ids: list[int], timeout: float = 120) -> int | None:
    """One completion's cached prompt tokens; None when the server did not answer in time."""
    body = {"model": model, "prompt": ids, "max_tokens": 1}
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read().decode())
    except TimeoutError:
        return None
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--model", default=None, help="served model name [default: the first]")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        model = args.model or json.loads(r.read())["data"][0]["id"]
    labels = ["prompt", "resend", "next turn", "concurrent", "concurrent", "concurrent"]
    for label, cached in zip(labels, send(base, model), strict=True):
        print(f"{label:10} cached tokens: {cached}")


if __name__ == "__main__":
    main()
