"""Whether keytrace's rules were verified for the vLLM code that recorded a trace.

keytrace's rules (`keytrace.judge.rules`, `keytrace.judge.definitions`) restate what
vLLM's lookup and store paths do, and vLLM changes that code every release and every week
on main. The recorder fingerprints the code that decides keys and rules as one *rules
digest* (``rules_digest`` in the header; `keytrace.vllm.hook.rulecode` computes it), and
the isolated-lookup oracle is the arbiter of whether the rules hold for that code:

- `VERIFIED_FILE`, shipped with keytrace, lists the digests CI's oracle runs checked (the
  releases keytrace supports, and what they found);
- ``keytrace doctor --verify`` runs the oracle where it is run (a source build of main, a
  release keytrace has not seen) and keeps its outcome in this machine's cache
  (`cache_dir`).

A digest is *verified* when some run checked shortfalls on it and none disagreed,
*disputed* when a run found a disagreement (then no AGREE is claimed on its traces),
*unverified* otherwise. A trace written before rules digests existed has none: it is
trusted as before, by whether its release was one keytrace's CI ran (``vllm_verified``).

A digest says which code ran, not which model: each run records the `features` its
workloads exercised (``covers``: ``recurrent``, ``recurrent+dcp``, ``retention``, ...),
and a trace that needs one is verified only by a run that covered it. A trace whose
configuration holds what no rule describes (`uncovered`: a recurrent group with partial
tails, another retention interval or a drafter) gets no verdict at all, whatever its
digest: the trace is kept and its facts are shown, nothing is judged.

The status is looked up when a trace is judged, not written into the header: a header is
the same bytes for every process of one configuration (the reader refuses mixed parts),
and a verification that runs later applies to traces recorded before it. Pure Python; no
vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from keytrace.format.remote import keytrace_cache
from keytrace.judge.rules import (
    CHECKPOINT_BLOCK,
    CHECKPOINT_TAIL,
    is_recurrent,
    prefill_checkpoint_of,
)

VERIFIED_FILE = Path(__file__).with_name("verified_rules.json")
"""Rules digest -> the oracle runs keytrace's CI made on that code (`Verification`)."""


class RulesTrust(StrEnum):
    """How far a trace's verdicts can be trusted, by what the oracle said of its code."""

    VERIFIED = "verified"
    """The oracle ran on this code (its rules digest) and agreed with every verdict."""
    RELEASE = "release"
    """A trace without a rules digest, from a release keytrace's CI ran."""
    UNVERIFIED = "unverified"
    """No oracle run on this code: the verdicts apply rules written for other code."""
    DISPUTED = "disputed"
    """The oracle disagreed with keytrace on this code: no AGREE is claimed."""
    UNCOVERED = "uncovered"
    """The trace's configuration holds what keytrace's rules do not describe (`uncovered`):
    no verdict is claimed, AGREE or MISMATCH."""


def _recurrent_groups(header: Mapping[str, Any]) -> list[str]:
    return [
        str(g.get("group_id"))
        for g in header.get("groups", [])
        if g.get("offloaded") and is_recurrent(g)
    ]


def _fa_drafter_groups(header: Mapping[str, Any]) -> list[str]:
    """Offloaded full-attention EAGLE/MTP draft groups that drop a block for the drafter
    (legacy hashes: no lookahead), whose lookup pops its peek chunk (`rules.peek_cap`)."""
    if int(header.get("num_hash_lookahead_tokens") or 0):
        return []
    return [
        str(g.get("group_id"))
        for g in header.get("groups", [])
        if g.get("offloaded")
        and g.get("is_eagle")
        and g.get("sliding_window") is None
        and not is_recurrent(g)
    ]


ATTENTION = "attention"
"""The feature of every trace without a recurrent group; a run recorded before runs said
what they covered (``covers`` empty) covered exactly this."""
RETENTION = "retention"
"""A positive ``retention_interval``: sliding-window tails every that many tokens too."""
DENSE = "retention-dense"
"""A dense ``retention_interval`` (None): every block of every window kept."""
FA_DRAFTER = "attention+fa-drafter"
"""A full-attention EAGLE/MTP draft group with legacy hashes (DeepSeek-V3-like MLA + MTP
on vLLM 0.33.0): its lookup pops the peek chunk, a rule the attention layouts without such
a group never exercised. The DCP layouts' `dsv3` ones exercise it on a CPU tier, where
every resend is a hit, cold or deferred: no shortfall for the oracle, so no run covers it
yet (on a tiered manager it gets no verdict: `uncovered`)."""
ATTENTION_DCP = "attention+dcp"
"""Attention groups under decode context parallelism: vLLM scales an attention block by
the DCP size and keeps a replicated draft group's block as it is, so chunk sizes differ
across groups in ways the runs without DCP never exercised."""
FEATURE_TEXT = {
    ATTENTION: "attention groups",
    ATTENTION_DCP: "attention groups under decode context parallelism",
    FA_DRAFTER: "a full-attention EAGLE/MTP draft group without lookahead hashes",
    RETENTION: "a retention interval",
    DENSE: "dense retention",
    "recurrent": "recurrent state groups",
    "recurrent+lookahead": "recurrent state groups under lookahead hashes",
    "recurrent+dcp": "recurrent state groups under decode context parallelism",
    "recurrent+partial": "recurrent state groups with partial tails",
    "recurrent+checkpoint": "recurrent state groups with prefill checkpoints",
}


def _dcp(header: Mapping[str, Any]) -> int:
    return int(header.get("dcp_world_size") or 1)


def _retention_feature(header: Mapping[str, Any]) -> tuple[str, ...]:
    """`RETENTION` or `DENSE` for a trace recorded under a retention interval other than
    vLLM's default 0 (a header without the key is the default)."""
    if "retention_interval" in header and header["retention_interval"] is None:
        return (DENSE,)
    return (RETENTION,) if int(header.get("retention_interval") or 0) else ()


def features(header: Mapping[str, Any]) -> tuple[str, ...]:
    """What a trace needs the oracle to have run on before its verdicts count as verified
    (`Verification.covers`): ``attention`` for a trace without a recurrent state group,
    with `ATTENTION_DCP` when recorded under decode context parallelism and `RETENTION`
    (a positive retention interval) or `DENSE` (dense retention) when recorded under one;
    ``recurrent`` for one with a recurrent group,
    ``recurrent+lookahead`` too when its block hashes look ahead (a drafter, 0.34.0),
    ``recurrent+dcp`` too under decode context parallelism (full-attention chunks DCP
    times a recurrent one, states kept at the hash unit), ``recurrent+partial`` with
    partial tails (a hash unit below the block: `keytrace.judge.partial`), and
    ``recurrent+checkpoint`` where the prompt's last state is exported from inside the
    final prefill chunk at its block boundary (`keytrace.judge.rules.prefill_checkpoint_of`
    `CHECKPOINT_BLOCK`: Mamba2's prefill checkpoints)."""
    if not _recurrent_groups(header):
        dcp = (ATTENTION_DCP,) if _dcp(header) > 1 else ()
        drafter = (FA_DRAFTER,) if _fa_drafter_groups(header) else ()
        return (ATTENTION, *dcp, *drafter, *_retention_feature(header))
    needs = ["recurrent"]
    if int(header.get("num_hash_lookahead_tokens") or 0):
        needs.append("recurrent+lookahead")
    if _dcp(header) > 1:
        needs.append("recurrent+dcp")
    if header.get("supports_partial_tail"):
        needs.append("recurrent+partial")
    if prefill_checkpoint_of(header) == CHECKPOINT_BLOCK:
        needs.append("recurrent+checkpoint")
    return tuple(needs)


def uncovered(header: Mapping[str, Any]) -> tuple[str, ...]:
    """What in a trace header keytrace's rules do not describe, one phrase each (empty:
    every offloaded group is covered). The one place that decides it: the differ, the
    live alarm and the reporters all ask here.

    Recurrent state groups are judged with a window of one chunk and states kept where a
    request computed them (`keytrace.judge.definitions.junction_kept`), with partial tails
    by `keytrace.judge.partial` where the header says where the lookup anchors its window
    (``recurrent.partial_anchor``; `features` ``recurrent+partial``), on the setting the
    oracle verified: retention interval 0, and no speculative
    drafter unless its block hashes look ahead (``num_hash_lookahead_tokens`` > 0, vLLM
    0.34.0: no EAGLE block drop); with or without decode context parallelism (vLLM
    0.33.0 and 0.34.0 scale the full-attention chunk by it and not the recurrent one, and
    keep partial tails off under it, even with a hash unit below the block: the same
    rules hold, the oracle verified DCP 2 and 4, `features` ``recurrent+dcp``), and with
    or without prefill checkpoints exported at a block boundary
    (`keytrace.judge.rules.prefill_checkpoint_of`: the state the split keeps, `features`
    ``recurrent+checkpoint``). Any of the others changes where vLLM keeps and looks up
    states in ways no rule here describes yet: prefill checkpoints exported at a partial
    tail inside a block (a hash unit below the block) keep no state at the tail's block
    start (docs/findings.md).

    A retention interval other than 0 is judged for windowed groups (their tails stand at
    every multiple, or every chunk boundary when dense: `features` says which oracle runs
    verify that), never for recurrent ones: ``MambaManager.reachable_block_mask`` keeps a
    state at a multiple of the interval (dense: at every block) only where the request
    computed one, at the end of one of its prefill steps, so which multiples hold a state
    depends on how each request was scheduled. keytrace's standing boundaries would
    expect one at every multiple and call the rest mismatches (``not_keyable``,
    ``no_checkpoint``); the oracle agrees with those (nothing was stored), so it cannot
    tell them from real ones (docs/diff.md, "Retention intervals")."""
    recurrent = _recurrent_groups(header)
    if not recurrent:
        drafters = _fa_drafter_groups(header)
        if drafters and header.get("secondary_tiers"):
            # the oracle's tiered MLA + MTP layout disagreed (E one chunk above what an
            # isolated lookup serves, on explained episodes): no rule verified there
            s = "s" if len(drafters) > 1 else ""
            return (
                f"full-attention EAGLE/MTP draft group{s} {', '.join(drafters)} without "
                "lookahead hashes on a tiered manager",
            )
        return ()
    why = []
    if header.get("supports_partial_tail") and not (header.get("recurrent") or {}).get(
        "partial_anchor"
    ):
        # recorded before keytrace read where the lookup anchors its window: the rules
        # differ by it (0.33.0 / 0.34.0), and the header does not say which
        why.append("partial tails (a hash unit below the block) recorded without their anchor rule")
    elif header.get("supports_partial_tail") and header.get("secondary_tiers"):
        # vLLM's CPU primary fails an assertion on them (docs/findings.md): not verified
        why.append("partial tails on a tiered manager")
    retention = header.get("retention_interval", 0)
    if retention != 0:
        dense = "dense (None)" if retention is None else str(retention)
        why.append(f"retention interval {dense}")
    drafted = header.get("spec_method") or any(
        g.get("is_eagle") for g in header.get("groups", []) if g.get("offloaded")
    )
    if drafted and not int(header.get("num_hash_lookahead_tokens") or 0):
        # legacy hashes: the EAGLE block drop moves the state boundaries (vLLM 0.33.0)
        why.append("an EAGLE/MTP drafter without lookahead hashes")
    rec = header.get("recurrent") or {}
    if rec.get("mamba_cache_mode") not in (None, "align"):
        why.append(f"mamba cache mode {rec.get('mamba_cache_mode')}")
    if prefill_checkpoint_of(header) == CHECKPOINT_TAIL:
        # the backend exports the state at the tail, inside a block: no chunk ends at the
        # tail's block start, so no state is kept there (vLLM 0.33.0's lookup needs one)
        why.append("prefill checkpoints exported at a partial tail inside a block")
    if not why:
        return ()
    s = "s" if len(recurrent) > 1 else ""
    return (f"recurrent state group{s} {', '.join(recurrent)} with {' and '.join(why)}",)


@dataclass(frozen=True)
class Verification:
    """One oracle run on one rules digest: the vLLM it ran on, how many shortfall
    episodes it looked up again in isolation, and how many disagreed with the differ."""

    vllm: str
    episodes: int
    disagreements: int
    when: str
    how: str = "keytrace doctor --verify"
    covers: tuple[str, ...] = ()
    """`features` its workloads exercised: a trace is verified only by a run that covers
    what it needs. Empty: a run recorded before runs said, which ran attention layouts
    only (`effective_covers`)."""

    @property
    def effective_covers(self) -> tuple[str, ...]:
        return self.covers or (ATTENTION,)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Verification:
        return cls(**{**raw, "covers": tuple(raw.get("covers", ()))})


@dataclass(frozen=True)
class RulesStatus:
    """A trace's (or the installed vLLM's) rules digest and what is known of it."""

    digest: str | None
    runs: tuple[Verification, ...] = ()
    release_verified: bool = False
    """For a trace without a digest: its release was one keytrace's CI ran."""
    not_covered: tuple[str, ...] = ()
    """What the trace holds that no rule describes (`uncovered`)."""
    needs: tuple[str, ...] = ()
    """`features` of the trace: only runs that cover them verify it."""

    @property
    def special_needs(self) -> tuple[str, ...]:
        """`needs` beyond `ATTENTION`, which every run before coverage was recorded
        covered (and which every report omits, so it reads as before)."""
        return tuple(n for n in self.needs if n != ATTENTION)

    @property
    def trust(self) -> RulesTrust:
        if self.not_covered:
            return RulesTrust.UNCOVERED
        if self.digest is None:
            if self.special_needs:  # a release's CI runs covered attention only
                return RulesTrust.UNVERIFIED
            return RulesTrust.RELEASE if self.release_verified else RulesTrust.UNVERIFIED
        if any(r.disagreements for r in self.runs):
            return RulesTrust.DISPUTED
        if any(r.episodes > 0 and set(self.needs) <= set(r.effective_covers) for r in self.runs):
            return RulesTrust.VERIFIED
        return RulesTrust.UNVERIFIED

    @property
    def episodes(self) -> int:
        """Shortfall episodes the oracle checked on this code, over every run."""
        return sum(r.episodes for r in self.runs)

    @property
    def disagreements(self) -> int:
        return sum(r.disagreements for r in self.runs)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "digest": self.digest,
            "trust": str(self.trust),
            "episodes_checked": self.episodes,
            "disagreements": self.disagreements,
        }
        if self.not_covered:  # only then: every other report reads as before
            out["uncovered"] = list(self.not_covered)
        if self.special_needs:
            out["needs"] = list(self.needs)
        return out


def shipped() -> dict[str, list[Verification]]:
    """`VERIFIED_FILE`: digest -> the oracle runs that checked it."""
    try:
        raw = json.loads(VERIFIED_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {
        d: [Verification.from_json(v) for v in runs] for d, runs in raw.get("digests", {}).items()
    }


def cache_dir() -> Path:
    """This machine's own verifications: ``verified/`` in keytrace's cache folder
    (`keytrace.format.remote.keytrace_cache`: ``KEYTRACE_CACHE_DIR``, else
    ``~/.cache/keytrace``)."""
    return keytrace_cache() / "verified"


def local_runs(digest: str) -> list[Verification]:
    """This machine's ``keytrace doctor --verify`` runs on ``digest``, oldest first."""
    try:
        raw = json.loads((cache_dir() / f"{digest}.json").read_text())
        return [Verification.from_json(v) for v in raw]
    except (OSError, ValueError, TypeError):
        return []


def record_run(digest: str, run: Verification) -> Path:
    """Keep ``run`` with this machine's verifications of ``digest`` (atomically)."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.json"
    runs = [asdict(v) for v in local_runs(digest)] + [asdict(run)]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(runs, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def status_of(digest: str) -> RulesStatus:
    """What is known of ``digest``: CI's runs shipped with keytrace, then this machine's."""
    return RulesStatus(digest, tuple(shipped().get(digest, ())) + tuple(local_runs(digest)))


def trace_rules(header: Mapping[str, Any]) -> RulesStatus | None:
    """The rules status of a trace, from its header: by its rules digest, or for a trace
    written before digests, by its release (None for a header the recorder did not write:
    a synthetic trace built by hand, unless it holds what no rule describes)."""
    gaps, needs = uncovered(header), features(header)
    digest = header.get("rules_digest")
    if isinstance(digest, str) and digest:
        return replace(status_of(digest), not_covered=gaps, needs=needs)
    if "vllm_verified" not in header and not gaps:  # built by hand: nothing to say
        return None
    verified = header.get("vllm_verified") is True
    return RulesStatus(None, release_verified=verified, not_covered=gaps, needs=needs)


def _recurrent_gaps(st: RulesStatus) -> bool:
    """Every reason `uncovered` gave is about recurrent state groups (the other: a
    full-attention draft group on a tiered manager)."""
    return all(g.startswith("recurrent state group") for g in st.not_covered)


def _named_needs(st: RulesStatus) -> tuple[str, ...]:
    """The features a report names for an unverified trace: its `special_needs`, less
    ``recurrent`` where a ``recurrent+...`` one says it already."""
    needs = st.special_needs
    if any(n.startswith("recurrent+") for n in needs):
        return tuple(n for n in needs if n != "recurrent")
    return needs


def no_verdict_error(st: RulesStatus, then: str = "") -> str:
    """The one line a command ends with when it claims no verdict (`verdict_withheld`)."""
    where = "Recurrent state groups" if _recurrent_gaps(st) else "Rules verified by the oracle"
    return (
        f"no verdict: keytrace has no rules for {'; '.join(st.not_covered)}{then} "
        f"(see docs/diff.md, '{where}')"
    )


def verdict_withheld(st: RulesStatus | None) -> bool:
    """No verdict at all (AGREE or MISMATCH) on a trace that holds what no rule
    describes: the rules would judge it as another model."""
    return st is not None and st.trust is RulesTrust.UNCOVERED


def agree_refused(st: RulesStatus | None) -> bool:
    """No AGREE is claimed on a trace whose code the oracle disputed: the rules that found
    nothing are known to be wrong somewhere on it (nor on one whose verdict is withheld)."""
    return st is not None and st.trust in (RulesTrust.DISPUTED, RulesTrust.UNCOVERED)


def agree_claim(st: RulesStatus | None) -> str:
    """What a report claims where nothing mismatched: AGREE, or, where `agree_refused`,
    ``NO VERDICT (rules disputed)`` (the text report, the fleet table and the chunk map)."""
    return "NO VERDICT (rules disputed)" if agree_refused(st) else "AGREE"


def trust_line(st: RulesStatus | None) -> str | None:
    """The line a report starts with when its verdicts are not backed by the oracle for
    the recording's code (None: nothing to say)."""
    if st is None or st.trust in (RulesTrust.VERIFIED, RulesTrust.RELEASE):
        return None
    if st.trust is RulesTrust.UNCOVERED:
        what = "recurrent states" if _recurrent_gaps(st) else "keys"
        return (
            f"NO VERDICT: keytrace has no rules for what this trace holds "
            f"({'; '.join(st.not_covered)}): vLLM keeps and looks up {what} "
            "there in ways the store/lookup rules do not describe yet; the trace is "
            "recorded and kept, nothing in it is judged"
        )
    if st.digest:
        code = f"rules digest {st.digest}"
    elif st.release_verified:
        code = "its release, whose CI runs did not say what they covered"
    else:
        code = "a release keytrace's CI has not run"
    if st.special_needs and st.trust is RulesTrust.UNVERIFIED:
        code += ", for " + " and ".join(FEATURE_TEXT.get(n, n) for n in _named_needs(st))
    if st.trust is RulesTrust.DISPUTED:
        return (
            f"RULES DISPUTED: the oracle disagreed with keytrace {st.disagreements} time(s) on "
            f"the vLLM code that recorded this trace ({code}); no AGREE is claimed"
        )
    return (
        f"note: verdicts apply rules not verified for the vLLM code that recorded this trace "
        f"({code}); `keytrace doctor --verify` where it was recorded checks them"
    )


__all__ = [
    "ATTENTION",
    "DENSE",
    "FEATURE_TEXT",
    "RETENTION",
    "VERIFIED_FILE",
    "RulesStatus",
    "RulesTrust",
    "Verification",
    "agree_refused",
    "cache_dir",
    "features",
    "local_runs",
    "no_verdict_error",
    "record_run",
    "shipped",
    "status_of",
    "trace_rules",
    "trust_line",
    "uncovered",
    "verdict_withheld",
]
