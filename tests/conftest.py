from __future__ import annotations

import os

import pytest

# What vLLM needs on a CPU-only machine, set where the lab sets it for every user (importing
# keytrace.vllm.lab: keytrace/vllm/lab/environment.py), before any test imports vLLM. Tests
# of a user's clean environment run commands in a fresh interpreter (tests/isolation.py).
import keytrace.vllm.lab  # noqa: F401
from tests.s3 import s3  # noqa: F401  (fixture: a local S3-compatible store, tests/s3.py)

# Property tests draw the same examples on every run by default (``derandomize``), so a
# submission's CI and a user's README run cannot fail on a draw the last run never made;
# ``--hypothesis-profile=explore`` draws fresh ones to hunt for new counterexamples (a
# failure prints the example and a ``@reproduce_failure`` blob: pin it as a plain test).
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("default", derandomize=True, print_blob=True)
    _hypothesis_settings.register_profile("explore", derandomize=False, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # the core venv's run of tests/unit without the fuzz extra
    pass

REQUIRE_VLLM = os.environ.get("KEYTRACE_REQUIRE_VLLM") == "1"


def require_vllm() -> None:
    """Skip when vLLM is missing, unless KEYTRACE_REQUIRE_VLLM=1 turns that into a failure."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        if REQUIRE_VLLM:
            pytest.fail(f"vLLM is required (KEYTRACE_REQUIRE_VLLM=1) but not importable: {exc}")
        pytest.skip(f"vLLM not importable: {exc}")


REQUIRE_BROWSER = os.environ.get("KEYTRACE_REQUIRE_BROWSER") == "1"


def chromium_path() -> str:
    """The system Chromium binary for browser tests (Debian's ``chromium`` package), driven by
    Playwright; skip without it, unless KEYTRACE_REQUIRE_BROWSER=1 makes that a failure."""
    import shutil

    problem = None
    try:
        import playwright.sync_api  # noqa: F401
    except Exception as exc:
        problem = f"playwright not importable: {exc}"
    # Debian's /usr/bin/chromium is a shell wrapper; the binary itself is under /usr/lib
    found = os.environ.get("KEYTRACE_CHROMIUM") or next(
        (
            p
            for p in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "")
            if p and os.path.exists(p)
        ),
        None,
    )
    if found is None:
        problem = problem or "no chromium binary (apt-get install chromium)"
    if problem:
        if REQUIRE_BROWSER:
            pytest.fail(f"a browser is required (KEYTRACE_REQUIRE_BROWSER=1): {problem}")
        pytest.skip(problem)
    assert found is not None
    return found


REQUIRE_PROMTOOL = os.environ.get("KEYTRACE_REQUIRE_PROMTOOL") == "1"


def promtool_path() -> str:
    """Prometheus' ``promtool`` (Debian's ``prometheus`` package) for the alert-rule tests;
    skip without it, unless KEYTRACE_REQUIRE_PROMTOOL=1 makes that a failure."""
    import shutil

    found = shutil.which("promtool")
    if found is None:
        if REQUIRE_PROMTOOL:
            pytest.fail(
                "promtool is required (KEYTRACE_REQUIRE_PROMTOOL=1): apt-get install prometheus"
            )
        pytest.skip("no promtool (apt-get install prometheus)")
    return found
