"""The OffloadKey layout, in one place: a block hash followed by the KV-cache group id as
4 big-endian bytes (vLLM's ``make_offload_key``). Everything in keytrace that takes a key
apart or builds one comes here: the recorder and the live alarm on bytes, the differ on
polars binary columns (the same functions: called with an expression they return one).

Imports no polars: it is on the recording path of every serving process.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any, NewType

OffloadKey = NewType("OffloadKey", bytes)
"""One chunk's key: a block hash followed by the 4-byte big-endian KV-cache group id (vLLM's
``OffloadKey``, ``make_offload_key``)."""

GID_BYTES = 4
"""Bytes of the group id at the end of every key."""


def _is_expr(x: Any) -> bool:
    return type(x).__module__.startswith("polars")


def gid_tail(gid: int) -> bytes:
    """The 4 bytes a key of group ``gid`` ends with."""
    return int(gid).to_bytes(GID_BYTES, "big")


def key_tail(key: bytes) -> bytes:
    """A key's group-id bytes, as they are (cheap to compare with `gid_tail`)."""
    return key[-GID_BYTES:]


_TAIL = operator.itemgetter(slice(-GID_BYTES, None))


def key_tails(keys: Iterable[bytes]) -> Iterator[bytes]:
    """`key_tail` of each of ``keys``, lazily: a C call a key (the live alarm counts a
    store call's keys per group this way), where a Python function would be a frame."""
    return map(_TAIL, keys)


def tail_gid(tail: bytes) -> int:
    """The group id that `gid_tail` encoded."""
    return int.from_bytes(tail, "big")


def key_gid(key: Any) -> Any:
    """The group id of a key (bytes), or of every key of a binary column (an expression)."""
    if _is_expr(key):
        import polars as pl

        tail = key.bin.slice(-GID_BYTES)
        return tail.bin.reinterpret(dtype=pl.UInt32, endianness="big").cast(pl.Int32)
    return tail_gid(key[-GID_BYTES:])


def key_hash(key: Any) -> Any:
    """The block hash a key was made from (bytes, or an expression over a binary column)."""
    if _is_expr(key):
        return key.bin.slice(0, key.bin.size() - GID_BYTES)
    return key[:-GID_BYTES]


def make_key(block_hash: bytes, gid: int) -> OffloadKey:
    """The key of ``block_hash`` under group ``gid`` (vLLM's ``make_offload_key``)."""
    return OffloadKey(bytes(block_hash) + gid_tail(gid))


def chunk_ending_at(end: int | None, tpc: int) -> int | None:
    """The index of the chunk (``tpc`` tokens each) that ends at token ``end``, None unless
    ``end`` is a chunk boundary. Chunk ``c`` covers tokens ``[c * tpc, (c + 1) * tpc)``, and a
    key's recorded position is the end of its chunk (vLLM's ``get_offload_key_position``)."""
    if end is None or end % tpc:
        return None
    return end // tpc - 1


SAMPLE_SCALE = 1 << 64


def chain_sampled(first_hash: bytes, fraction: float) -> bool:
    """Whether the prefix chain whose first block hash is ``first_hash`` is in a sample of
    ``fraction`` of all chains (``KEYTRACE_SAMPLE``). The hash's first 8 bytes, read as an
    unsigned big-endian integer, below ``fraction`` of 2**64. vLLM's block hashes are
    uniform (sha256 and its kin), and equal wherever two engines can share a key at all
    (the same hash function and ``PYTHONHASHSEED``, which vLLM's first hash is seeded
    from): every recorder that can meet a chain's keys samples it alike. Where the seed
    differs, so do the keys, and no key is shared to be judged. A hash shorter than 8
    bytes is padded."""
    head = bytes(first_hash[:8]).ljust(8, b"\0")
    return int.from_bytes(head, "big") < fraction * SAMPLE_SCALE
