"""The standalone vLLM regression's text: deterministic, literal geometry, vLLM-only imports,
formatted as vLLM formats code (ruff, line length 88); for recurrent geometries the
scheduler-driving test, or a refusal that names what it would not rebuild. Running them
inside vLLM's own test trees is tests/integration/test_standalone_regression.py and
tests/integration/test_standalone_recurrent.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keytrace.analysis.geometry import NEMOTRON_H, RECURRENT, RECURRENT_MTP, GroupGeom
from keytrace.analysis.plan import ReplayPlan, plan_from_trace
from keytrace.format.reader import open_trace
from keytrace.report.standalone import regression_name, render_vllm_regression, unsupported
from tests.unit.test_chunkmap import two_shortfalls


def _text(tmp_path: Path) -> tuple[str, object]:
    plan = plan_from_trace(open_trace(str(two_shortfalls(tmp_path / "t"))))
    return render_vllm_regression(plan, evidence="group 1 chunk 4: never offered"), plan


def test_literal_deterministic_and_vllm_only(tmp_path: Path) -> None:
    text, plan = _text(tmp_path)
    again, _ = _text(tmp_path / "again")
    assert text == again
    assert regression_name(plan, text) == regression_name(plan, again)
    assert "GROUPS = [\n    (16, None, False),\n    (16, 32, False),\n]" in text
    assert "PRIME_TOKENS = 100\nEPISODE_TOKENS = 100\nEXPECTED_EXTERNAL_TOKENS = 96\n" in text
    imports = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert imports and all(
        ln.split()[1].split(".")[0] in ("types", "unittest", "torch", "vllm") for ln in imports
    )
    compile(text, "t.py", "exec")


def test_formatted_as_vllm_formats_code(tmp_path: Path) -> None:
    text, _ = _text(tmp_path)
    _ruff_format_check(text)


def _recurrent_plan(geometry: Any, **changes: Any) -> ReplayPlan:
    """A plan of the recorded 760-token resend on ``geometry`` (chunks of two blocks: vLLM
    loads 0, E = 640), as `plan_from_trace` writes it."""
    fields: dict[str, Any] = dict(
        geometry=geometry.to_dict(),
        prime_lengths=[760],
        episode_length=760,
        local_tokens=0,
        expected_E=640,
        recorded_external=0,
        recorded_verdict="mismatch",
        binding_group=0,
        terminal_chunk=4,
        cause="no_checkpoint",
        request="r2",
        keytrace_version="0.1.0",
        vllm_version="0.33.0",
    )
    fields.update(changes)
    return ReplayPlan(**fields)


def test_recurrent_plans_get_the_scheduler_test_literal_and_vllm_only() -> None:
    plan = _recurrent_plan(RECURRENT.with_(blocks_per_chunk=2))
    assert unsupported(plan) is None
    text = render_vllm_regression(plan, evidence="group 0 chunk 4: no_checkpoint")
    assert text == render_vllm_regression(
        _recurrent_plan(RECURRENT.with_(blocks_per_chunk=2)),
        evidence="group 0 chunk 4: no_checkpoint",
    )
    assert (
        "GROUPS = [\n"
        + '    ("mamba", 64, None),\n' * 3
        + '    ("full_attention", 64, None),\n]\nBLOCKS_PER_CHUNK = 2\n'
    ) in text
    assert "PRIME_TOKENS = [760]\nEPISODE_TOKENS = 760\nEXPECTED_EXTERNAL_TOKENS = 640\n" in text
    assert "Scheduler(" in text and "MambaSpec(" in text
    assert 'assert answered["episode"] >= EXPECTED_EXTERNAL_TOKENS' in text
    imports = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert imports and all(
        ln.split()[1].split(".")[0] in ("dataclasses", "json", "torch", "vllm") for ln in imports
    )
    assert regression_name(plan, text).startswith("test_offload_regression_760_")
    compile(text, "t.py", "exec")
    _ruff_format_check(text)


def test_recurrent_geometry_literals_follow_the_plan() -> None:
    dcp = _recurrent_plan(RECURRENT.with_(dcp=2, max_num_batched_tokens=128))
    text = render_vllm_regression(dcp)
    assert "DECODE_CONTEXT_PARALLEL_SIZE = 2\nMAX_NUM_BATCHED_TOKENS = 128\n" in text
    assert "DCP 2" in text  # the docstring names the geometry
    checkpoints = render_vllm_regression(_recurrent_plan(NEMOTRON_H.with_(prefix_match_unit=16)))
    assert '    ("mamba", 64, 1),\n' in checkpoints and "PREFIX_MATCH_UNIT = 16\n" in checkpoints
    chain = render_vllm_regression(_recurrent_plan(RECURRENT, prime_lengths=[300, 700]))
    assert "PRIME_TOKENS = [300, 700]\n" in chain and "Prompts of 300, 700 tokens" in chain


def test_recurrent_settings_the_test_does_not_build_are_refused_by_name() -> None:
    tiers = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "example"}]}
    cases = {
        "a speculative drafter": RECURRENT_MTP,
        "retention interval 128": RECURRENT.with_(retention_interval=128),
        "a tiered manager": RECURRENT.with_(extra=tiers),
        "group kinds sliding_window": RECURRENT.with_(
            groups=(*RECURRENT.groups, GroupGeom("sliding_window", 64, sliding_window=128))
        ),
        "asynchronous scheduling": RECURRENT.with_(async_scheduling=True),
    }
    for reason, geometry in cases.items():
        plan = _recurrent_plan(geometry)
        why = unsupported(plan)
        assert why is not None and reason in why, (reason, why)
        with pytest.raises(ValueError, match="no vLLM-only test"):
            render_vllm_regression(plan)
    limits = [{"max_load_tokens": None, "max_offload_tokens": 100, "skip_reading_kv": False}]
    why = unsupported(_recurrent_plan(RECURRENT, request_limits=limits * 2))
    assert why is not None and "kv_transfer_params" in why


def _ruff_format_check(text: str) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "--line-length",
            "88",
            "--stdin-filename",
            "t.py",
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
