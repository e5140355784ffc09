"""Tier scope and hash identity (``docs/diff.md``, "Engines, tiers and hash identity"),
each written once.

- **Scope** (`scope_of`, `shares_tier`): a CPU tier (the primary of every manager) is
  private to its engine, one region per engine and data-parallel rank (vllm#47987); an
  ``fs``, ``obj``, ``p2p`` or ``kvcr`` tier is shared by every engine that names the same
  place (the fs root, the object URI, the p2p group). "Stored on dp0, missed on dp1" is by
  design on a private tier and a loss on a shared one.
- **Hash identity** (`HASH_FIELDS`, `identity_findings`): engines can read each other's
  keys only if they compute the same block hashes: the same hash function, the same
  ``NONE_HASH`` (seed), the same lookahead and block size. The header records each
  engine's (`keytrace.vllm.hook.header.hash_identity`: the seed's source and a digest,
  never the seed); engines that share a tier and hash differently are one finding, and
  their keys are never judged against each other (`identity_classes`).
- **Doctor** (`seed_warnings`): a shared tier under a random per-process seed.

Plain values only (header dicts): the differ, the live alarm, doctor and the reporters call
the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from keytrace.judge.ops import Num, Truth, lt


class Scope(StrEnum):
    """Who can read a tier's keys."""

    PRIVATE = "private"
    """One engine (one DP rank): a CPU tier, the primary of every manager."""
    SHARED = "shared"
    """Every engine that names the same place (fs root, object URI, p2p group)."""


class Finding(StrEnum):
    """Findings about engines rather than one episode (exit 1)."""

    HASH_IDENTITY = "hash_identity"
    """Engines that share a tier hash differently: none reads what another stored."""


PRIVATE_TIERS = frozenset({"cpu", "example"})
"""Tier types whose keys only their own engine reads: the CPU tier, and vLLM's in-memory
``example`` tier (a dictionary in its manager)."""

SEED_SOURCES = ("PYTHONHASHSEED", "default", "random")
"""Where an engine's ``NONE_HASH`` seed came from (vLLM's ``resolve_none_hash_seed``):
``PYTHONHASHSEED`` wins; else a fixed default for sha256/sha256_cbor and a random seed per
process for xxhash/xxhash_cbor."""

HASH_FIELDS: tuple[tuple[str, str], ...] = (
    ("hash_algo", "use one --prefix-caching-hash-algo on every engine that shares the tier"),
    (
        "none_hash",
        "set PYTHONHASHSEED to one value on every engine that shares the tier "
        "(xxhash draws a random seed per process without it), or use sha256",
    ),
    (
        "lookahead_tokens",
        "use one lookahead setting on every engine that shares the tier "
        "(the same drafter, or disable_lookahead_block_hashes everywhere)",
    ),
    ("tokens_per_hash", "use one block size (hash block size) on every engine"),
    (
        "canary",
        "the engines hash one token block differently: compare vLLM versions, "
        "hash function, seed and lookahead",
    ),
)
"""The hash identity's fields in the order they are compared, each with its fix. The first
that differs names a finding (``canary`` catches what the others did not record)."""


RANDOM_SEED_ALGOS = frozenset({"xxhash", "xxhash_cbor"})
"""Hash functions vLLM seeds at random per process when PYTHONHASHSEED is unset."""


def seed_source(hash_algo: str | None, pythonhashseed_set: bool) -> str:
    """Where vLLM's ``NONE_HASH`` seed comes from (`SEED_SOURCES`), as vLLM resolves it:
    PYTHONHASHSEED wins; else random for xxhash/xxhash_cbor, a fixed default otherwise."""
    if pythonhashseed_set:
        return "PYTHONHASHSEED"
    return "random" if (hash_algo or "sha256") in RANDOM_SEED_ALGOS else "default"


def config_header(
    hash_algo: str, secondary_tiers: Sequence[Mapping[str, Any]], pythonhashseed_set: bool
) -> dict[str, Any]:
    """The part of a header `seed_warnings` reads, from a configuration not yet run (what
    ``keytrace doctor --hash-algo/--kv-transfer-config`` is given): the hash function,
    the seed's source, and each secondary tier (``type``; its place as configured)."""
    return {
        "hash_identity": {
            "hash_algo": hash_algo,
            "seed_source": seed_source(hash_algo, pythonhashseed_set),
        },
        "tier_scope": {
            "secondary": [
                {
                    "index": i,
                    "type": str(t.get("type")),
                    "identity": f"{t.get('type')}:{t.get('root_dir') or t.get('prefix') or i}",
                }
                for i, t in enumerate(secondary_tiers)
            ]
        },
    }


def scope_of(tier_type: str | None) -> Scope:
    """The scope of a tier of this type (``secondary_tiers[*].type``; ``"cpu"``: the
    primary)."""
    return Scope.PRIVATE if (tier_type or "cpu") in PRIVATE_TIERS else Scope.SHARED


def shared_places(header: Mapping[str, Any]) -> dict[str, int]:
    """The shared tiers an engine's header names: their identity (``tier_scope``) -> the
    tier's index. Empty for an old header (no ``tier_scope``) or a CPU-only engine."""
    scope = header.get("tier_scope") or {}
    out: dict[str, int] = {}
    for tier in scope.get("secondary") or []:
        place = tier.get("identity")
        if place and scope_of(tier.get("type")) is Scope.SHARED:
            out[str(place)] = int(tier.get("index", 0))
    return out


def shares_tier(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two engines (their headers) read and write one shared tier: the scope rule.
    Two engines never share a private tier."""
    return bool(set(shared_places(a)) & set(shared_places(b)))


def on_shared_tier(written_at: Num, at: Num) -> Truth:
    """Whether a key another engine wrote through to a tier shared with this one (scope:
    `shares_tier`) was there for a lookup at wall clock ``at``: its write-through
    completed before. Such a key counts toward this engine's intended boundaries (E) as if
    its own request had stored it: the tier is one for both. Values or polars columns."""
    return lt(written_at, at)


def hash_identity_of(header: Mapping[str, Any]) -> dict[str, Any]:
    """An engine's hash identity from its header, with defaults for old headers: the
    top-level ``hash_algo``, ``num_hash_lookahead_tokens`` and ``tokens_per_hash`` when
    ``hash_identity`` is absent (digest and canary unknown: None)."""
    ident = dict(header.get("hash_identity") or {})
    ident.setdefault("hash_algo", header.get("hash_algo"))
    ident.setdefault("lookahead_tokens", int(header.get("num_hash_lookahead_tokens") or 0))
    ident.setdefault("tokens_per_hash", header.get("tokens_per_hash"))
    ident.setdefault("none_hash", None)
    ident.setdefault("canary", None)
    ident.setdefault("seed_source", None)
    return ident


def differing_field(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first of `HASH_FIELDS` on which two hash identities (`hash_identity_of`) differ,
    None when they agree. A field unknown on either side (an old header, a digest vLLM had
    not made yet) is not compared."""
    for name, _fix in HASH_FIELDS:
        x, y = a.get(name), b.get(name)
        if x is not None and y is not None and x != y:
            return name
    return None


def fix_for(field_name: str) -> str:
    """The fix `HASH_FIELDS` gives for a differing field."""
    return dict(HASH_FIELDS)[field_name]


@dataclass(frozen=True)
class IdentityFinding:
    """Engines that share a tier and hash differently (`Finding.HASH_IDENTITY`)."""

    engines: tuple[str, ...]
    """The engines (their names, sorted), every class of the split."""
    tier: str
    """The shared tier's identity (``tier_scope``) they meet on."""
    field: str
    """The first hash field that differs (`HASH_FIELDS`)."""
    values: tuple[str, ...]
    """Per engine, what it recorded for ``field`` (the seed's source, never the seed)."""
    fix: str
    finding: Finding = Finding.HASH_IDENTITY

    @property
    def text(self) -> str:
        who = ", ".join(f"{e} ({v})" for e, v in zip(self.engines, self.values, strict=True))
        return (
            f"{self.finding}: engines sharing {self.tier} hash differently ({self.field}): "
            f"{who}; none reads what another stored. Fix: {self.fix}"
        )


def _shown(ident: Mapping[str, Any], name: str) -> str:
    """What a finding shows of a field: the seed's source beside the digest (never the seed)."""
    value = ident.get(name)
    if name == "none_hash":
        return f"seed {ident.get('seed_source') or 'unknown'}, NONE_HASH digest {value}"
    return str(value)


def identity_classes(headers: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The engines (name -> header) in classes whose keys are judged together: engines
    whose hash identities agree (`differing_field`) share a class. Keys of engines that
    hash differently can never match, so no routing or shared-tier account joins them; one
    class (the whole trace) when every engine hashes alike. Classes and members sorted."""
    names = sorted(headers)
    idents = {n: hash_identity_of(headers[n]) for n in names}
    classes: list[list[str]] = []
    for n in names:
        for cls in classes:
            if all(differing_field(idents[n], idents[m]) is None for m in cls):
                cls.append(n)
                break
        else:
            classes.append([n])
    return classes


def identity_findings(headers: Mapping[str, Mapping[str, Any]]) -> list[IdentityFinding]:
    """One finding per shared tier whose engines hash differently: the engines, the first
    differing field (`HASH_FIELDS`), what each recorded, the fix. Engines that share no
    tier never make a finding, however they hash."""
    names = sorted(headers)
    idents = {n: hash_identity_of(headers[n]) for n in names}
    places: dict[str, list[str]] = {}
    for n in names:
        for place in shared_places(headers[n]):
            places.setdefault(place, []).append(n)
    out: list[IdentityFinding] = []
    for place, members in sorted(places.items()):
        fields = {
            f
            for i, a in enumerate(members)
            for b in members[i + 1 :]
            if (f := differing_field(idents[a], idents[b])) is not None
        }
        if not fields:
            continue
        first = next(name for name, _ in HASH_FIELDS if name in fields)
        out.append(
            IdentityFinding(
                engines=tuple(members),
                tier=place,
                field=first,
                values=tuple(_shown(idents[m], first) for m in members),
                fix=fix_for(first),
            )
        )
    return out


def seed_warnings(header: Mapping[str, Any]) -> list[str]:
    """What doctor warns about one engine's configuration: a shared tier under a random
    per-process ``NONE_HASH`` seed (xxhash without PYTHONHASHSEED) is read by no other
    engine, nor by this one after a restart."""
    ident = hash_identity_of(header)
    if ident.get("seed_source") != "random":
        return []
    return [
        f"shared tier {place} with a random NONE_HASH seed ({ident.get('hash_algo')} without "
        "PYTHONHASHSEED): no other engine, and no restart of this one, reads what it "
        "stores; set PYTHONHASHSEED to one value on every engine, or use sha256"
        for place in sorted(shared_places(header))
    ]


def disagreeing(
    mine: Mapping[str, Any], others: Sequence[Mapping[str, Any]]
) -> IdentityFinding | None:
    """The live alarm's start-up check: this engine's header against the headers of the
    engines already known to it (the same process, or a trace it was given). The first
    finding that involves this engine, else None."""
    headers = {"this engine": mine, **{f"engine {i}": h for i, h in enumerate(others)}}
    for f in identity_findings(headers):
        if "this engine" in f.engines:
            return f
    return None
