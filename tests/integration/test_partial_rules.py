"""keytrace's partial-tail rules (`keytrace.judge.partial`) against vLLM's own lookup code.

vLLM's ``_lookup`` and its helpers (0.33.0: the partial search inline; 0.34.0:
``_lookup_partial_tail_hit``) are lifted from each release's sdist as source text and run
on a fake scheduler and manager: no vLLM or torch import, so thousands of states run in
seconds. Two properties, for both releases:

- **the model**: after vLLM's own complete-chunk lookup, `partial_lookup` (the cap
  ``L_p``, the anchor, the window top, the probe order, a boundary's hit, the deferral)
  returns what vLLM returns, on any mix of HIT, MISS, HIT_PENDING and RETRY;
- **E is exact**: where every key some producer offered is resident (but full-attention
  chunks, which only bound the resident prefix F), vLLM serves exactly
  keytrace's ``E = max(E_c, E_p)`` (the complete boundary by the rules the oracle verified,
  the partial one by `expected_partial` over the tails the producers offered).
"""

from __future__ import annotations
import __future__

import ast
import enum
from types import SimpleNamespace as NS
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keytrace.judge.definitions import in_reach
from keytrace.judge.partial import expected_partial, partial_cap, partial_lookup
from keytrace.judge.rules import PARTIAL_ANCHOR_COMPLETE, PARTIAL_ANCHOR_FA, Group, lookup_cap
from tests.integration.vllm_builds import release_sources

SCHEDULER = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
METHODS = (
    "_maximal_prefix_lookup",
    "_sliding_window_lookup",
    "_lookup_complete_chunks",
    "_make_boundary_key",
    "_lookup",
    "_lookup_partial_tail_hit",
    "_max_eagle_proof_margin",
    "_partial_tail_key_tokens",
    "_lookup_partial_tail",
    "_maybe_register_shared_prefix_junction",
)
RULE = {"0.33.0": PARTIAL_ANCHOR_COMPLETE, "0.34.0": PARTIAL_ANCHOR_FA}
TRIM_FIRST = {"0.33.0": False, "0.34.0": True}
BS, TPH = 16, 4


class LookupResult(enum.Enum):
    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


class _MambaSpec:
    pass


class _Quiet:
    def debug(self, *a: Any, **k: Any) -> None:
        pass

    def record_lookup(self, *a: Any) -> None:
        pass

    def record_partial_lookup(self, *a: Any) -> None:
        pass


_CLASSES: dict[str, type] = {}


def _scheduler_class(release: str) -> type:
    """vLLM's ``OffloadingConnectorScheduler`` lookup methods of ``release``, as source."""
    if release not in _CLASSES:
        src = (release_sources(release) / SCHEDULER).read_text()
        tree = ast.parse(src)
        cls = next(
            n
            for n in tree.body
            if isinstance(n, ast.ClassDef) and n.name == "OffloadingConnectorScheduler"
        )
        body: list[ast.stmt] = [
            n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS
        ]
        mod = ast.Module(
            body=[
                ast.ClassDef(
                    name="Sched",
                    bases=[],
                    keywords=[],
                    body=body,
                    decorator_list=[],
                    type_params=[],
                )
            ],
            type_ignores=[],
        )
        ns: dict[str, Any] = {
            "LookupResult": LookupResult,
            "cdiv": lambda a, b: -(-a // b),
            "round_down": lambda a, b: a // b * b,
            "logger": _Quiet(),
            "make_offload_key": lambda h, g: (h, g),
        }
        code = compile(
            ast.fix_missing_locations(mod),
            f"vllm-{release}-scheduler",
            "exec",
            flags=__future__.annotations.compiler_flag,
            dont_inherit=True,
        )
        exec(code, ns)
        _CLASSES[release] = ns["Sched"]
    return _CLASSES[release]


class _GroupConfig:
    def __init__(self, gid: int, recurrent: bool) -> None:
        self.group_idx, self.tokens_per_block, self.tokens_per_chunk = gid, BS, BS
        self.sliding_window_size_in_chunks = 1 if recurrent else None
        self.requires_cow_source = recurrent
        self.is_eagle_group = False
        self.kv_cache_spec = _MambaSpec() if recurrent else object()

    def load_window_size_in_chunks(self, _end: int) -> int | None:
        return self.sliding_window_size_in_chunks


def _scheduler(release: str, fa_first: bool) -> Any:
    s = _scheduler_class(release)()
    order = (False, True) if fa_first else (True, False)
    configs = tuple(_GroupConfig(i, rec) for i, rec in enumerate(order))
    s.config = NS(
        kv_group_configs=configs,
        tokens_per_hash=TPH,
        supports_partial_tail=True,
        blocks_per_chunk=1,
        retention_interval=0,
    )
    fa = tuple(i for i, c in enumerate(configs) if not c.requires_cow_source)
    rec = tuple(i for i, c in enumerate(configs) if c.requires_cow_source)
    s._full_attention_groups, s._sliding_window_groups = fa, rec
    s._lookup_groups = fa + rec  # vLLM looks full attention up first
    s._mamba_align_size = s._partial_tail_block_size = BS
    s._eagle_proof_margins = {}
    if release == "0.33.0":
        s._max_eagle_proof_margin = 0
    s.use_lookahead_block_hashes = False
    s._chunks_being_loaded = set()
    s._events_tracker = _Quiet()
    return s


def _request(s: Any, hashes: list[str], P: int, N: int, S: int, max_load: int | None) -> Any:
    req = NS(
        num_tokens=N,
        num_prompt_tokens=P,
        block_hashes=hashes,
        request_id="r",
        shared_prefix_boundary=0,
    )
    states = []
    for g in s.config.kv_group_configs:
        per = g.tokens_per_chunk // TPH
        keys = [(hashes[i], g.group_idx) for i in range(per - 1, len(hashes), per)]
        states.append(NS(offload_keys=keys, lookup_hit_end_chunk_idx=0))
    return NS(
        req=req,
        req_context=NS(set_offload_key_position=lambda k, p: None),
        group_states=tuple(states),
        num_locally_computed_tokens=S,
        max_load_tokens=max_load,
        partial_tail_boundary=None,
    )


def _vllm(
    release: str,
    fa_first: bool,
    resident: dict[tuple[str, int], LookupResult],
    hashes: list[str],
    P: int,
    N: int,
    S: int,
    max_new: int | None,
    max_load: int | None,
) -> tuple[int | None, int | None, int | None, int | None]:
    """vLLM's (hit, partial boundary), and its complete part's (hit, full-attention hit
    boundary: None on 0.33.0, which has none) on the same state."""
    s = _scheduler(release, fa_first)
    s.manager = NS(lookup=lambda k, _c: resident.get(k, LookupResult.MISS))
    rs = _request(s, hashes, P, N, S, max_load)
    got = s._lookup(rs, max_new)
    complete = s._lookup_complete_chunks(_request(s, hashes, P, N, S, max_load), max_new)
    hit, fa_hit = complete if isinstance(complete, tuple) else (complete, None)
    return got, rs.partial_tail_boundary, hit, fa_hit


RESULTS = st.sampled_from(
    [LookupResult.HIT] * 4
    + [LookupResult.MISS] * 2
    + [LookupResult.HIT_PENDING, LookupResult.RETRY]
)


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_the_partial_model_returns_what_vllms_lookup_returns(release: str, data: Any) -> None:
    N = data.draw(st.integers(2, 80), label="N")
    P = data.draw(st.integers(max(1, N - 8), N), label="P")  # a resumed request: N > P
    H = N // TPH
    hashes = [f"h{i}" for i in range(H)]
    S = data.draw(st.integers(0, max(0, (P - 1) // BS)), label="S blocks") * BS
    max_new = data.draw(st.one_of(st.none(), st.integers(0, 80)), label="max_new")
    max_load = data.draw(st.one_of(st.none(), st.integers(0, 80)), label="max_load")
    fa_first = data.draw(st.booleans(), label="fa_first")
    resident = {
        (f"h{i}", g): data.draw(RESULTS, label=f"h{i}/{g}")
        for i in range(H)
        for g in (0, 1)
        if data.draw(st.booleans())
    }
    got, boundary, hit, fa_hit = _vllm(
        release, fa_first, resident, hashes, P, N, S, max_new, max_load
    )

    def probe(b: int) -> list[str]:
        out = []
        for g in (0, 1):
            r = resident.get((hashes[b // TPH - 1], g), LookupResult.MISS).name
            out.append(r)
            if r == "MISS":
                break
        return out

    L_p = partial_cap(P, H, TPH, S, max_new, max_load)
    model = partial_lookup(RULE[release], S, hit, fa_hit, L_p, BS, TPH, probe)
    assert model == (got, boundary)


def _producer_offers(
    P: int, share: int, tag: str, episode: list[str]
) -> dict[tuple[str, int], str]:
    """The keys a producer of ``P`` prompt tokens offers (groups: 0 full attention, 1
    recurrent): every complete FA chunk, the recurrent state at its own boundary
    ``Tb = (P - 1) // bs * bs`` and, where its tail ``T = (P - 1) // h * h`` is inside a
    block, every group's key at T. Its first ``share`` tokens are the episode's."""
    share = min(share, len(episode) * TPH)
    hashes = [episode[i] if (i + 1) * TPH <= share else f"{tag}{i}" for i in range(P // TPH)]
    keys: dict[tuple[str, int], str] = {}
    for c in range(P // BS):
        keys[(hashes[(c + 1) * BS // TPH - 1], 0)] = "chunk"
    Tb, T = (P - 1) // BS * BS, (P - 1) // TPH * TPH
    if Tb:
        keys[(hashes[Tb // TPH - 1], 1)] = "chunk"
    if T % BS:
        for g in (0, 1):
            keys[(hashes[T // TPH - 1], g)] = "partial"
    return keys


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_where_every_offered_key_is_resident_vllm_serves_exactly_E(release: str, data: Any) -> None:
    N = P = data.draw(st.integers(2, 96), label="P")
    H = N // TPH
    episode = [f"h{i}" for i in range(H)]
    S = data.draw(st.integers(0, max(0, (P - 1) // BS)), label="S blocks") * BS
    max_load = data.draw(st.one_of(st.none(), st.integers(0, 96)), label="max_load")
    producers = data.draw(
        st.lists(st.tuples(st.integers(2, 112), st.integers(0, 112)), max_size=3), label="producers"
    )
    resident: dict[tuple[str, int], LookupResult] = {}
    complete, partial = [], []
    for j, (Pr, share) in enumerate(producers):
        offered = _producer_offers(Pr, share, f"p{j}_", episode)
        resident.update(dict.fromkeys(offered, LookupResult.HIT))
        Tb, T = (Pr - 1) // BS * BS, (Pr - 1) // TPH * TPH
        share = min(share, H * TPH)
        if Tb and Tb <= share:  # the chain: the same FA key at the boundary
            complete.append(Tb)
        if T % BS and share >= T:
            partial.append(T)
    # evictions of full-attention chunks only: E stays within the resident prefix F
    for c in data.draw(st.lists(st.integers(0, 6), max_size=2), label="evicted FA chunks"):
        if (c + 1) * BS // TPH <= H:
            resident.pop((episode[(c + 1) * BS // TPH - 1], 0), None)
    got, _boundary, _hit, _fa = _vllm(release, True, resident, episode, P, N, S, None, max_load)
    # keytrace: F is the resident FA prefix from S, the complete cap L_c as verified
    groups = [Group(0, BS, None, kind="full_attention"), Group(1, BS, 1, kind="mamba", cow=True)]
    F = S
    while (episode_key := F // BS) < H // (BS // TPH) and resident.get(
        (episode[(episode_key + 1) * BS // TPH - 1], 0)
    ):
        F += BS
    L_c = lookup_cap(groups, N, S, None, max_load, TRIM_FIRST[release])
    top = min(L_c, F)
    E_c = max((b for b in complete if in_reach(b, S, top)), default=None)
    L_p = partial_cap(P, H, TPH, S, None, max_load)
    E_p = expected_partial(partial, S, top, L_p, BS)
    E = max((e for e in (E_c, E_p) if e is not None), default=None)
    assert got == (E - S if E is not None else 0), (E_c, E_p, F, L_c, L_p)
