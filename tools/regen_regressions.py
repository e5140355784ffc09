"""Regenerate tests/regressions/ on the real vLLM scheduler: `REGRESSIONS` is their only source.

    python tools/regen_regressions.py            # rewrite the committed files
    python tools/regen_regressions.py --check    # exit 1 if any would change

Each entry is recorded (`keytrace.vllm.lab.replay.replay`: prime chain, GPU-only reset,
episode), planned from its own trace and rendered by `keytrace fixture`'s generator with the
entry's xfail reason and note. The file name carries the content hash, so a stale name is a
changed file. `tests/integration/test_regress.py` checks the committed copies regenerate
byte-identically.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "regressions"


@dataclass(frozen=True)
class Regression:
    geometry: str
    prime_lengths: tuple[int, ...]
    episode_length: int
    xfail: str | None
    note: str
    cpu_chunks: int | None = None  # the CPU tier (the primary, when tiered); None: the geometry's
    tiers: tuple[str, ...] = ()  # secondary tiers (`keytrace.vllm.lab.config.tiered`)
    blocks_per_chunk: int | None = None  # None: the geometry's


REGRESSIONS = (
    Regression(
        geometry="dsv4",
        prime_lengths=(17_975,),
        episode_length=17_975,
        xfail=(
            "vLLM 0.33.0: EAGLE/MTP store tail assumes a peek chunk the prompt cannot key "
            "(keytrace findings, docs/findings.md)"
        ),
        note="""\
Evidence (keytrace diff on stock vLLM 0.33.0): the prime's own boundary is
E = round_down(17,975 - 1, 256) = 17,920. The store keeps the MTP group's tail for that
boundary shifted one chunk right for the EAGLE peek: chunks 278, 279 and the peek 280.
Chunk 280 ends at token 17,984 > 17,975, so it is never keyed or stored. The resend's
lookup has no peek chunk to query, needs the run 277-279 and pops 279: chunk 277 was
never offered. Every length with (P mod 256) in [1, 63] misses the same way; the
sweep in docs/findings.md checks the rule over 2,000+ consecutive lengths. Upstream:
the replay-boundary class of vllm #51761 / #52287 (the EAGLE volatile-tail pop moves
the lookup boundary below the tail the store retained).""",
    ),
    Regression(
        geometry="dsv4",
        prime_lengths=(17_975,),
        episode_length=18_000,
        xfail=(
            "vLLM 0.33.0: the next turn keys the MTP peek chunk the previous turn could not "
            "(keytrace findings, docs/findings.md)"
        ),
        note="""\
Evidence (keytrace diff on stock vLLM 0.33.0): a two-turn conversation whose second turn is
a little longer than the first. The first turn (17,975 tokens) stores the MTP tail for its
boundary E = 17,920 shifted for the EAGLE peek: 278, 279, and the peek 280, which it cannot
key (280 ends at 17,984). The second turn (18,000 tokens) can key 280, so lookup queries it
as the peek, needs 278-280 and finds 280 missing: 0 external tokens. The turn then stores
280 itself, after its own lookup; that store explains nothing (keytrace diff reports
cause not_keyable; before issue 12 it called this shortfall explained).""",
    ),
    Regression(
        geometry="small",
        prime_lengths=(547,),
        episode_length=547,
        cpu_chunks=12,
        tiers=("fs",),
        xfail=(
            "vLLM 0.33.0: a tiered manager's promotions evict the request's own prefix from "
            "the CPU tier, and its lookup is deferred without end (keytrace findings, "
            "docs/findings.md)"
        ),
        note="""\
Evidence (keytrace diff on stock vLLM 0.33.0): a CPU tier of 12 chunks over a file-system
tier. The 547-token prompt needs 13 chunks at once for a hit at E = 512 (8 full-attention
chunks, 2 of the sliding-window group, 3 of the MTP group); its prime wrote them all through
to disk, and the CPU tier kept what fit. The resend's lookup finds the rest on disk and
promotes each key (TieringOffloadingManager._initiate_promotion: primary_tier.prepare_write),
which evicts the least recently used idle keys: the ones this lookup found a moment before
(prepare_store protects only the key it stores; lookups pin nothing). The lookup is deferred
(HIT_PENDING), asks again, finds the evicted keys on disk, promotes them, evicts others:
keytrace's stall rule fires after 50 deferrals in a row, and stock vLLM never serves or
recomputes the request. With --fix promotion_pins_prefix the promotions cannot evict the
request's own CPU-tier hits, prepare_write finds no room, vLLM answers its designed MISS
(explained: promotion_no_room) and the request runs.""",
    ),
    Regression(
        geometry="recurrent",
        prime_lengths=(760,),
        episode_length=760,
        blocks_per_chunk=2,
        xfail=(
            "vLLM 0.33.0: a recurrent group's last state that ends no chunk is never stored, "
            "so the resend loads nothing (keytrace findings, docs/findings.md)"
        ),
        note="""\
Evidence (keytrace diff on stock vLLM 0.33.0): three recurrent (gated DeltaNet) groups and
one full-attention group, block 64, two blocks per chunk. vLLM keeps a recurrent group's
state where the request computed it: at the prompt's last block boundary, 704 for 760
tokens, and stores it only at a multiple of the 128-token chunk
(_build_aligned_boundary_store_jobs skips any other boundary). Full attention stored every
chunk up to 640; the resend's lookup rounds its hit down to the chunk (_mamba_align_size)
and needs group 0's state at 640, which no request kept: 0 external tokens. keytrace:
mismatch, binding group 0, cause no_checkpoint. Every prompt with floor((P - 1) / 64)
odd misses this way and every other one hits (docs/findings.md: swept over 385
consecutive lengths on 0.33.0, 192 of them miss).""",
    ),
)


def _geometry(reg: Regression) -> object:
    """The entry's geometry: the built-in one, its CPU tier, its secondary tiers (an fs
    tier gets its folder from the harness)."""
    from keytrace.analysis.geometry import builtin
    from keytrace.vllm.lab.config import tiered

    geo = builtin(reg.geometry)
    if reg.cpu_chunks is not None:
        geo = geo.with_(cpu_chunks=reg.cpu_chunks)
    if reg.blocks_per_chunk is not None:
        geo = geo.with_(blocks_per_chunk=reg.blocks_per_chunk)
    if reg.tiers:
        geo = tiered(geo, reg.tiers, None)
    return geo


def render(reg: Regression) -> tuple[str, str]:
    """(file name, text) of one regression, recorded afresh on the real scheduler."""
    from keytrace.analysis.plan import plan_from_trace
    from keytrace.format.reader import open_trace
    from keytrace.report.fixture import file_name, render_fixture
    from keytrace.vllm.lab.replay import replay

    with tempfile.TemporaryDirectory(prefix="keytrace-regen-") as tmp:
        replay(_geometry(reg), list(reg.prime_lengths), reg.episode_length, trace_dir=tmp)
        plan = plan_from_trace(open_trace(tmp))
    text = render_fixture(plan, xfail_reason=reg.xfail, docstring_extra=reg.note)
    return file_name(plan, text), text


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--check", action="store_true", help="Change nothing; exit 1 on a difference.")
    args = ap.parse_args()
    from keytrace.cli._common import quiet_host_logs

    quiet_host_logs()
    wanted = dict(render(r) for r in REGRESSIONS)
    present = {p.name for p in OUT.glob("test_keytrace_*.py")}
    stale = sorted(present - set(wanted))
    changed = sorted(
        n for n, t in wanted.items() if not (OUT / n).exists() or (OUT / n).read_text() != t
    )
    if args.check:
        for n in stale + changed:
            print(f"would change: {n}")
        return 1 if stale or changed else 0
    for n in stale:
        (OUT / n).unlink()
    for n, t in wanted.items():
        (OUT / n).write_text(t)
    print(f"{len(wanted)} regression(s) written, {len(stale)} stale removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
