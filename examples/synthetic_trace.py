"""Write a small trace with keytrace's own recorder (no vLLM needed), then diff it.

    python examples/synthetic_trace.py /tmp/kt-synthetic && keytrace diff /tmp/kt-synthetic

The store side keeps only the last chunk of a sliding-window group whose lookup needs two:
keytrace names the chunk that was never offered.
"""

from __future__ import annotations

import hashlib
import sys

from keytrace.analysis.geometry import Geometry, GroupGeom, synthetic_header
from keytrace.format.schema import LookupResult
from keytrace.record.recorder import Recorder

GEO = Geometry(
    name="example",
    groups=(GroupGeom("full_attention", 16), GroupGeom("sliding_window", 16, sliding_window=32)),
)


def key(chunk: int, group: int) -> bytes:
    return hashlib.sha256(f"prompt:{chunk}".encode()).digest() + group.to_bytes(4, "big")


def main(out: str) -> None:
    rec = Recorder(
        out, synthetic_header(GEO), engine_id="example", dp_rank=0, tokens_per_chunk={0: 16, 1: 16}
    )
    pos = {key(c, g): (c + 1) * 16 for c in range(6) for g in (0, 1)}
    # request r1 (100 tokens) is stored: every full-attention chunk, and SWA chunk 5 only
    rec.episode_begin("r1", 0, None, 100, 100, 6)
    rec.episode_end("r1", 0, False)
    fa = [key(c, 0) for c in range(6)]
    rec.store_prepared("r1", [*fa, key(5, 1)], pos, [*fa, key(5, 1)], [], 0)
    rec.store_completed("r1", [*fa, key(5, 1)], pos, 0, True)
    # the identical resend: full attention hits 0..5; the window scan finds 5 but not 4
    rec.episode_begin("r2", 0, None, 100, 100, 6)
    rec.begin_scan()
    for c in range(6):
        rec.lookup(key(c, 0), "r2", (c + 1) * 16, LookupResult.HIT, False)
    rec.begin_scan()
    for c, result in ((5, "HIT"), (4, "MISS"), (3, "MISS"), (2, "MISS"), (1, "MISS"), (0, "MISS")):
        rec.lookup(key(c, 1), "r2", (c + 1) * 16, LookupResult(result), False)
    rec.episode_end("r2", 0, False)
    rec.close()
    print(f"wrote {out}; now run: keytrace diff {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/keytrace-synthetic")
