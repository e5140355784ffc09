"""Run the README's two commands as a new user does: fresh clone, fresh venv, nothing exported.

    python tools/readme_commands.py [--workdir DIR] [--allow-skip REGEX]...

The README starts with exactly two commands (its first ``bash`` block): one installs
keytrace and runs ``keytrace demo``, one runs the tests. A user runs them in a new clone, in
a new virtual environment, from a shell that exported nothing: no ``VLLM_TARGET_DEVICE``,
no ``HF_HUB_OFFLINE``, no ``PYTHONHASHSEED``, none of CI's own flags. This tool does exactly
that (``git clone`` of this checkout's HEAD, ``python3 -m venv``, each command under
``env -i PATH=... HOME=...`` after activating the venv) and fails if either command fails.

A test that skips where a user's machine lacks something still passes for the user; CI
wants every test to run, so a skip fails here too unless its reason matches an
``--allow-skip`` pattern (an opt-in test, such as the served end-to-end test that builds a
second vLLM environment; ``.ci/run`` runs it afterwards with its opt-in set).

Prints the clone and the venv last (``CLONE=...``, ``VENV=...``), so ``.ci/run`` can run the
rest of CI in the very environment the README built.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(readme: Path) -> list[str]:
    """The commands of the README's first ``bash`` block (it must hold exactly two)."""
    text = readme.read_text()
    m = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S)
    if m is None:
        raise SystemExit("readme_commands: README.md has no ```bash block")
    lines = [ln.strip() for ln in m.group(1).splitlines() if ln.strip()]
    if len(lines) != 2:
        raise SystemExit(
            f"readme_commands: the README's first block holds {len(lines)} commands, not 2"
        )
    return lines


def clean_shell(cmd: str, cwd: Path, venv: Path) -> list[str]:
    """``cmd`` in bash under ``env -i`` (PATH and HOME only) with ``venv`` activated."""
    script = f". {shlex.quote(str(venv / 'bin' / 'activate'))} && {cmd}"
    return [
        "env",
        "-i",
        f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}",
        f"HOME={os.environ.get('HOME', str(cwd))}",
        "bash",
        "-c",
        script,
    ]


def run(cmd: str, cwd: Path, venv: Path) -> str:
    """Run one README command, echoing its output as it comes; its output, or exit."""
    print(f"$ {cmd}", flush=True)
    proc = subprocess.Popen(
        clean_shell(cmd, cwd, venv),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line)
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"readme_commands: `{cmd}` exited {code} in a clean environment")
    return "".join(out)


SKIPPED = re.compile(r"^SKIPPED \[\d+\] (?P<where>[^:]+):\d+: (?P<why>.*)$", re.M)


def unexpected_skips(output: str, allowed: list[str]) -> list[str]:
    """The ``-ra`` skip lines of a pytest run whose reason matches none of ``allowed``."""
    return [
        m.group(0)
        for m in SKIPPED.finditer(output)
        if not any(re.search(a, m.group("why")) for a in allowed)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--workdir", type=Path, default=None, help="Where to clone [a temp dir].")
    ap.add_argument("--allow-skip", action="append", default=[], metavar="REGEX")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="keytrace-readme-"))
    work.mkdir(parents=True, exist_ok=True)
    clone, venv = work / "keytrace", work / "venv"
    install, tests = readme_commands(ROOT / "README.md")
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    run(install, clone, venv)
    out = run(tests, clone, venv)
    bad = unexpected_skips(out, args.allow_skip)
    if bad:
        print("\n".join(bad))
        raise SystemExit(f"readme_commands: {len(bad)} test(s) skipped that CI must run")
    print(f"CLONE={clone}\nVENV={venv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
