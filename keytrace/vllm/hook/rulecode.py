"""Which vLLM code decides the rules keytrace judges by: the *rules digest*.

keytrace's rules (`keytrace.judge`) restate what vLLM's lookup and store paths do. vLLM
changes that code every release and every week on main; a rule that was right for one
release can be silently wrong on the next. So keytrace fingerprints the code that decides
keys and rules (`RULE_BEARING`: the lookup, the store jobs and masks, the windows, the
block hasher, the lookahead, the tiered manager's lookup and promotions) as one digest,
which the header records (``rules_digest``). What the oracle found on a digest, and so how
far verdicts on its traces can be trusted, is `keytrace.judge.trust`'s (no vLLM there: the
differ reads it). Two releases whose rule-bearing code is the same have one digest, so a
verification carries over; a commit on main that touches none of it keeps its digest too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
from collections.abc import Mapping
from pathlib import Path

from keytrace.judge.trust import RulesStatus, RulesTrust, status_of
from keytrace.vllm.hook.support import Capability, Check

SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
OFFLOAD_CONFIG = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"

RULE_BEARING: tuple[tuple[str, str], ...] = (
    (SCHEDULER, "OffloadingConnectorScheduler.get_num_new_matched_tokens"),
    (SCHEDULER, "OffloadingConnectorScheduler._lookup"),
    (SCHEDULER, "OffloadingConnectorScheduler._lookup_complete_chunks"),
    (SCHEDULER, "OffloadingConnectorScheduler._maximal_prefix_lookup"),
    (SCHEDULER, "OffloadingConnectorScheduler._sliding_window_lookup"),
    (SCHEDULER, "OffloadingConnectorScheduler._lookup_partial_tail"),
    (SCHEDULER, "OffloadingConnectorScheduler._lookup_partial_tail_hit"),
    (SCHEDULER, "OffloadingConnectorScheduler._maybe_register_shared_prefix_junction"),
    (SCHEDULER, "OffloadingConnectorScheduler._make_boundary_key"),
    (SCHEDULER, "OffloadingConnectorScheduler._build_store_jobs"),
    (SCHEDULER, "OffloadingConnectorScheduler._build_partial_tail_store_jobs"),
    (SCHEDULER, "OffloadingConnectorScheduler._reachable_store_block_mask"),
    (SCHEDULER, "OffloadingConnectorScheduler._calc_num_offloadable_tokens"),
    (SCHEDULER, "RequestOffloadState.update_offload_keys"),
    (SCHEDULER, "RequestOffloadState.storable_chunks"),
    (OFFLOAD_CONFIG, "get_sliding_window_size_in_chunks"),
    (OFFLOAD_CONFIG, "GroupOffloadConfig.load_window_size_in_chunks"),
    ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),
    ("vllm.v1.core.kv_cache_utils", "hash_block_tokens"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager.reachable_block_mask"),
    ("vllm.config.vllm", "VllmConfig._resolve_num_hash_lookahead_tokens"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager.lookup"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager._initiate_promotion"),
)
"""(module, qualified name) of every vLLM function whose code decides which keys exist,
which a lookup needs or which a store keeps: what keytrace's rules restate. A function a
release lacks counts as absent, which is part of the fingerprint too."""


def _module_source(module: str) -> str | None:
    """The text of ``module``'s file, found without executing it (its parent packages are
    imported, as any import does; in a server they already are)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        return Path(spec.origin).read_text(encoding="utf-8")
    except OSError:
        return None


def _definition(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        found = [
            n
            for n in body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == part
        ]
        if not found:
            return None
        node = found[-1]  # a later definition replaces an earlier one, as at import
    return node


def _digest_of(text: str, node: ast.AST) -> str:
    """`source_digest`'s digest, from the file's text: the definition's lines with its
    decorators, indentation removed."""
    decorators = getattr(node, "decorator_list", [])
    first = min([node.lineno] + [d.lineno for d in decorators])  # type: ignore[attr-defined]
    lines = text.splitlines(keepends=True)[first - 1 : node.end_lineno]  # type: ignore[attr-defined]
    return hashlib.sha256(inspect.cleandoc("".join(lines)).encode()).hexdigest()[:16]


@functools.cache
def code_digests() -> dict[str, str]:
    """Qualified name -> source digest of each `RULE_BEARING` function of the installed
    vLLM ("absent" where it has none). Read from the source files, not by importing
    modules a server has not imported: a CPU-only server never loads the tiering manager,
    and computing the digest must not make it."""
    trees: dict[str, tuple[str, ast.Module] | None] = {}
    out = {}
    for module, qualname in RULE_BEARING:
        if module not in trees:
            text = _module_source(module)
            try:
                trees[module] = (text, ast.parse(text)) if text is not None else None
            except SyntaxError:
                trees[module] = None
        parsed = trees[module]
        node = _definition(parsed[1], qualname) if parsed is not None else None
        out[qualname] = "absent" if parsed is None or node is None else _digest_of(parsed[0], node)
    return out


def rules_digest(digests: Mapping[str, str] | None = None) -> str:
    """The installed vLLM's rules digest: one hash over every `RULE_BEARING` function's
    (16 hex digits; the header's ``rules_digest``)."""
    found = dict(code_digests()) if digests is None else digests
    text = "\n".join(f"{name}:{found[name]}" for name in sorted(found))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def status() -> RulesStatus:
    """What is known of the installed vLLM's rules digest (shipped and local runs)."""
    return status_of(rules_digest())


def judge_capability() -> Capability:
    """``keytrace doctor``'s ``judge`` line: whether keytrace's verdicts were verified by the
    oracle for the installed code."""
    st = status()
    what = f"the oracle verified keytrace's rules on this code (rules digest {st.digest})"
    if st.trust is RulesTrust.VERIFIED:
        recurrent = any(r.episodes and "recurrent" in r.covers for r in st.runs)
        what += (
            ", recurrent state groups too"
            if recurrent
            else "; not on recurrent state groups (keytrace doctor --verify runs them)"
        )
        return Capability("judge", (Check(what),))
    if st.trust is RulesTrust.DISPUTED:
        problem = (
            f"disputed: the oracle disagreed {st.disagreements} time(s) on this code; "
            "recording works, no AGREE is claimed on its traces"
        )
    else:
        problem = (
            "records; verdicts not verified for this code "
            "(keytrace doctor --verify runs the oracle here)"
        )
    return Capability("judge", (Check(what, problem),))


def header_digest() -> str | None:
    """The header's ``rules_digest`` (None when the source cannot be read: a trace then
    says nothing of its rules, and is judged as unverified code)."""
    try:
        digests = code_digests()
    except Exception:  # never let a fingerprint stop a recording
        return None
    if all(v == "absent" for v in digests.values()):
        return None
    return rules_digest(digests)
