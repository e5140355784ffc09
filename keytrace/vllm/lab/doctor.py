"""``keytrace doctor``: what keytrace can do in this environment, and why not.

Returns data (`Diagnosis`); ``keytrace.cli.doctor`` renders it. Works without vLLM (then
every vLLM capability is "no", with the import error as the reason) and imports vLLM only
to inspect it, never to patch it: nothing is switched on.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from dataclasses import dataclass, field

from keytrace._version import __version__
from keytrace.errors import install_hint
from keytrace.vllm.hook.patches import capabilities
from keytrace.vllm.hook.rulecode import judge_capability
from keytrace.vllm.hook.support import (
    CAPABILITIES,
    HARNESS_RELEASES,
    VERIFIED_RELEASES,
    Capability,
    Check,
    VllmInfo,
    vllm_info,
)
from keytrace.vllm.lab.checks import harness_capability
from keytrace.vllm.mods import catalog

CAPABILITY_TEXT = {
    "record": "record traces (KEYTRACE_DIR in vllm serve, the vLLM plugin)",
    "record:tiered": "record a tiered manager too (TieringOffloadingSpec: CPU + fs/obj/p2p)",
    "alarm": "live write-only alarm (KEYTRACE_ALARM)",
    "metrics": "Prometheus metrics of the alarm",
    "harness": "CPU lab: demo, replay, sweep, workload, fuzz, minimize, report",
    "judge": "verdicts: keytrace's rules verified by the oracle on this vLLM's code",
}
"""What each capability is, in words a user searches for."""

LIBRARIES = ("keytrace", "vllm", "torch", "pyarrow", "polars", "click", "wrapt", "packaging")


@dataclass(frozen=True)
class Diagnosis:
    """Everything ``keytrace doctor`` reports."""

    python: str
    platform: str
    libraries: dict[str, str | None]
    vllm: VllmInfo
    capabilities: list[Capability]
    notes: list[str] = field(default_factory=list)

    @property
    def can_record(self) -> bool:
        return any(c.name == "record" and c.ok for c in self.capabilities)

    def as_json(self) -> dict[str, object]:
        return {
            "keytrace": __version__,
            "python": self.python,
            "platform": self.platform,
            "libraries": self.libraries,
            "vllm": {
                "version": self.vllm.version,
                "path": self.vllm.path,
                "kind": self.vllm.kind,
                "verified": self.vllm.verified,
                "error": self.vllm.error or None,
            },
            "verified_releases": list(VERIFIED_RELEASES),
            "harness_releases": list(HARNESS_RELEASES),
            "can_record": self.can_record,
            "capabilities": [
                {
                    "name": c.name,
                    "what": CAPABILITY_TEXT.get(c.name, _modification_text(c.name)),
                    "ok": c.ok,
                    "reason": c.reason or None,
                    "checks": [
                        {"check": k.what, "ok": k.ok, "problem": k.problem or None}
                        for k in c.checks
                    ],
                }
                for c in self.capabilities
            ],
            "notes": self.notes,
        }


def _modification_text(name: str) -> str:
    kind, _, what = name.partition(":")
    if kind == "inject":
        return f"inject historical store bug ({catalog.INJECTIONS.get(what, what)})"
    return f"candidate fix ({catalog.FIXES.get(what, what)})"


def describe(name: str) -> str:
    """One line naming what capability ``name`` is."""
    return CAPABILITY_TEXT.get(name, _modification_text(name))


def _library_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _notes(info: VllmInfo, caps: list[Capability]) -> list[str]:
    notes = []
    if info.version is None:
        notes.append(f"vLLM is not importable: install it with {install_hint('vllm')}")
    elif info.source_build:
        notes.append(
            f"a source build of {info.release}: keytrace checks its code, not its version; "
            "traces recorded here say vllm_verified: false"
        )
    elif not info.verified:
        notes.append(
            f"vLLM {info.version} is not a release keytrace's CI runs "
            f"({', '.join(VERIFIED_RELEASES)}); what passes its checks works"
        )
    record = next(c for c in caps if c.name == "record")
    if info.version is not None and not record.ok:
        notes.append(f"recording is refused: {record.reason}")
    return notes


def identity_warnings(
    hash_algo: str | None = None,
    kv_transfer_config: str | None = None,
    trace: str | None = None,
    environ: dict[str, str] | None = None,
) -> list[str]:
    """What ``keytrace doctor`` warns about hash identity (`keytrace.judge.identity`): a
    shared tier under a random per-process seed, for a configuration (``hash_algo``, the
    ``--kv-transfer-config`` JSON, PYTHONHASHSEED from ``environ``) and for every engine
    of a recorded ``trace``; in a trace, engines that share a tier and hash differently."""
    import json
    import os

    from keytrace.judge.identity import config_header, identity_findings, seed_warnings

    env = os.environ if environ is None else environ
    out: list[str] = []
    if hash_algo is not None or kv_transfer_config is not None:
        extra = {}
        if kv_transfer_config:
            extra = dict(json.loads(kv_transfer_config).get("kv_connector_extra_config") or {})
        tiers = list(extra.get("secondary_tiers") or [])
        header = config_header(hash_algo or "sha256", tiers, "PYTHONHASHSEED" in env)
        out.extend(seed_warnings(header))
    if trace is not None:
        from keytrace.format.reader import engine_headers, open_trace

        engines = engine_headers(open_trace(trace))
        for name, (header, _) in engines.items():
            out.extend(f"{name}: {w}" for w in seed_warnings(header))
        out.extend(f.text for f in identity_findings({n: h for n, (h, _) in engines.items()}))
    return out


def diagnose() -> Diagnosis:
    """Inspect the environment (imports vLLM if installed; patches nothing)."""
    info = vllm_info()
    if info.version is None:
        caps = [
            Capability(
                name, (Check("vllm is importable", f"vllm is not importable ({info.error})"),)
            )
            for name in CAPABILITY_TEXT
        ]
    else:
        caps = capabilities()
        caps.insert(len(CAPABILITIES), harness_capability())
        caps.insert(len(CAPABILITIES) + 1, judge_capability())
    libraries = {name: _library_version(name) for name in LIBRARIES}
    if info.version is not None:
        libraries["vllm"] = info.version  # what the code says, over the metadata's claim
    return Diagnosis(
        python=sys.version.split()[0],
        platform=f"{platform.system()} {platform.machine()}",
        libraries=libraries,
        vllm=info,
        capabilities=caps,
        notes=_notes(info, caps),
    )


__all__ = ["CAPABILITY_TEXT", "Diagnosis", "describe", "diagnose"]
