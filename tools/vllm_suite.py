"""vLLM's own offloading-connector suite, without and with keytrace recording: same results?

    python tools/vllm_suite.py [--version 0.33.0] [--record env|plugin] [--cache DIR]
                               [--keep DIR] [--fix NAME]

``--version`` other than the installed vLLM runs that release's suite on that release's
own Python code: its sdist's ``vllm/`` first on ``PYTHONPATH``, over the installed
dependencies (`vllm_sdist.release_tree`); each run checks that ``import vllm`` is that
code before any test runs.

Runs ``tests/v1/kv_connector/unit/offloading_connector/`` and the tiered manager's
``tests/v1/kv_offload/tiering/test_tiering_offloading.py`` from vLLM's sdist (see
``tools/vllm_sdist.py``: `SUITES`) twice, on a CPU, offline:

1. plain: keytrace installed but inert (``KEYTRACE_DIR`` unset);
2. recording, ``--record env`` (default): vLLM's ``load_general_plugins()`` called at
   session start (what every vLLM engine process does), with ``KEYTRACE_DIR`` set, so
   keytrace's vLLM plugin patches vLLM and records every scheduler the suite builds from
   real configs; ``--record plugin``: keytrace's pytest plugin, ``pytest --keytrace DIR``
   (one trace folder per test), as a vLLM developer runs it.

Prints both results, the per-test differences and the number of parts written. Exit 0
only when every test has the same outcome in both runs and recording wrote parts; 1
otherwise. ``.ci/run`` runs it.

``--lab-platform`` runs both passes with keytrace's lab-only platform row: vLLM 0.34.0
refuses an x86 CPU without triton-cpu while building any ``VllmConfig``, so without it
every test that builds one fails, with or without keytrace, and nothing records.

``--fix NAME`` records with a candidate fix applied (``KEYTRACE_FIX``): which of vLLM's own
tests does the fix change? (Evidence for an upstream report, not a transparency check.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_sdist import DEFAULT_CACHE, DEFAULT_VERSION, SUITES, hf_home, release_tree

LOADER = '''\
"""pytest plugin: load vLLM's general plugins once, as every vLLM engine process does."""


def pytest_configure(config):
    from vllm.plugins import load_general_plugins

    load_general_plugins()
'''

CHECKER = '''\
"""pytest plugin: refuse to run unless ``import vllm`` is the code under test."""
import os


def pytest_configure(config):
    import vllm

    from packaging.version import Version

    want_version, want_root = os.environ["KEYTRACE_SUITE_VLLM"].split("@", 1)
    where = os.path.dirname(vllm.__file__)
    same = Version(vllm.__version__).public == Version(want_version).public  # +cpu: same code
    if not same or (want_root and not where.startswith(want_root)):
        raise SystemExit(f"vllm_suite: imported vLLM {vllm.__version__} from {where}")
'''


LAB_PLATFORM = '''\
"""pytest plugin: keytrace's lab-only platform row for the whole session.

vLLM 0.34.0 refuses an x86 CPU without triton-cpu while it builds a VllmConfig; a CPU
scheduler test runs no kernel, so the lab's row (keytrace.vllm.hook.patches.lab_platform)
lets the check run as if Triton were installed. Loaded in both runs, with and without
recording, so that the comparison is of recording alone.
"""

_BLOCK = None


def pytest_configure(config):
    global _BLOCK
    from keytrace.vllm.hook import patches

    _BLOCK = patches.lab_platform()
    _BLOCK.__enter__()


def pytest_unconfigure(config):
    if _BLOCK is not None:
        _BLOCK.__exit__(None, None, None)
'''


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped, from a JUnit XML report."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        for kind in ("failure", "error", "skipped"):
            if kind in kinds:
                result[test_id] = {"failure": "failed"}.get(kind, kind)
                break
        else:
            result[test_id] = "passed"
    return result


def run_suites(
    tree: Path,
    home: Path,
    work: Path,
    record_dir: Path | None,
    fix: str | None = None,
    expect: tuple[str, Path | None] = ("", None),
    via: str = "env",
    lab_platform: bool = False,
) -> tuple[dict[str, str], float]:
    """Every suite of `SUITES`, one pytest each (each has its own conftest root).
    ``expect``: the vLLM version each run must import, and the folder it must come from
    (None: as installed)."""
    results: dict[str, str] = {}
    total = 0.0
    for suite, confcutdir in SUITES:
        found, seconds = run_suite(
            tree, home, work, suite, confcutdir, record_dir, fix, expect, via, lab_platform
        )
        results.update(found)
        total += seconds
    return results, total


def run_suite(
    tree: Path,
    home: Path,
    work: Path,
    suite: str,
    confcutdir: str,
    record_dir: Path | None,
    fix: str | None = None,
    expect: tuple[str, Path | None] = ("", None),
    via: str = "env",
    lab_platform: bool = False,
) -> tuple[dict[str, str], float]:
    if not (tree / suite).exists():
        raise SystemExit(f"vllm_suite: {suite} is not in vLLM {expect[0] or '?'}'s sdist")
    junit = work / f"{'recording' if record_dir else 'plain'}-{Path(suite).stem}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", HF_HOME=str(home))
    version, overlay = expect
    paths = [str(work)] + ([str(overlay)] if overlay else [])
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["KEYTRACE_SUITE_VLLM"] = f"{version}@{overlay / 'vllm' if overlay else ''}"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        suite,
        f"--confcutdir={confcutdir}",
        "-q",
        "-p",
        "no:cacheprovider",
        # a RuntimeWarning from keytrace must show up as a changed outcome
        "-W",
        "error::RuntimeWarning",
        f"--junitxml={junit}",
        "-p",
        "keytrace_suite_checker",
    ]
    if lab_platform:
        cmd += ["-p", "keytrace_suite_lab"]
    if record_dir is not None and via == "plugin":
        if fix:
            env["KEYTRACE_FIX"] = fix  # read when the plugin installs recording
        cmd += ["--keytrace", str(record_dir / Path(suite).stem)]
    elif record_dir is not None:
        env["KEYTRACE_DIR"] = str(record_dir)
        if fix:
            env["KEYTRACE_FIX"] = fix
        cmd += ["-p", "keytrace_suite_loader"]
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t
    # 0 passed, 1 some failed (compared below); anything else (no tests, usage error,
    # internal error, interrupted) means the run did not happen as asked
    if not junit.exists() or proc.returncode not in (0, 1):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"vllm_suite: pytest on {suite} failed to run (exit {proc.returncode})")
    return outcomes(junit), seconds


def summary(result: dict[str, str]) -> str:
    counts = Counter(result.values())
    return ", ".join(
        f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--keep", type=Path, default=None, help="Keep the recorded trace here.")
    ap.add_argument("--fix", default=None, help="Record with this candidate fix applied.")
    ap.add_argument(
        "--record",
        choices=("env", "plugin"),
        default="env",
        help="How to record: KEYTRACE_DIR with vLLM's plugin loader (a server's way), or "
        "keytrace's pytest plugin (pytest --keytrace DIR).",
    )
    ap.add_argument(
        "--lab-platform",
        action="store_true",
        help="Run both passes with keytrace's lab-only platform row (vLLM 0.34.0 refuses an "
        "x86 CPU without triton-cpu while building a config; its scheduler tests need none).",
    )
    args = ap.parse_args()

    t = time.monotonic()
    tree, overlaid = release_tree(args.version, args.cache)
    home = hf_home(args.cache)
    t_tree = time.monotonic() - t
    expect = (args.version, tree if overlaid else None)
    with tempfile.TemporaryDirectory(prefix="keytrace-vllm-suite-") as tmp:
        work = Path(tmp)
        (work / "keytrace_suite_loader.py").write_text(LOADER)
        (work / "keytrace_suite_checker.py").write_text(CHECKER)
        (work / "keytrace_suite_lab.py").write_text(LAB_PLATFORM)
        record_dir = args.keep or work / "trace"
        lab = args.lab_platform
        plain, t_plain = run_suites(tree, home, work, None, None, expect, lab_platform=lab)
        recorded, t_rec = run_suites(
            tree, home, work, record_dir, args.fix, expect, args.record, lab_platform=lab
        )
        parts = sorted(record_dir.rglob("*.parquet")) if record_dir.exists() else []

    code = f"its own Python code from the sdist ({tree / 'vllm'})" if overlaid else "as installed"
    print(f"vLLM {args.version} {' and '.join(suite for suite, _ in SUITES)}")
    print(f"  vLLM code: {code}; tree ready in {t_tree:.1f} s")
    if lab:
        print("  both passes with keytrace's lab-only platform row (no Triton check on x86)")
    print(f"  without keytrace:        {summary(plain)}  ({t_plain:.0f} s)")
    how = "KEYTRACE_DIR" if args.record == "env" else "pytest --keytrace"
    label = f"recording ({how}), fix {args.fix}" if args.fix else f"recording ({how})"
    print(f"  {label}: {summary(recorded)}  ({t_rec:.0f} s)")
    print(f"  parts written while recording: {len(parts)}")
    differ = sorted(t for t in plain.keys() | recorded.keys() if plain.get(t) != recorded.get(t))
    for t in differ[:20]:
        print(f"  DIFFERS {t}: {plain.get(t, 'absent')} -> {recorded.get(t, 'absent')}")
    if len(differ) > 20:
        print(f"  ... {len(differ) - 20} more")
    ok = not differ and bool(plain) and bool(parts)
    print(
        "identical results, parts written" if ok else "FAIL: results differ or nothing was recorded"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
