"""pytest plugin for vLLM developers: ``pytest --keytrace DIR`` records every offloading
scheduler each test builds, one trace folder per test.

Registered as a ``pytest11`` entry point, so it loads in every pytest session where keytrace
is installed, and it is inert unless ``--keytrace`` is given: without the flag it adds one
option and nothing else (no import of vLLM or of keytrace's recorder). With it:

- recording is installed for the session (`keytrace.vllm.hook.patches.install`: the same
  patch table and transparent wrappers as in a server, ``KEYTRACE_INJECT``/``KEYTRACE_FIX``
  honoured; no alarm);
- each test's schedulers record under ``DIR/<node id>`` (`folder_name`). When the test
  ends, the recorders of its schedulers that are gone are closed (the folder is then a
  complete trace); a scheduler that outlives its test (a fixture wider than one test, a
  module global) keeps recording into the folder of the test that built it, is flushed
  there after each test and closed at the end of the session (counted in the summary);
- a failing test that recorded something gets a ``keytrace`` section in its report: the
  diff verdict of its folder and its first mismatch (what ``keytrace diff DIR/<node id>``
  prints first);
- the terminal summary ends with one line: tests recorded, parts written, failing tests'
  verdicts, recorder failures.

With pytest-xdist the workers record (each test's folder as above) and the controller
only says so: report sections are added after a worker has sent its report, so they
show only without ``-n``.

Outcomes are never changed: the recorder's failures are counted, never raised, and the
plugin's own work (closing recorders, diffing a failing test's folder) is caught too.
"""

from __future__ import annotations

import gc
import hashlib
import io
import re
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

OPTION = "--keytrace"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("keytrace", "keytrace: record vLLM offload keys per test")
    group.addoption(
        OPTION,
        metavar="DIR",
        default=None,
        help="Record every OffloadingConnector scheduler each test builds, one trace folder "
        "per test under DIR (named by node id); failing tests get their diff verdict.",
    )


def pytest_configure(config: pytest.Config) -> None:
    directory = config.getoption("keytrace")
    if not directory:
        return
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_XdistController(Path(directory)), "keytrace-session")
        return
    config.pluginmanager.register(KeytraceSession(Path(directory)), "keytrace-session")


class _XdistController:
    """An xdist controller runs no test: it records nothing and says where the workers do."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_line(
            f"keytrace: the xdist workers recorded one trace folder per test under {self.root}"
        )


def folder_name(nodeid: str) -> str:
    """A file name for a node id: the test file's name and the test's name and parameters,
    readable, unique (a digest of the full id) and not too long:
    ``tests/v1/.../test_scheduler.py::TestEagle::test_x[a-1]`` is
    ``test_scheduler.py-TestEagle-test_x_a-1-<digest>``."""
    path, sep, rest = nodeid.partition("::")
    short = path.rsplit("/", 1)[-1] + ("::" + rest if sep else "")
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", short.replace("::", "-")).strip("_")[:100]
    return f"{readable}-{hashlib.sha256(nodeid.encode()).hexdigest()[:8]}"


def verdict_section(folder: Path) -> str:
    """The head of ``keytrace diff FOLDER``: the verdict line, the episode counts and the
    first mismatch's evidence (never raises: a trace that cannot be judged says why)."""
    from keytrace.analysis.diff import diff
    from keytrace.format.reader import open_trace
    from keytrace.report.text import render_diff

    if not any(folder.rglob("*.parquet")):
        return "no offloading scheduler recorded in this test"
    try:
        out = io.StringIO()
        render_diff(diff(open_trace(str(folder))), out)
    except Exception as exc:
        return f"trace not judged ({type(exc).__name__}: {exc})"
    lines = out.getvalue().rstrip("\n").splitlines()
    return "\n".join([*lines[:12], f"(keytrace diff {folder})"])


class KeytraceSession:
    """The plugin's state for one pytest session with ``--keytrace DIR``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recording = False
        self.problem = ""
        self.tests = 0
        self.recorded = 0
        self.parts = 0
        self.failures = 0
        self.failing: dict[str, str] = {}
        self.failing_untraced = 0
        self.outliving: list[Any] = []
        self.errors: list[str] = []

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        try:
            from keytrace.vllm.hook import patches

            self.root.mkdir(parents=True, exist_ok=True)
            patches.inject_from_env()  # KEYTRACE_INJECT / KEYTRACE_FIX, as in a server
            patches.fix_from_env()
            self.recording = patches.install(self.root / "_session")
            if not self.recording:
                self.problem = "; ".join(patches.missing_hooks("record")) or "see the warning"
        except Exception as exc:
            self.problem = f"{type(exc).__name__}: {exc}"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, None]:
        if not self.recording:
            yield
            return
        from keytrace.vllm.hook import patches

        folder = self.root / folder_name(item.nodeid)
        patches.retarget(folder)
        self.tests += 1
        yield
        self._finish(item, folder)

    def _finish(self, item: pytest.Item, folder: Path) -> None:
        from keytrace.vllm.hook import patches

        try:
            self._settle(patches.take_recorders())
            for rec in self.outliving:
                rec.flush()
            parts = len(list(folder.rglob("*.parquet"))) if folder.exists() else 0
            self.parts += parts
            self.recorded += bool(parts)
            reports = item.stash.get(_FAILED, [])
            if reports and not parts:
                self.failing_untraced += 1
            elif reports:
                section = verdict_section(folder)
                self.failing[item.nodeid] = section.splitlines()[0]
                for rep in reports:
                    rep.sections.append(("keytrace", section))
        except Exception as exc:  # the plugin never changes an outcome
            self.errors.append(f"{item.nodeid}: {type(exc).__name__}: {exc}")

    def _settle(self, recs: list[Any]) -> None:
        """Close the recorders whose scheduler is gone; keep the others recording."""
        if not recs:
            return
        from keytrace.vllm.hook import hooks

        gc.collect()  # a test's scheduler is usually garbage by now, in a reference cycle
        alive = {id(r) for r in list(hooks.RECORDERS.values())}
        for rec in recs:
            if id(rec) in alive:
                self.outliving.append(rec)
            else:
                rec.close()
                self.failures += rec.failures

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        if outcome.excinfo is not None:  # another plugin's hook raised: pytest reports it
            return
        rep = outcome.get_result()
        if self.recording and rep.failed:
            item.stash.setdefault(_FAILED, []).append(rep)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_line(self.summary_line())
        for nodeid, verdict in self.failing.items():
            terminalreporter.write_line(f"keytrace:   {nodeid}: {verdict}")
        for error in self.errors[:5]:
            terminalreporter.write_line(f"keytrace: plugin error (outcome unchanged): {error}")

    def summary_line(self) -> str:
        if not self.recording:
            return f"keytrace: not recording ({self.problem})"
        verdicts: dict[str, int] = {}
        for v in self.failing.values():
            word = v.split(":")[0] if v.split(":")[0].isupper() else "not judged"
            verdicts[word] = verdicts.get(word, 0) + 1
        failing = ", ".join(f"{n} {w}" for w, n in sorted(verdicts.items()))
        outliving = (
            f"; {len(self.outliving)} scheduler(s) outlived their test" if self.outliving else ""
        )
        untraced = (
            f"; {self.failing_untraced} failing test(s) recorded nothing"
            if self.failing_untraced
            else ""
        )
        return (
            f"keytrace: {self.recorded} of {self.tests} tests recorded a trace under "
            f"{self.root} ({self.parts} parts, {self.failures} recorder failures); "
            f"{len(self.failing)} failing test(s) diffed"
            + (f": {failing}" if failing else "")
            + untraced
            + outliving
        )

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.recording:
            from keytrace.vllm.hook import patches

            for rec in self.outliving:
                rec.close()
            patches.uninstall()
            self.recording = False


_FAILED = pytest.StashKey[list[Any]]()
"""A test's failed reports (setup, call or teardown), for their keytrace section."""
