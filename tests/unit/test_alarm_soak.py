"""The live alarm runs for months: what it keeps stays flat however many requests pass.

Requests are driven through the recorder's real interface (no trace written: the recorder
of ``KEYTRACE_ALARM=1`` alone) into the alarm: each request is looked up (cold, or a resend
of an earlier prompt that hits or falls short), stores, and finishes. After a warm-up
that fills the capped parts (key records, the chain book's offers), the memory blocks the
interpreter holds (``sys.getallocatedblocks``: every Python object, whatever allocated it,
and no tracing overhead) and every per-request table must stay flat.

``KEYTRACE_SOAK_REQUESTS`` sets how many requests (100,000 by default, about 17 s on this
machine; a million, ``KEYTRACE_SOAK_REQUESTS=1000000``, is the same loop, ten times longer).
"""

from __future__ import annotations

import gc
import os
import sys

from keytrace.analysis.geometry import synthetic_header
from keytrace.format.schema import LookupResult
from keytrace.live.alarm import Alarm
from keytrace.record.recorder import Recorder
from tests.factories import TINY, block_hash

REQUESTS = int(os.environ.get("KEYTRACE_SOAK_REQUESTS") or 100_000)
WARM_UP = 20_000
"""Requests after which the capped tables are full (4,096 key records and offers)."""
SLACK_BLOCKS = 5_000
"""How far the block count may wander after the warm-up (it moves by about 2,000 as the
capped tables refill); a leak of one block per request would add tens of thousands."""
TPC = {0: 16, 1: 16, 2: 16}


def _key(chain: int, chunk: int, gid: int) -> bytes:
    return block_hash(str(chain), chunk) + gid.to_bytes(4, "big")


def _request(rec: Recorder, i: int) -> None:
    """Request ``i``: a 64-token prompt of chain ``i // 2`` (every chain is sent twice: a
    cold prime, then a resend that looks the prime's keys up). Odd resends find the SWA
    window stored; even ones miss its chunk 2, which the prime never offered: a shortfall
    the alarm judges (a mismatch) and forgets with the request. One resend in seven is
    deferred and then aborted (what is kept for a deferral goes with the request)."""
    req, chain = f"r{i}", i // 2
    rec.episode_begin(req, 0, None, 64, 64, 4)
    rec.begin_scan()
    if i % 2 == 0:
        rec.lookup(_key(chain, 0, 0), req, 16, LookupResult.MISS, False)
        rec.episode_end(req, 0, False)
    else:
        for c in range(3):
            rec.lookup(_key(chain, c, 0), req, 16 * (c + 1), LookupResult.HIT, False)
        rec.begin_scan()
        hit = LookupResult.HIT if chain % 2 else LookupResult.MISS
        rec.lookup(_key(chain, 2, 1), req, 48, hit, False)
        rec.lookup(_key(chain, 1, 1), req, 32, LookupResult.HIT, False)
        rec.end_scan()
        rec.list_needed(req, lambda gid, c: _key(chain, c, gid))
        external: int | None = 48 if chain % 2 else 0
        if i % 14 == 1:
            external = None  # deferred; then the client gives up
        rec.episode_end(req, external, False)
        if external:
            rec.accepted(req, external)
    if i % 2 == 0:
        keys = [_key(chain, c, 0) for c in range(4)] + [_key(chain, 1, 1)]
        keys += [_key(chain, 2, 1)] if chain % 2 else []
        keys += [_key(chain, c, 2) for c in range(4)]
        pos = {
            k: 16 * (1 + c) for k in keys for c in range(4) if k[:-4] == block_hash(str(chain), c)
        }
        rec.store_prepared(req, keys, pos, keys, [], i)
        rec.store_completed(req, keys, pos, i, True)
    rec.request_finished(req)


def test_a_million_short_requests_leave_the_alarm_flat() -> None:
    header = synthetic_header(TINY)
    alarm = Alarm(header, max_bytes=4096 * 280, warn=False)
    rec = Recorder(None, header, engine_id="e", dp_rank=0, tokens_per_chunk=TPC, listener=alarm)
    rec.book.max_offers = 4096
    rec.exact_scans = True
    blocks: list[int] = []
    peak_tables = 0
    for i in range(REQUESTS):
        _request(rec, i)
        if i >= WARM_UP and i % 10_000 == 0:
            gc.collect()
            blocks.append(sys.getallocatedblocks())
            peak_tables = max(peak_tables, alarm.per_request_entries(), len(rec.book.bounds))
    verdicts = alarm.counts()
    # the traffic was judged: cold primes, resends that hit and resends that fell short
    assert verdicts["cold"] == REQUESTS // 2
    assert verdicts["hit"] > 0 and verdicts["mismatch"] > 0
    # flat: what is kept per request is what is in flight (none between requests), the
    # capped tables stay at their caps, and nothing else grows with the traffic
    assert peak_tables == 0
    assert alarm.state_records() <= alarm.max_records and rec.book.forgotten > 0
    assert len(rec.book.prompt) == 0 and alarm.per_request_entries() == 0
    assert len(blocks) >= 3
    assert max(blocks) - blocks[0] < SLACK_BLOCKS, blocks
