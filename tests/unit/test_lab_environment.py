"""The lab sets what vLLM needs from the environment, and never overrides a user's value."""

from __future__ import annotations

import sys
import types

import pytest

from keytrace.vllm.lab import environment


def test_prepare_sets_what_is_missing_only() -> None:
    env = {"VLLM_TARGET_DEVICE": "cuda"}
    added = environment.prepare(env)
    assert env == {"VLLM_TARGET_DEVICE": "cuda", "HF_HUB_OFFLINE": "1"}
    assert added == {"HF_HUB_OFFLINE": "1"}
    assert environment.prepare(env) == {}


def test_a_clean_environment_gets_the_cpu_platform() -> None:
    env: dict[str, str] = {}
    environment.prepare(env)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"


def test_importing_the_lab_prepared_this_process() -> None:
    import os

    for name in environment.LAB_ENVIRONMENT:
        assert name in os.environ


def test_a_platform_resolved_with_no_device_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm.platforms")
    monkeypatch.setitem(sys.modules, "vllm.platforms", fake)
    assert environment.resolved_too_early() is None  # not resolved yet
    fake._current_platform = types.SimpleNamespace(device_type="")  # type: ignore[attr-defined]
    assert "VLLM_TARGET_DEVICE=cpu" in (environment.resolved_too_early() or "")
    fake._current_platform = types.SimpleNamespace(device_type="cpu")  # type: ignore[attr-defined]
    assert environment.resolved_too_early() is None
