"""`pip install keytrace` with no extras, as a person who analyses a trace copied off a
server would have it: a fresh venv without vLLM, torch or any extra.

    python tools/check_core_install.py [--venv DIR] [--tests]

Installs this checkout (not editable: the package as built, templates included) into a new
venv, then from a scratch directory runs the installed ``keytrace`` on the committed traces
(``diff``, ``summary``, ``header``, ``compact`` and a diff of the compacted files), ``--help``
of every command, and each command that needs vLLM, which must say so in one line and exit
2. Every output is checked for a traceback. ``--tests`` also runs ``tests/unit`` (which
never imports vLLM) in that venv, with only the test tools added (pytest, Hypothesis,
DuckDB, ruff). Exit status: 0 when all of it holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCE = (".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "mutants")
TEST_TOOLS = ("pytest>=8", "hypothesis>=6.100", "duckdb>=1.0", "ruff>=0.5", "moto[server]>=5.2.5")
NEEDS_VLLM = {
    # command line -> what it must say
    "demo --out {tmp}/demo": "pip install 'keytrace[vllm]'",
    "replay {v2}": "pip install 'keytrace[vllm]'",
    "workload --conversations 1": "pip install 'keytrace[vllm]'",
    "sweep --lengths 1000:1002": "pip install 'keytrace[vllm]'",
    "minimize {v2} -o {tmp}/min": "pip install 'keytrace[vllm]'",
    "report {v2} -o {tmp}/report": "pip install 'keytrace[vllm]'",
    "fuzz -o {tmp}/fuzz --max-examples 1": "pip install 'keytrace[fuzz]'",
}


def run(cmd: list[str], cwd: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def check_cli(venv: Path) -> list[str]:
    """Every command of the installed CLI, from a scratch directory; the problems found."""
    keytrace = str(venv / "bin" / "keytrace")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYTRACE_")}
    env.pop("PYTHONPATH", None)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="keytrace-core-") as tmp:
        v1 = " ".join(str(p) for p in sorted((ROOT / "tests/data/v1").glob("*.parquet")))
        v2 = str(ROOT / "tests/data/v2")
        v3 = str(ROOT / "tests/data/v3")
        expect = {  # command line -> exit code
            f"diff {v2}": 1,
            f"diff {v1}": 1,
            f"diff {v3} --all": 1,
            f"diff {v2} --all --json": 1,
            f"summary {v2}": 0,
            f"header {v2}": 0,
            f"compact {v2} -o {tmp}/c": 0,
            f"diff {tmp}/c/store.parquet {tmp}/c/lookup.parquet": 1,
            "--help": 0,
            "--version": 0,
        }
        listed = run([keytrace, "--help"], tmp, env).stdout
        commands = [
            line.split()[0]
            for line in listed.split("Commands:", 1)[-1].splitlines()
            if line.startswith("  ") and line.strip()
        ]
        if len(commands) < 10:
            problems.append(f"keytrace --help lists {len(commands)} commands: {listed!r}")
        expect.update({f"{c} --help": 0 for c in commands})
        for line, code in expect.items():
            r = run([keytrace, *line.split()], tmp, env)
            if r.returncode != code or "Traceback" in r.stderr:
                problems.append(f"keytrace {line}: exit {r.returncode} (want {code}) {r.stderr}")
        for line, says in NEEDS_VLLM.items():
            r = run([keytrace, *line.format(tmp=tmp, v2=v2).split()], tmp, env)
            lines = r.stderr.strip().splitlines()
            if r.returncode != 2 or len(lines) != 1 or says not in r.stderr:
                problems.append(f"keytrace {line}: exit {r.returncode}, stderr {r.stderr!r}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--venv", help="where to make the venv [default: a temporary folder]")
    ap.add_argument("--tests", action="store_true", help="also run tests/unit in it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="keytrace-core-venv-") as scratch:
        venv = Path(args.venv or os.path.join(scratch, "venv"))
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        pip += ["--disable-pip-version-check"]
        with tempfile.TemporaryDirectory(prefix="keytrace-wheel-") as wheels:
            # a wheel built from a copy of the checkout (setuptools writes build/ into the
            # tree it builds): what `pip install keytrace` would install
            src = os.path.join(wheels, "src")
            shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
            subprocess.run(
                [*pip[:3], "wheel", "--quiet", "--no-deps", "-w", wheels, src], check=True
            )
            wheel = next(Path(wheels).glob("keytrace-*.whl"))
            subprocess.run([*pip, str(wheel)], check=True)
        freeze = run(
            [str(venv / "bin" / "python"), "-m", "pip", "freeze"], scratch, dict(os.environ)
        )
        heavy = [p for p in ("vllm", "torch", "matplotlib") if p in freeze.stdout.lower()]
        problems = [f"the core install pulled in {', '.join(heavy)}"] if heavy else []
        problems += check_cli(venv)
        print(f"core install: {len(freeze.stdout.splitlines())} packages; CLI checked")
        if args.tests and not problems:
            subprocess.run([*pip, *TEST_TOOLS], check=True)
            env = {k: v for k, v in os.environ.items() if k != "KEYTRACE_REQUIRE_VLLM"}
            r = subprocess.run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/unit",
                ],
                cwd=ROOT,
                env=env,
            )
            if r.returncode != 0:
                problems.append(f"tests/unit in the core venv: pytest exit {r.returncode}")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
