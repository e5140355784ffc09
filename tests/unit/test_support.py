"""Deciding by the installed code (keytrace.vllm.hook.support), without vLLM: version
strings as vLLM developers and operators have them, and the signature/source checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from keytrace.vllm.hook.support import (
    REPLACED_SOURCES,
    Capability,
    Check,
    VllmInfo,
    check_params,
    check_source,
    code_identity,
    source_digest,
)


@pytest.mark.parametrize(
    ("version", "kind", "verified", "release"),
    [
        ("0.33.0", "verified release", True, "0.33.0"),
        ("0.33.0+cpu", "verified release", True, "0.33.0"),
        ("0.31.0", "verified release", True, "0.31.0"),
        ("0.32.0+cu129", "verified release", True, "0.32.0"),
        ("0.34.0", "verified release", True, "0.34.0"),  # what pip install vllm gives
        # setuptools_scm on a checkout: three commits after the v0.33.0 tag, dirty, rc
        ("0.33.1.dev3+g96039d055", "source build", False, "0.33.1.dev3"),
        ("0.33.1.dev3+g96039d055.cpu", "source build", False, "0.33.1.dev3"),
        ("0.33.1.dev3+g96039d055.d20261201", "source build", False, "0.33.1.dev3"),
        ("0.34.0rc1.dev1+g1234567", "source build", False, "0.34.0rc1.dev1"),
        ("0.33.0+g96039d055", "source build", False, "0.33.0"),
        ("0.33.1.dev3", "source build", False, "0.33.1.dev3"),  # no local label at all
        ("0.33.0.post1", "release keytrace has not run", False, "0.33.0.post1"),
        ("0.33.0+precompiled", "verified release", True, "0.33.0"),
        ("0.29.0", "release keytrace has not run", False, "0.29.0"),
        ("0.34.0rc1", "release keytrace has not run", False, "0.34.0rc1"),
        ("not-a-version", "unparsed version", False, None),
    ],
)
def test_version_strings(version: str, kind: str, verified: bool, release: str | None) -> None:
    info = VllmInfo(version, "/x")
    assert (info.kind, info.verified, info.release) == (kind, verified, release)


def test_not_importable() -> None:
    info = VllmInfo(None, None, "ModuleNotFoundError: vllm")
    assert (info.kind, info.verified, info.release) == ("not importable", False, None)


def test_code_identity_ignores_platform_labels_only() -> None:
    assert code_identity("0.33.0+cpu") == code_identity("0.33.0") == "0.33.0"
    assert code_identity("0.33.1.dev3+g96039d055.cpu") == "0.33.1.dev3+g96039d055"
    assert code_identity("0.33.1.dev3+g96039d055") != code_identity("0.33.1.dev3+g5d1c3e2aa")
    assert code_identity("0.33.0") != code_identity("0.32.0")
    assert code_identity("?") == "?"


class _Sched:
    def get_num_new_matched_tokens(self, request, num_computed_tokens, max_num_new_tokens):  # type: ignore[no-untyped-def]
        pass

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        pass

    def renamed(self, req, num_computed_tokens):  # type: ignore[no-untyped-def]
        pass


def test_params_read_by_position_and_name() -> None:
    ok = check_params(
        "S.f", _Sched.get_num_new_matched_tokens, ("request", "num_computed_tokens"), False
    )
    assert ok.ok and ok.what == "S.f(request, num_computed_tokens)"
    skip = check_params(
        "S.g", _Sched.update_state_after_alloc, ("request", None, "num_external_tokens"), False
    )
    assert skip.ok
    bad = check_params("S.h", _Sched.renamed, ("request", "num_computed_tokens"), False)
    assert (
        bad.problem
        == "S.h takes (req, num_computed_tokens), keytrace reads (request, num_computed_tokens)"
    )
    short = check_params(
        "S.g", _Sched.update_state_after_alloc, ("request", None, None, "x"), False
    )
    assert not short.ok


def test_a_replacement_needs_the_exact_signature() -> None:
    # an observer may ignore trailing parameters; a replacement takes exactly vLLM's
    assert check_params(
        "S.f", _Sched.get_num_new_matched_tokens, ("request", "num_computed_tokens"), False
    ).ok
    assert not check_params(
        "S.f", _Sched.get_num_new_matched_tokens, ("request", "num_computed_tokens"), True
    ).ok
    assert check_params(
        "S.f",
        _Sched.get_num_new_matched_tokens,
        ("request", "num_computed_tokens", "max_num_new_tokens"),
        True,
    ).ok


def _define(body: str, tmp_path: Path, name: str) -> object:
    """``_mask`` defined in a module of its own (a file, so inspect finds its source)."""
    path = tmp_path / f"{name}.py"
    path.write_text(f"def _mask(self, group_config, start_chunk_idx):\n    {body}\n")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._mask


def test_a_replacement_needs_the_code_it_was_written_against(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # one name, one signature: only the body differs (a later commit on main)
    _mask_v1 = _define("return [True]", tmp_path, "release")
    _mask_v2 = _define("return [False]", tmp_path, "main")
    where = "OffloadingConnectorScheduler._reachable_store_block_mask"
    digest = source_digest(_mask_v1)
    assert digest is not None and digest != source_digest(_mask_v2)
    monkeypatch.setitem(REPLACED_SOURCES, where, {digest: "0.33.0"})
    assert check_source(where, _mask_v1).ok
    changed = check_source(where, _mask_v2)
    assert changed.problem == f"{where} differs from the code keytrace replaces it with (0.33.0)"
    assert not check_source("Nowhere.fn", _mask_v1).ok  # unknown: never assumed the same
    no_source = check_source(where, len)  # a builtin: no source to compare
    assert no_source.problem == f"the source of {where} is not available, so it cannot be compared"


def test_a_capability_names_every_failed_check() -> None:
    cap = Capability("record", (Check("a"), Check("b", "b is missing"), Check("c", "c moved")))
    assert not cap.ok and cap.reason == "b is missing; c moved"
    assert [c.what for c in cap.failed] == ["b", "c"]
    assert Capability("record", (Check("a"),)).ok


def test_a_star_args_signature_takes_what_is_read_but_not_a_replacement() -> None:
    """A ``*args`` method (a MagicMock child, a wrapper) takes the read parameters as
    passed; a replacement still needs the exact list; a keyword-only parameter counts (the
    hooks read a parameter by position or by name), and so does its absence."""

    class M:
        def any(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            pass

        def kw_only(self, key, *, req_context):  # type: ignore[no-untyped-def]
            pass

    assert check_params("M.any", M.any, ("key", "req_context"), False).ok
    assert not check_params("M.any", M.any, ("key", "req_context"), True).ok
    assert check_params("M.kw_only", M.kw_only, ("key", "req_context"), True).ok
    bad = check_params("M.kw_only", M.kw_only, ("key", "req_context", "tier"), True)
    assert (
        bad.problem == "M.kw_only takes (key, req_context), keytrace reads (key, req_context, tier)"
    )
