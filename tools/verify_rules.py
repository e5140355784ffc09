"""Verify keytrace's rules on a vLLM release with the oracle, and ship the outcome.

    # run the oracle on the installed vLLM (or a release's sdist code: tools/vllm_sdist.py)
    python tools/verify_rules.py run --out v033.json
    PYTHONPATH=$(python tools/vllm_sdist.py --version 0.34.0 --sources | head -1) python tools/verify_rules.py run --out v034.json

    # only the layouts of one kind: --lookahead-only, --recurrent-only, --dcp-only,
    # --retention-only, --partial-only, --checkpoint-only (not part of a plain run)
    python tools/verify_rules.py run --dcp-only --out v033-dcp.json

    # fold the runs into the file keytrace ships (keytrace/judge/verified_rules.json)
    python tools/verify_rules.py ship v033.json v034.json

``keytrace doctor --verify`` does the first for a user, on this machine only; this tool
is how the releases keytrace supports get verified once, by CI's oracle, for everyone:
a trace recorded on code with a shipped digest is judged as verified anywhere. The shipped
file is rewritten deterministically (sorted; per digest, one run per release and kind of
run: the latest).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(
    out_path: str,
    seconds: float,
    episodes: int,
    lookahead_only: bool,
    recurrent_only: bool,
    retention_only: bool,
    seeds: int,
    dcp_only: bool = False,
    partial_only: bool = False,
    checkpoint_only: bool = False,
) -> int:
    from keytrace.vllm.hook import rulecode
    from keytrace.vllm.lab.verify import DRAFTERS, verify

    t0 = time.monotonic()

    def progress(what: str, i: int, n: int) -> None:
        print(f"[{time.monotonic() - t0:5.0f}s] {i + 1}/{n} {what}", file=sys.stderr, flush=True)

    drafters = tuple(d for d in DRAFTERS if d is not None) if lookahead_only else DRAFTERS
    apart = partial_only or checkpoint_only  # layouts run only when asked, alone
    out = verify(
        budget_seconds=seconds,
        min_episodes=episodes,
        progress=progress,
        keep=False,
        drafters=drafters,
        recurrent=not (lookahead_only or dcp_only or retention_only or apart),
        layouts=not (recurrent_only or dcp_only or retention_only or apart),
        retention=not (lookahead_only or recurrent_only or dcp_only or apart),
        seeds=seeds,
        dcp=False if apart else dcp_only or None,
        partial=partial_only,
        checkpoint=checkpoint_only,
    )
    doc = asdict(out)
    doc["code_digests"] = dict(rulecode.code_digests())
    only = (
        " --lookahead-only"
        if lookahead_only
        else " --recurrent-only"
        if recurrent_only
        else " --dcp-only"
        if dcp_only
        else " --retention-only"
        if retention_only
        else " --partial-only"
        if partial_only
        else " --checkpoint-only"
        if checkpoint_only
        else ""
    )
    doc["how"] = "CI oracle: tools/verify_rules.py run" + only
    doc["when"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    Path(out_path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(
        f"vLLM {out.vllm} rules digest {out.digest}: {out.episodes} shortfall episodes in "
        f"{out.workloads} workloads, {len(out.disagreements)} disagreement(s), "
        f"{out.seconds:.0f}s -> {out_path}"
    )
    return 1 if out.disagreements else 0


def ship(paths: list[str]) -> int:
    from keytrace.judge.trust import VERIFIED_FILE

    try:
        doc = json.loads(VERIFIED_FILE.read_text())
    except (OSError, ValueError):
        doc = {}
    digests: dict[str, list[dict[str, object]]] = doc.get("digests", {})
    for p in paths:
        r = json.loads(Path(p).read_text())
        how = r.get("how", "CI oracle: tools/verify_rules.py run")
        runs = [
            v for v in digests.get(r["digest"], []) if (v["vllm"], v["how"]) != (r["vllm"], how)
        ]
        runs.append(
            {
                "vllm": r["vllm"],
                "episodes": r["episodes"],
                "disagreements": len(r["disagreements"]),
                "when": r["when"],
                "how": how,
                **({"covers": r["covers"]} if r.get("covers") else {}),
            }
        )
        digests[r["digest"]] = sorted(runs, key=lambda v: (str(v["vllm"]), str(v["how"])))
    VERIFIED_FILE.write_text(
        json.dumps(
            {
                "about": "rules digest -> oracle runs on that vLLM code "
                "(keytrace.judge.trust; tools/verify_rules.py)",
                "digests": dict(sorted(digests.items())),
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    print(f"{VERIFIED_FILE}: {len(digests)} digest(s)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the oracle on the installed vLLM")
    r.add_argument("--out", required=True)
    r.add_argument("--seconds", type=float, default=1500)
    r.add_argument("--episodes", type=int, default=300)
    r.add_argument("--seeds", type=int, default=3, help="rounds of every layout in the plan")
    only = r.add_mutually_exclusive_group()
    only.add_argument(
        "--lookahead-only", action="store_true", help="only workloads with an EAGLE/MTP drafter"
    )
    only.add_argument(
        "--recurrent-only", action="store_true", help="only workloads with recurrent groups"
    )
    only.add_argument(
        "--dcp-only",
        action="store_true",
        help="only workloads under decode context parallelism (recurrent groups, and MLA attention)",
    )
    only.add_argument(
        "--retention-only",
        action="store_true",
        help="only workloads with a retention interval (positive or dense)",
    )
    only.add_argument(
        "--partial-only",
        action="store_true",
        help="only workloads with recurrent groups and partial tails (a hash unit below the block)",
    )
    only.add_argument(
        "--checkpoint-only",
        action="store_true",
        help="only workloads with recurrent groups whose prefill checkpoints are exported "
        "inside a chunk (the nemotron_h preset)",
    )
    s = sub.add_parser("ship", help="fold run outputs into keytrace/judge/verified_rules.json")
    s.add_argument("paths", nargs="+")
    a = ap.parse_args()
    if a.cmd == "run":
        return run(
            a.out,
            a.seconds,
            a.episodes,
            a.lookahead_only,
            a.recurrent_only,
            a.retention_only,
            a.seeds,
            a.dcp_only,
            a.partial_only,
            a.checkpoint_only,
        )
    return ship(a.paths)


if __name__ == "__main__":
    raise SystemExit(main())
