"""KV-cache geometry as plain data: what the harness builds and what a trace header records.

This module is vLLM-free so that fixtures, sweeps and the CLI can name and print geometries
without importing vLLM. ``keytrace.vllm.lab.harness`` turns a `Geometry` into real vLLM objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from keytrace.judge.rules import RECURRENT_KINDS, group_label, window_chunks

GROUP_KINDS = ("full_attention", "mla", "sliding_window", "mamba")
"""``mamba``: a recurrent state group (Mamba, gated DeltaNet, linear attention) in vLLM's
``align`` cache mode: one state per checkpoint, looked up with a window of one chunk
(judged where `keytrace.judge.trust.uncovered` names nothing)."""

DRAFTER_METHODS = ("eagle", "eagle3", "mtp")
"""The speculative methods whose drafter decides vLLM's hash lookahead (0.34.0: those with
the EAGLE block drop); the lab builds each as a real ``SpeculativeConfig``."""


@dataclass(frozen=True)
class GroupGeom:
    """One KV-cache group. ``block_size`` and ``sliding_window`` are in tokens.

    ``eagle`` marks an EAGLE/MTP draft group (vLLM's ``KVCacheGroupSpec.is_eagle_group``);
    ``extra_retained_tokens`` mimics multi-module MTP (``SlidingWindowSpec``'s field).
    ``prefill_checkpoint_alignment`` (a recurrent group only): the backend exports the
    prompt's last state from inside a prefill chunk, at a multiple of this many tokens
    past the chunk's start (``MambaSpec.num_prefill_checkpoint_blocks = 1`` and its
    ``prefill_checkpoint_alignment``: vLLM's Mamba2 layers ask for 1); None: no prefill
    checkpoints (the scheduler splits the prefill at the last block boundary).
    """

    kind: str
    block_size: int
    sliding_window: int | None = None
    eagle: bool = False
    extra_retained_tokens: int = 0
    name: str = ""
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {self.kind!r}; expected one of {GROUP_KINDS}")
        if (self.kind == "sliding_window") != (self.sliding_window is not None):
            raise ValueError("sliding_window is required for, and only for, sliding_window groups")
        if self.recurrent and (self.eagle or self.extra_retained_tokens):
            raise ValueError("a recurrent group is no EAGLE/MTP draft group (drafters have none)")
        if self.prefill_checkpoint_alignment is not None and (
            not self.recurrent or self.prefill_checkpoint_alignment < 1
        ):
            raise ValueError(
                "prefill_checkpoint_alignment is a positive token count, for recurrent groups only"
            )

    @property
    def recurrent(self) -> bool:
        """A recurrent state group (`keytrace.judge.rules.RECURRENT_KINDS`)."""
        return self.kind in RECURRENT_KINDS

    @property
    def has_window(self) -> bool:
        """Looked up with a window (after the full-attention groups): sliding-window and
        recurrent groups (vLLM gives a recurrent group a window of one chunk)."""
        return self.sliding_window is not None or self.recurrent

    @property
    def label(self) -> str:
        base = group_label(self.kind, self.eagle)
        return f"{self.name} ({base})" if self.name else base


def block_gcd(groups: Sequence[GroupGeom]) -> int:
    """vLLM's default hash unit: the GCD of the groups' block sizes."""
    return math.gcd(*(g.block_size for g in groups))


@dataclass(frozen=True)
class Drafter:
    """The speculative drafter a deployment runs, as vLLM's ``SpeculativeConfig`` names it:
    ``method`` (one of `DRAFTER_METHODS`), ``num_speculative_tokens`` (k) and, for MTP,
    ``mtp_modules``: how many MTP modules the checkpoint has (its ``n_predict``, a
    DeepSeek-V3 checkpoint's ``num_nextn_predict_layers``).

    vLLM, not keytrace, decides what it implies: from 0.34.0, with an OffloadingConnector,
    every block hash covers the next L tokens (``VllmConfig.num_hash_lookahead_tokens``:
    1 for EAGLE and single-module MTP, k for multi-module MTP; 0 on 0.33.0 and before).
    The lab builds the real config and records vLLM's L in the trace header. The EAGLE/MTP
    group flag (`GroupGeom.eagle`) stays the geometry's own."""

    method: str
    num_speculative_tokens: int = 1
    mtp_modules: int = 1

    def __post_init__(self) -> None:
        if self.method not in DRAFTER_METHODS:
            raise ValueError(
                f"unknown drafter {self.method!r}; expected one of {', '.join(DRAFTER_METHODS)}"
            )
        if self.num_speculative_tokens < 1 or self.mtp_modules < 1:
            raise ValueError("a drafter proposes at least one token with at least one module")
        if self.method != "mtp" and self.mtp_modules != 1:
            raise ValueError(f"{self.method} has no MTP modules")

    @property
    def spec(self) -> str:
        """``METHOD:K`` (MTP: ``mtp:K:MODULES``), what `parse_drafter` reads."""
        text = f"{self.method}:{self.num_speculative_tokens}"
        return f"{text}:{self.mtp_modules}" if self.method == "mtp" else text


def parse_retention(text: str) -> int | None:
    """vLLM's ``prefix_cache_retention_interval`` from ``N`` (tokens; 0 is vLLM's default:
    tails only at each request's own boundary and junctions) or ``dense`` (None: every
    block of every window kept)."""
    word = text.strip().lower().replace("_", "")
    if word in ("dense", "none"):
        return None
    if not word.isdigit():
        raise ValueError(f"bad retention interval {text!r}: use a token count N or 'dense'")
    return int(word)


def retention_text(retention: int | None) -> str:
    """A retention interval as `parse_retention` reads it back: ``dense`` for None."""
    return "dense" if retention is None else str(retention)


def parse_drafter(text: str) -> Drafter | None:
    """A drafter from ``METHOD[:K[:MODULES]]`` (``eagle``, ``eagle3:2``, ``mtp:2:3``: k 2
    with 3 MTP modules); ``none`` for no drafter."""
    method, *numbers = text.strip().lower().split(":")
    if method == "none" and not numbers:
        return None
    if len(numbers) > 2 or not all(n.isdigit() for n in numbers):
        raise ValueError(f"bad drafter {text!r}: use METHOD[:K[:MODULES]], e.g. mtp:2:3")
    values = [int(n) for n in numbers]
    return Drafter(method, *values)


@dataclass(frozen=True)
class Geometry:
    """Everything the harness needs to rebuild a scheduler-side offloading setup."""

    name: str
    groups: tuple[GroupGeom, ...]
    blocks_per_chunk: int = 1
    retention_interval: int | None = 0
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False
    cpu_chunks: int = 100_000
    max_model_len: int = 131_072
    num_gpu_blocks: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    drafter: Drafter | None = None
    """The speculative drafter (None: no speculative decoding)."""
    prefix_match_unit: int | None = None
    """vLLM's ``--prefix-match-unit``: block hashes every this many tokens instead of the
    block sizes' GCD. Smaller than a recurrent group's block, it turns vLLM's partial
    tails on (hits and stores at hash boundaries inside a block)."""
    dcp: int = 1
    """vLLM's ``--decode-context-parallel-size`` (the lab builds it over as many tensor
    parallel ranks, which vLLM requires). Each rank holds 1/dcp of an attention block's
    tokens, so an attention group's block spans ``block_size * dcp`` tokens for the
    scheduler, the GPU prefix cache and the connector (vLLM's
    ``resolve_dcp_kv_block_size``); a recurrent group's state is not sharded
    (``MambaSpec.dcp_sharded`` is False) and keeps its ``block_size``. ``block_size`` is
    always the KV-cache spec's (one rank's)."""

    def __post_init__(self) -> None:
        if self.dcp < 1:
            raise ValueError(f"decode context parallel size {self.dcp}: at least 1")

    def tokens_per_block(self, group_id: int) -> int:
        """Tokens one block of ``group_id`` spans: its ``block_size``, times `dcp` for an
        attention group (vLLM's ``resolve_dcp_kv_block_size``)."""
        g = self.groups[group_id]
        return g.block_size if g.recurrent else g.block_size * self.dcp

    @property
    def tokens_per_hash(self) -> int:
        """vLLM's hash granularity for several groups: ``prefix_match_unit`` when set,
        else the GCD of the blocks' token spans (`tokens_per_block`)."""
        spans = (self.tokens_per_block(i) for i in range(len(self.groups)))
        return self.prefix_match_unit or math.gcd(*spans)

    def tokens_per_chunk(self, group_id: int) -> int:
        return self.tokens_per_block(group_id) * self.blocks_per_chunk

    @property
    def alignment_unit(self) -> int:
        """The full-attention chunk (vLLM's ``alignment_tokens``) where the full-attention
        groups agree on one, else the first group's chunk: the unit workloads draw
        lengths in."""
        fa = {self.tokens_per_chunk(i) for i, g in enumerate(self.groups) if not g.has_window}
        return fa.pop() if len(fa) == 1 else self.tokens_per_chunk(0)

    def with_(self, **changes: Any) -> Geometry:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return replace(self, **changes)

    def untiered(self) -> Geometry:
        """The same geometry on a plain CPU tier (no tiered spec, no secondary tier)."""
        extra = {k: v for k, v in self.extra.items() if k not in TIER_SETTINGS}
        return replace(self, extra=extra)

    @property
    def is_tiered(self) -> bool:
        """Built on vLLM's tiered manager (secondary tiers under the CPU tier)."""
        return bool(self.extra.get("secondary_tiers"))

    def to_dict(self) -> dict[str, Any]:
        """Plain data; no ``drafter`` key without a drafter (plans and generated tests
        written before drafters existed read, and write, exactly as before), no
        ``prefill_checkpoint_alignment`` in a group without prefill checkpoints."""
        d = asdict(self)
        d["groups"] = [_group_dict(g) for g in self.groups]
        if self.drafter is None:
            del d["drafter"]
        if self.prefix_match_unit is None:  # plans written before it read as before
            del d["prefix_match_unit"]
        if self.dcp == 1:  # likewise
            del d["dcp"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Geometry:
        d = dict(d)
        d["groups"] = tuple(GroupGeom(**g) for g in d["groups"])
        if d.get("drafter") is not None:
            d["drafter"] = Drafter(**d["drafter"])
        return cls(**d)


def _group_dict(g: GroupGeom) -> dict[str, Any]:
    d = asdict(g)
    if g.prefill_checkpoint_alignment is None:  # plans written before it read as before
        del d["prefill_checkpoint_alignment"]
    return d


SMALL = Geometry(
    name="small",
    groups=(
        GroupGeom("full_attention", 64, name="fa"),
        GroupGeom("sliding_window", 16, sliding_window=32, name="swa"),
        GroupGeom("sliding_window", 16, sliding_window=32, eagle=True, name="swa_mtp"),
    ),
    max_num_batched_tokens=512,
    max_model_len=16_384,
    cpu_chunks=20_000,
)
"""One full-attention group (block 64, so an alignment segment spans four 16-token
sliding-window chunks), one sliding-window group and one EAGLE/MTP sliding-window group."""

DSV4 = Geometry(
    name="dsv4",
    groups=(
        GroupGeom("mla", 256, name="mla"),
        GroupGeom("sliding_window", 64, sliding_window=128, name="swa"),
        GroupGeom("sliding_window", 64, sliding_window=128, eagle=True, name="swa_mtp"),
        GroupGeom("sliding_window", 4, sliding_window=8, name="c4"),
        GroupGeom("sliding_window", 8, sliding_window=128, name="c128"),
    ),
    max_num_batched_tokens=8192,
    max_model_len=131_072,
    cpu_chunks=400_000,
)
"""DeepSeek-V4-Flash-like 5 groups (the geometry table of
ModelEngine-Group/unified-cache-management PR #1322): MLA block 256;
two SWA groups block 64 window 128, the second the MTP draft group; C4 block 4 window 8;
C128 block 8 window 128."""

HYBRID = Geometry(
    name="hybrid",
    groups=SMALL.groups[:2],
    max_num_batched_tokens=512,
    max_model_len=16_384,
    cpu_chunks=20_000,
)
"""`SMALL` without its EAGLE/MTP group: full attention and one sliding-window group, where
stock vLLM 0.33.0's store and lookup rules agree (no live bug): the geometry on which
stock traffic must raise no mismatch and no alarm."""

RECURRENT = Geometry(
    name="recurrent",
    groups=(
        GroupGeom("mamba", 64, name="gdn0"),
        GroupGeom("mamba", 64, name="gdn1"),
        GroupGeom("mamba", 64, name="gdn2"),
        GroupGeom("full_attention", 64, name="fa"),
    ),
    max_num_batched_tokens=512,
    max_model_len=16_384,
    cpu_chunks=20_000,
)
"""Qwen3-Next-like: three gated-DeltaNet (recurrent) groups and one full-attention group
(full attention every fourth layer), block 64, in vLLM's ``align`` cache mode."""

RECURRENT_MTP = RECURRENT.with_(
    name="recurrent_mtp",
    groups=(*RECURRENT.groups, GroupGeom("full_attention", 64, eagle=True, name="mtp")),
    drafter=Drafter("mtp", 1, 1),
)
"""`RECURRENT` with Qwen3-Next's MTP drafter (one module, one speculative token) and its
draft layer's full-attention group. vLLM 0.34.0 then hashes each block over the next
token (L = 1) and keytrace judges it; on 0.33.0 (no lookahead hashes, the EAGLE block drop)
it is recorded and not judged."""

NEMOTRON_H = Geometry(
    name="nemotron_h",
    groups=(
        *(
            GroupGeom("mamba", 64, name=f"mamba{i}", prefill_checkpoint_alignment=1)
            for i in range(4)
        ),
        GroupGeom("full_attention", 64, name="fa"),
    ),
    max_num_batched_tokens=512,
    max_model_len=16_384,
    cpu_chunks=20_000,
)
"""Nemotron-H-like: four Mamba2 (recurrent) groups and one full-attention group (a few
attention layers among many Mamba2 ones), block 64, in vLLM's ``align`` cache mode, with
the prefill checkpoints vLLM's Mamba2 layers ask for (``mamba_mixer2.py``: one checkpoint
block, alignment 1): the prompt's last state is exported from inside the final prefill
chunk instead of the scheduler splitting the chunk at the last block boundary."""

DSV3 = Geometry(
    name="dsv3",
    groups=(GroupGeom("mla", 64, name="mla"), GroupGeom("mla", 64, eagle=True, name="mtp")),
    max_num_batched_tokens=512,
    max_model_len=16_384,
    cpu_chunks=20_000,
)
"""DeepSeek-V3/Kimi-like, attention only: an MLA group and its MTP draft layer's MLA group
(EAGLE/MTP), block 64. The models decode context parallelism serves (``dcp``: an MLA
block then spans 64 × dcp tokens); vLLM refuses DCP with sliding-window groups, which
every other attention preset has."""

DSV3_MLA = DSV3.with_(name="dsv3_mla", groups=DSV3.groups[:1])
"""`DSV3` served without its MTP drafter: one MLA group, the most common layout decode
context parallelism serves. With no draft group, a resend over a tiered manager leaves
shortfalls the oracle can check under DCP (`DSV3`'s MTP group with legacy hashes is not
judged there: `keytrace.judge.trust.uncovered`)."""

BUILTIN: dict[str, Geometry] = {
    g.name: g for g in (SMALL, DSV4, HYBRID, RECURRENT, RECURRENT_MTP, NEMOTRON_H, DSV3, DSV3_MLA)
}


def describe(geo: Geometry) -> str:
    """One line: ``N groups [g0 kind block wWINDOW MTP +EXTRA, ...], blocks_per_chunk B,
    budget T`` (fuzz and minimize print cases this way)."""
    parts = []
    for i, g in enumerate(geo.groups):
        text = f"g{i} {g.kind} {g.block_size}"
        if g.sliding_window:
            text += f" w{g.sliding_window}"
        if g.eagle:
            text += " MTP"
        if g.extra_retained_tokens:
            text += f" +{g.extra_retained_tokens}"
        parts.append(text)
    drafter = f", drafter {geo.drafter.spec}" if geo.drafter is not None else ""
    dcp = f", dcp {geo.dcp}" if geo.dcp > 1 else ""
    retention = (
        f", retention {retention_text(geo.retention_interval)}"
        if geo.retention_interval != 0
        else ""
    )
    return (
        f"{len(geo.groups)} groups [{', '.join(parts)}], blocks_per_chunk "
        f"{geo.blocks_per_chunk}, budget {geo.max_num_batched_tokens:,}{drafter}{dcp}"
        f"{retention}"
    )


def dcp_refusal(geo: Geometry) -> str | None:
    """Why vLLM refuses ``geo``'s decode context parallelism, or None: vLLM 0.33.0 and
    0.34.0 accept DCP > 1 only with full-attention (MLA included) and recurrent groups
    (``HybridKVCacheCoordinator.__init__``: "DCP with hybrid KV cache layouts only supports
    full-attention, Mamba, and replicated draft groups"; ``SlidingWindowManager``: "DCP not
    support sliding window attn now"). vLLM raises the same itself; this says it before
    vLLM is imported, in a command's words."""
    windowed = [g.label for g in geo.groups if g.sliding_window is not None]
    if geo.dcp > 1 and windowed:
        return (
            f"vLLM refuses decode context parallelism (dcp {geo.dcp}) with sliding-window "
            f"groups; {geo.name} has {', '.join(windowed)}"
        )
    return None


def builtin(name: str) -> Geometry:
    try:
        return BUILTIN[name]
    except KeyError:
        raise ValueError(f"unknown geometry {name!r}; built-in: {', '.join(BUILTIN)}") from None


def synthetic_header(
    geometry: Geometry, *, vllm_version: str = "0.33.0", num_hash_lookahead_tokens: int = 0
) -> dict[str, Any]:
    """The header keytrace's hooks would record for ``geometry`` on the harness.

    Used for hand-built traces (tests, examples) and checked against the real recorder's
    header in the integration tests, so the two cannot drift apart silently. The hash
    lookahead is vLLM's to resolve (from the drafter, the connector and the release), so
    the caller says what it is.
    """
    bpc = geometry.blocks_per_chunk
    tph = geometry.tokens_per_hash
    groups = []
    for gid, g in enumerate(geometry.groups):
        tpb = geometry.tokens_per_block(gid)
        tpc = tpb * bpc
        groups.append(
            {
                "group_id": gid,
                "offload_index": gid,
                "offloaded": True,
                "kind": g.kind,
                "spec_class": {
                    "mla": "MLAAttentionSpec",
                    "full_attention": "FullAttentionSpec",
                    "mamba": "MambaSpec",
                }.get(g.kind, "SlidingWindowSpec"),
                "block_size": g.block_size,
                "tokens_per_block": tpb,
                "tokens_per_chunk": tpc,
                "hashes_per_chunk": tpc // tph,
                "sliding_window": g.sliding_window,
                "window_chunks": 1
                if g.recurrent
                else window_chunks(g.sliding_window, g.extra_retained_tokens, tpc),
                "extra_retained_tokens": g.extra_retained_tokens,
                "is_eagle": g.eagle,
                "requires_cow_source": g.recurrent,
                "manager_cls": "MambaManager"
                if g.recurrent
                else "SlidingWindowManager"
                if g.sliding_window
                else "FullAttentionManager",
            }
        )
    fa = [g["group_id"] for g in groups if g["window_chunks"] is None]
    swa = sorted(
        (g for g in groups if g["window_chunks"] is not None),
        key=lambda g: int(g["window_chunks"]),  # type: ignore[call-overload]
        reverse=True,
    )
    fa_tpc = {g["tokens_per_chunk"] for g in groups if g["window_chunks"] is None}
    alignment = fa_tpc.pop() if len(fa_tpc) == 1 else None
    checkpoints = {
        str(gid): {
            "num_speculative_blocks": 0,
            "num_prefill_checkpoint_blocks": 1,
            "prefill_checkpoint_alignment": g.prefill_checkpoint_alignment,
        }
        for gid, g in enumerate(geometry.groups)
        if g.prefill_checkpoint_alignment is not None
    }
    return {
        "vllm_version": vllm_version,
        "vllm_modified": [],
        # only with prefill checkpoints: every other synthetic header stays what it was
        **(
            {"recurrent": {"mamba_cache_mode": "align", "groups": checkpoints}}
            if checkpoints
            else {}
        ),
        "groups": groups,
        "lookup_order": fa + [g["group_id"] for g in swa],
        "blocks_per_chunk": bpc,
        "tokens_per_hash": tph,
        "alignment_tokens": alignment,
        "retention_interval": geometry.retention_interval,
        "max_num_batched_tokens": geometry.max_num_batched_tokens,
        "long_prefill_token_threshold": geometry.long_prefill_token_threshold,
        "async_scheduling": geometry.async_scheduling,
        "max_model_len": geometry.max_model_len,
        "cpu_num_chunks": geometry.cpu_chunks,
        "geometry_name": geometry.name,
        **drafter_header(geometry.drafter),
        "num_hash_lookahead_tokens": num_hash_lookahead_tokens,
        # only where it is not 1: every other synthetic header stays what it was
        **({"dcp_world_size": geometry.dcp} if geometry.dcp > 1 else {}),
    }


def drafter_header(drafter: Drafter | None) -> dict[str, Any]:
    """The header's drafter fields, as the recorder writes them from vLLM's
    ``SpeculativeConfig`` (`keytrace.vllm.hook.header`)."""
    if drafter is None:
        return {"spec_method": None, "num_speculative_tokens": None, "spec_mtp_modules": None}
    return {
        "spec_method": drafter.method,
        "num_speculative_tokens": drafter.num_speculative_tokens,
        "spec_mtp_modules": drafter.mtp_modules if drafter.method == "mtp" else None,
    }


def drafter_from_header(header: dict[str, Any]) -> Drafter | None:
    """The drafter a header names: one of `DRAFTER_METHODS` (absent, as in every header
    written before drafters were recorded, or another method: none the lab builds; those
    methods leave vLLM's block hashes as they are)."""
    method = header.get("spec_method")
    if method not in DRAFTER_METHODS:
        return None
    return Drafter(
        method=str(method),
        num_speculative_tokens=int(header.get("num_speculative_tokens") or 1),
        mtp_modules=int(header.get("spec_mtp_modules") or 1) if method == "mtp" else 1,
    )


def _prefix_match_unit(header: dict[str, Any], groups: list[GroupGeom], dcp: int) -> int | None:
    """The ``--prefix-match-unit`` a header implies: its hash unit where that is finer
    than the GCD of the blocks' token spans (None: the default)."""
    tph = header.get("tokens_per_hash")
    natural = (
        math.gcd(*(g.block_size * (1 if g.recurrent else dcp) for g in groups)) if groups else None
    )
    return int(tph) if tph and natural and int(tph) < natural else None


def geometry_from_header(header: dict[str, Any]) -> Geometry:
    """Rebuild a `Geometry` from a recorded header (offloaded groups, in group-id order).

    Raises ValueError naming the first field the header lacks.
    """
    need = ("groups", "blocks_per_chunk", "max_num_batched_tokens", "max_model_len")
    for k in need:
        if header.get(k) is None:
            raise ValueError(f"trace header lacks {k!r}, which replay needs")
    groups = []
    specs = (header.get("recurrent") or {}).get("groups") or {}
    for g in sorted(header["groups"], key=lambda g: g["group_id"]):
        if not g.get("offloaded"):
            raise ValueError(
                f"group {g['group_id']} is not offloaded; the harness offloads every group"
            )
        if g["kind"] not in GROUP_KINDS:
            raise ValueError(
                f"group {g['group_id']} has kind {g['kind']!r}, which the harness cannot build"
            )
        groups.append(
            GroupGeom(
                kind=g["kind"],
                block_size=int(g["block_size"]),
                sliding_window=g.get("sliding_window"),
                eagle=bool(g.get("is_eagle")),
                extra_retained_tokens=int(g.get("extra_retained_tokens") or 0),
                name=str(g.get("name") or ""),
                prefill_checkpoint_alignment=checkpoint_alignment(
                    specs.get(str(g["group_id"])) or {}
                ),
            )
        )
    dcp = int(header.get("dcp_world_size") or 1)
    return Geometry(
        name=str(header.get("geometry_name") or "recorded"),
        groups=tuple(groups),
        blocks_per_chunk=int(header["blocks_per_chunk"]),
        retention_interval=header.get("retention_interval"),
        max_num_batched_tokens=int(header["max_num_batched_tokens"]),
        long_prefill_token_threshold=int(header.get("long_prefill_token_threshold") or 0),
        async_scheduling=bool(header.get("async_scheduling")),
        cpu_chunks=int(header.get("cpu_num_chunks") or 100_000),
        max_model_len=int(header["max_model_len"]),
        num_gpu_blocks=header.get("num_gpu_blocks"),
        extra=_tier_extra(header),
        drafter=drafter_from_header(header),
        prefix_match_unit=_prefix_match_unit(header, groups, dcp),
        dcp=dcp,
    )


def checkpoint_alignment(spec: dict[str, Any]) -> int | None:
    """`GroupGeom.prefill_checkpoint_alignment` from a header's ``recurrent.groups`` entry
    (the spec's ``num_prefill_checkpoint_blocks`` and ``prefill_checkpoint_alignment``):
    None without checkpoint blocks, and with blocks but no alignment, which vLLM treats
    alike (``is_mamba_prefill_checkpoint_valid`` is False without an alignment: the
    scheduler splits the prefill as without checkpoint blocks)."""
    if not int(spec.get("num_prefill_checkpoint_blocks") or 0):
        return None
    alignment = spec.get("prefill_checkpoint_alignment")
    return None if alignment is None else int(alignment)


TIER_SETTINGS = ("spec_name", "secondary_tiers")
"""The connector settings (``Geometry.extra``) that make a geometry tiered."""

REPLAYABLE_TIERS = ("example", "fs")
"""Secondary tier types a CPU harness builds (the CPU lab's ``TIER_TYPES``)."""


def _tier_extra(header: dict[str, Any]) -> dict[str, Any]:
    """The connector settings that rebuild a recorded tiered manager: its spec and its
    secondary tiers' settings as given, except an ``fs`` tier's ``root_dir`` (the recorded
    folder holds the original run's data; the harness gives the replay a fresh one). Empty
    for a trace of a plain CPU tier."""
    tiers = header.get("secondary_tiers") or []
    if not tiers:
        return {}
    configs = []
    for t in tiers:
        kind = t.get("type")
        if kind not in REPLAYABLE_TIERS:
            raise ValueError(
                f"secondary tier {t.get('index')} is of type {kind!r}; a CPU replay builds "
                f"{' and '.join(REPLAYABLE_TIERS)} tiers only"
            )
        settings = dict(t.get("settings") or {"type": kind})
        if kind == "fs":
            settings.pop("root_dir", None)
        configs.append(settings)
    return {"spec_name": str(header.get("offload_spec")), "secondary_tiers": configs}
