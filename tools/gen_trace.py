"""Write a large synthetic trace in the current schema through keytrace's own recorder.

    python tools/gen_trace.py OUT_DIR --rows 10_000_000 [--engines 4] [--planted 5] [--seed 0]

The geometry is the real `dsv4` header (five groups, their chunk sizes and windows). Each
request stores what vLLM 0.33.0 stores for its own end boundary E (every full-attention
chunk, each sliding-window group's tail), then is resent with one of these outcomes:

- hit (most): prefix scan over the full-attention group, right-to-left window scans that
  find their tails at once;
- evicted: the C4 tail is evicted by another request first; the C4 window scan then runs
  right to left to chunk 0 (the long scans that dominate real traces);
- pending: a sliding-window tail is still being written: lookup sees HIT_PENDING and vLLM
  defers; the store completes afterwards;
- retry: a full-attention key answers RETRY (a busy tier): deferred;
- cold: a new chain, nothing stored;
- planted mismatch (exactly --planted of them): the MTP group's leftmost needed chunk is
  never offered, so its window scan fails all the way left and the episode returns 0;
- with ``--misroute F`` (a fraction of the requests, half each), routing between engines:
  *misrouted*: the resend goes to the next engine, which holds nothing of the chain (a
  cold lookup whose prefix another engine stored: the routing account); *split*: the
  next engine holds the chain's full-attention chunks (a sibling request stored them, its
  window tails failed to store there) and the resend finds them but not the tails, which
  only the first engine stored (an explained shortfall: ``other_engine``).

Planted episodes are listed in OUT_DIR.planted.json as [engine_id, req_id] pairs.

The planted truth does not come from the differ: the tails are `window_tail` below, vLLM
0.33.0's rule written out for this geometry from its source (`_lookup_complete_chunks` and
its right-to-left `_sliding_window_lookup` with the EAGLE peek, in
`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`), not
`keytrace.judge.rules`. If the two ever disagree the benchmark reports planted episodes
missed or hits called mismatches.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from keytrace.analysis.geometry import DSV4, synthetic_header
from keytrace.format.schema import LookupResult
from keytrace.judge.rules import groups_from_header as _groups
from keytrace.record.recorder import Recorder

TPH = DSV4.tokens_per_hash  # 4 tokens per hash block
ORDER = None  # filled from the header's lookup order


def key(chain: int, end_token: int, gid: int) -> bytes:
    """Content-addressed like vLLM: the hash of the chunk's last hash block + group id."""
    j = end_token // TPH - 1
    return ((chain << 40) | j).to_bytes(32, "big") + gid.to_bytes(4, "big")


def window_tail(tpc: int, sliding_window: int, eagle: bool, E: int) -> list[int]:
    """The chunks vLLM 0.33.0's right-to-left scan of a sliding-window group must find for a
    hit ending at E (a multiple of every chunk size here): the last cdiv(sw, tpc) chunks
    before E; an MTP draft group also its peek chunk starting at E (the generator only makes
    prompts long enough to key it: P - E >= tpc)."""
    w = -(-sliding_window // tpc)
    return list(range(E // tpc - w, E // tpc + (1 if eagle else 0)))


def cold_lookup(rec: Recorder, rid: str, chain: int, tpc: int, P: int) -> None:
    """One lookup episode that finds nothing: its first full-attention key misses."""
    rec.episode_begin(rid, 0, None, P, P, P // TPH)
    rec.begin_scan()
    rec.lookup(key(chain, tpc, 0), rid, tpc, LookupResult.MISS, False)
    rec.episode_end(rid, 0, False)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=10_000_000, help="approximate key rows to write")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--planted", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=100_000)
    ap.add_argument(
        "--misroute", type=float, default=0.0, help="fraction of requests routed across engines"
    )
    args = ap.parse_args()

    rng = random.Random(args.seed)
    header = synthetic_header(DSV4)
    groups = _groups(header)
    by_gid = {g.gid: g for g in groups}
    order = header["lookup_order"]
    fa = by_gid[0]
    tpcs = {g.gid: g.tpc for g in groups}
    recs = [
        Recorder(
            args.out,
            header,
            engine_id=f"engine-{e}",
            dp_rank=e,
            tokens_per_chunk=tpcs,
            max_seconds=3600,
        )
        for e in range(args.engines)
    ]
    for r in recs:
        r.exact_scans = True

    # Spread the planted mismatches over the run: by expected row count.
    avg_rows = 2_500
    n_req_est = max(args.rows // avg_rows, args.planted * 4)
    planted_at = set(rng.sample(range(10, n_req_est), args.planted))
    planted: list[list[str]] = []
    rows = 0
    req_no = 0
    t0 = time.time()
    chain = 0
    while rows < args.rows or len(planted) < args.planted:
        rec = recs[req_no % len(recs)]
        P = rng.randrange(8_000, args.max_tokens)
        if (P - 1) % fa.tpc < 64:  # keep the MTP peek chunk keyable (see window_tail)
            P += 64
        chain += 1
        rid = f"req-{req_no}"
        rid2 = f"req-{req_no}-resend"
        E = (P - 1) // fa.tpc * fa.tpc
        routed = 100 * args.misroute / max(1e-9, 1 - args.misroute)
        outcome = (
            "planted"
            if req_no in planted_at
            else rng.choices(
                ["hit", "evicted", "pending", "retry", "cold", "misrouted", "split"],
                weights=[70, 10, 8, 5, 7, routed / 2, routed / 2],
            )[0]
        )
        if outcome in ("misrouted", "split") and len(recs) < 2:
            outcome = "hit"
        req_no += 1
        if outcome == "cold":
            cold_lookup(rec, rid, chain, fa.tpc, P)
            rows += 1
            continue
        # --- prime: a cold lookup, then the store path of vLLM 0.33.0 for boundary E
        cold_lookup(rec, rid, chain, fa.tpc, P)
        need = {
            g.gid: window_tail(g.tpc, g.sliding_window, g.eagle, E)
            for g in groups
            if g.sliding_window is not None
        }
        stored = {
            g.gid: list(range(P // g.tpc)) if g.window is None else list(need[g.gid])
            for g in groups
        }
        if outcome == "planted":
            stored[2] = stored[2][1:]  # the MTP group's leftmost needed chunk: never offered
        late: list[tuple[int, list[int]]] = []
        if outcome == "pending":
            late.append((1, stored[1]))
        job = req_no * 10
        for gid, chunks in stored.items():
            if not chunks:
                continue
            tpc = tpcs[gid]
            ks = [key(chain, (c + 1) * tpc, gid) for c in chunks]
            pos = {k: (c + 1) * tpc for k, c in zip(ks, chunks, strict=True)}
            rec.store_prepared(rid, ks, pos, ks, [], job)
            if not any(g == gid for g, _ in late):
                rec.store_completed(rid, ks, pos, job, True)
            rows += 2 * len(ks)
            job += 1
        if outcome == "evicted":
            ks = [key(chain, (c + 1) * 4, 3) for c in stored[3]]
            rec.store_prepared(f"other-{req_no}", [], {}, [], ks, None)
            rows += len(ks)
        if outcome == "misrouted":
            there = recs[(req_no + 1) % len(recs)]
            cold_lookup(there, rid2, chain, fa.tpc, P)
            rows += 1
            continue
        if outcome == "split":
            rec = recs[(req_no + 1) % len(recs)]
            sib = f"req-{req_no}-sibling"
            cold_lookup(rec, sib, chain, fa.tpc, P)
            for gid, chunks in stored.items():
                tpc = tpcs[gid]
                ks = [key(chain, (c + 1) * tpc, gid) for c in chunks]
                pos = {k: (c + 1) * tpc for k, c in zip(ks, chunks, strict=True)}
                rec.store_prepared(sib, ks, pos, ks, [], job)
                rec.store_completed(sib, ks, pos, job, by_gid[gid].window is None)
                rows += 2 * len(ks)
                job += 1
            stored = {gid: c if by_gid[gid].window is None else [] for gid, c in stored.items()}
        # --- the resend
        rec.episode_begin(rid2, 0, None, P, P, P // TPH)
        rec.begin_scan()
        external: int | None = E
        for c in range(E // fa.tpc):
            res = "RETRY" if outcome == "retry" and c == 3 else "HIT"
            rec.lookup(
                key(chain, (c + 1) * fa.tpc, 0), rid2, (c + 1) * fa.tpc, LookupResult(res), False
            )
            rows += 1
        if outcome == "retry":
            external = None
        for gid in order[1:]:
            g = by_gid[gid]
            rec.begin_scan()
            present = set(stored[gid])
            if outcome == "evicted" and gid == 3:
                present = set()
            hits_needed = len(need[gid])
            run = 0
            for c in range(need[gid][-1], -1, -1):
                if outcome == "pending" and gid == 1 and c in present:
                    res = "HIT_PENDING"
                else:
                    res = "HIT" if c in present else "MISS"
                rec.lookup(
                    key(chain, (c + 1) * g.tpc, gid),
                    rid2,
                    (c + 1) * g.tpc,
                    LookupResult(res),
                    False,
                )
                rows += 1
                run = run + 1 if res != "MISS" else 0
                if run == hits_needed:
                    break
            if run < hits_needed:
                external = 0
                # as the recorder's episode-end hook does: the groups vLLM never scanned
                # get their needed keys from the request's own per-group key lists
                rec.end_scan()
                rec.list_needed(rid2, lambda g, c, ch=chain: key(ch, (c + 1) * tpcs[g], g))
                break
            if outcome == "pending" and gid == 1:
                external = None
        rec.episode_end(rid2, external, bool(external))
        if external:
            rec.accepted(rid2, external)
        for gid, chunks in late:
            ks = [key(chain, (c + 1) * tpcs[gid], gid) for c in chunks]
            rec.store_completed(rid, ks, {}, None, True)
            rows += len(ks)
        if outcome == "planted":
            planted.append([rec.writer.engine_id or "", rid2])
        if req_no % 2000 == 0:
            print(
                f"\r{rows:,} rows, {req_no:,} requests, {time.time() - t0:.0f}s",
                end="",
                file=sys.stderr,
            )
    for r in recs:
        r.close()
    with open(args.out.rstrip("/") + ".planted.json", "w") as fh:
        json.dump(planted, fh)
    print(
        f"\nwrote ~{rows:,} key rows, {req_no:,} requests, {len(planted)} planted mismatches "
        f"in {time.time() - t0:.0f}s -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
