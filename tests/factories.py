"""Build small traces in code (no vLLM): the recorder API with a synthetic header.

Keys are content-addressed like vLLM's: the hash of hash-block j of chain ``chain`` is
``sha256(f"{chain}:{j}")``, and a chunk's key is the hash of its last hash-block plus the
4-byte group id, so equal prefixes give equal keys across requests.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from keytrace.analysis.geometry import Geometry, GroupGeom, synthetic_header
from keytrace.format.schema import LookupResult
from keytrace.judge.rules import lookahead_of
from keytrace.record.recorder import Recorder

# One FA group, one plain SWA group (window 32 = 2 chunks), one EAGLE SWA group: tpc 16.
TINY = Geometry(
    name="tiny",
    groups=(
        GroupGeom("full_attention", 16, name="fa"),
        GroupGeom("sliding_window", 16, sliding_window=32, name="swa"),
        GroupGeom("sliding_window", 16, sliding_window=32, eagle=True, name="mtp"),
    ),
    max_num_batched_tokens=256,
    max_model_len=4096,
)


def block_hash(chain: str, j: int) -> bytes:
    return hashlib.sha256(f"{chain}:{j}".encode()).digest()


class TraceBuilder:
    """One recorder instance writing into ``directory``; call `close` to flush."""

    def __init__(
        self,
        directory: Path | str,
        geometry: Geometry = TINY,
        *,
        engine_id: str = "engine-a",
        dp_rank: int = 0,
        header: dict[str, Any] | None = None,
        alarm: Any = None,
    ) -> None:
        self.geometry = geometry
        self.header = header or synthetic_header(geometry)
        self.rec = Recorder(
            str(directory),
            self.header,
            engine_id=engine_id,
            dp_rank=dp_rank,
            tokens_per_chunk={
                gid: g.block_size * geometry.blocks_per_chunk
                for gid, g in enumerate(geometry.groups)
            },
            max_seconds=3600,
            idle_seconds=3600,  # parts split only where a test says so
            listener=alarm,
        )
        self.tph = geometry.tokens_per_hash
        self.lookahead = lookahead_of(self.header)
        """Tokens past a block its hash covers (vLLM 0.34.0's lookahead hashes): a request
        of P tokens has (P - lookahead) // tph block hashes."""

    def tpc(self, gid: int) -> int:
        return self.geometry.groups[gid].block_size * self.geometry.blocks_per_chunk

    def key(self, chain: str, gid: int, chunk: int) -> bytes:
        end = (chunk + 1) * self.tpc(gid)
        return block_hash(chain, end // self.tph - 1) + gid.to_bytes(4, "big")

    def positions(self, chain: str, gid: int, chunks: list[int]) -> dict[bytes, int]:
        return {self.key(chain, gid, c): (c + 1) * self.tpc(gid) for c in chunks}

    # -------------------------------------------------------------- store side
    def store(
        self,
        req: str,
        chain: str,
        gid: int,
        chunks: list[int],
        *,
        complete: bool = True,
        rejected: list[int] = (),  # type: ignore[assignment]
        job: int = 0,
    ) -> None:
        offered = [self.key(chain, gid, c) for c in list(chunks) + list(rejected)]
        pos = self.positions(chain, gid, list(chunks) + list(rejected))
        chosen = {self.key(chain, gid, c) for c in chunks}
        self.rec.store_prepared(req, offered, pos, chosen, [], job)
        if complete:
            self.complete(req, chain, gid, chunks, job=job)

    def complete(self, req: str, chain: str, gid: int, chunks: list[int], *, job: int = 0) -> None:
        keys = [self.key(chain, gid, c) for c in chunks]
        self.rec.store_completed(req, keys, self.positions(chain, gid, chunks), job, True)

    def evict(self, req: str, chain: str, gid: int, chunks: list[int]) -> None:
        keys = [self.key(chain, gid, c) for c in chunks]
        self.rec.store_prepared(req, [], self.positions(chain, gid, chunks), [], keys, None)

    def prime(
        self,
        req: str,
        chain: str,
        num_tokens: int,
        *,
        swa_chunks: dict[int, list[int]] | None = None,
    ) -> None:
        """A cold episode, then FA stores for every keyed chunk and the given SWA chunks."""
        self.episode(req, num_tokens, external=0, scans=[(0, [(0, "MISS")])], chain=chain)
        for gid, g in enumerate(self.geometry.groups):
            if g.sliding_window is None:
                self.store(req, chain, gid, list(range(num_tokens // self.tpc(gid))))
            elif swa_chunks and gid in swa_chunks:
                self.store(req, chain, gid, swa_chunks[gid])

    # ------------------------------------------------------------- lookup side
    def episode(
        self,
        req: str,
        num_tokens: int,
        *,
        external: int | None,
        scans: list[tuple[int, list[tuple[int, str]]]],
        chain: str,
        local: int = 0,
        accepted: int | None = None,
        listed: bool = True,
    ) -> None:
        """One lookup episode: scans are (group id, [(chunk, result), ...]) in call order.
        The keys a hit needs that the scans did not ask for are listed as the real hook
        lists them (`keytrace.record.recorder.Recorder.list_needed`), from ``chain``;
        ``listed=False`` records none (a schema-1 trace, a chain book that forgot)."""
        hashes = max(0, num_tokens - self.lookahead) // self.tph
        self.rec.episode_begin(req, local, None, num_tokens, num_tokens, hashes)
        for gid, calls in scans:
            self.rec.begin_scan()
            for chunk, result in calls:
                self.rec.lookup(
                    self.key(chain, gid, chunk),
                    req,
                    (chunk + 1) * self.tpc(gid),
                    LookupResult(result),
                    False,
                )
        self.rec.end_scan()
        if listed:
            self.rec.list_needed(req, lambda gid, c: self.key(chain, gid, c))
        self.rec.episode_end(req, external, bool(external))
        if external:
            self.rec.accepted(req, accepted if accepted is not None else external)

    def close(self) -> None:
        self.rec.close()


def new_builder(directory: Path | str, **kw: Any) -> TraceBuilder:
    b = TraceBuilder(directory, **kw)
    b.rec.exact_scans = True
    return b
