"""``keytrace diff --ray``: the per-engine judgements as Ray tasks on a local Ray cluster the
test starts (two CPUs), byte-identical to this process's differ: on a generated trace of
50 engines with routing between them, on workloads recorded from the real vLLM scheduler
(two engines with rerouting, a tiered manager over an ``fs`` tier), and with a worker
killed in the middle of a task (Ray retries it)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from keytrace.analysis.diff import diff
from keytrace.analysis.fleet import by_engine
from keytrace.analysis.results import DiffReport
from keytrace.analysis.runners import RayRunner
from keytrace.format.reader import open_trace
from keytrace.report.jsonout import write_json
from keytrace.report.text import render_diff, render_fleet
from tests.generated import fleet_trace

REQUIRE_RAY = os.environ.get("KEYTRACE_REQUIRE_RAY") == "1"
ENGINES = 50

try:
    import ray
except ImportError as exc:  # pragma: no cover - depends on the environment
    if REQUIRE_RAY:
        raise RuntimeError(f"Ray is required (KEYTRACE_REQUIRE_RAY=1): {exc}") from exc
    pytest.skip(f"Ray not importable: {exc}", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster of two CPUs for this module, shut down after it."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=200 * 1024 * 1024,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fleet_trace(
        tmp_path_factory.mktemp("fleet") / "trace",
        rows=250_000,
        engines=ENGINES,
        planted=3,
        seed=5,
        misroute=0.2,
    )


def _outputs(report: DiffReport) -> dict[str, str]:
    """Every form a report is read in: JSON, the text report, the fleet table and JSON."""
    out = {}
    for name, write in (
        ("json", lambda f: write_json(report, f)),
        ("text", lambda f: render_diff(report, f)),
        ("fleet", lambda f: render_fleet(by_engine(report), f)),
        ("fleet json", lambda f: write_json(by_engine(report), f)),
    ):
        buf = io.StringIO()
        write(buf)
        out[name] = buf.getvalue()
    return out


def test_ray_is_byte_identical_on_a_fleet_of_50_engines(cluster: None, fleet: Path) -> None:
    trace = open_trace(str(fleet))
    assert len(trace.instances()) == ENGINES
    here = diff(trace, all_episodes=True)
    assert here.lost is not None and any(
        r.category == "cold_routing" and r.tokens for r in here.lost.rows
    )
    assert here.counts.get("mismatch") == 3
    on_ray = diff(trace, all_episodes=True, runner=RayRunner())
    assert _outputs(on_ray) == _outputs(here)
    each = diff(trace, all_episodes=True, runner=RayRunner(), partitions=ENGINES)
    assert _outputs(each) == _outputs(here)
    shortfalls = diff(trace, runner=RayRunner())
    assert _outputs(shortfalls) == _outputs(diff(trace))


class _KillFirst:
    """Kills the worker running the first task that calls it (a marker file, created
    exclusively, says it already happened): Ray must retry that task elsewhere."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self) -> None:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_run_is_retried_and_the_report_is_the_same(
    cluster: None, fleet: Path, tmp_path: Path
) -> None:
    trace = open_trace(str(fleet))
    marker = tmp_path / "killed"
    report = diff(trace, all_episodes=True, runner=RayRunner(before_each=_KillFirst(str(marker))))
    assert marker.exists()  # a worker did die
    assert int(marker.read_text()) != os.getpid()
    assert _outputs(report) == _outputs(diff(trace, all_episodes=True))


def _fails(_x: int, _shared: None) -> None:
    from keytrace.errors import TraceError

    raise TraceError("part x.parquet: torn")


def test_an_error_in_a_task_is_the_error_itself(cluster: None) -> None:
    """Not Ray's wrapper with its remote traceback: the CLI says one line."""
    from keytrace.errors import TraceError

    with pytest.raises(TraceError) as got:
        RayRunner().map(_fails, [(1,)], None)
    assert str(got.value) == "part x.parquet: torn"


def test_the_cli_runs_on_ray_and_says_the_same(fleet: Path) -> None:
    """``keytrace diff --ray TRACE`` in a fresh process (it starts its own local Ray: the
    trace right after --ray is a TRACE, not an address)."""

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "keytrace", "diff", "--json", "--by", "engine", *extra],
            capture_output=True,
            text=True,
        )

    local = run(str(fleet))
    remote = run("--ray", str(fleet))
    assert local.returncode == remote.returncode == 1, remote.stderr
    assert remote.stdout == local.stdout
    both = run("--ray", "--jobs", "2", str(fleet))
    assert both.returncode == 2 and "give one of them" in both.stderr


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("geometry", "seed", "tiers", "cpu", "inject"),
    [
        ("small", 21, (), 32, None),
        ("dsv4", 21, (), 64, None),
        ("small", 11, (), None, "no_eagle_plus1"),
        ("small", 1, ("fs",), 24, None),
    ],
)
def test_ray_is_byte_identical_on_recorded_workloads(
    cluster: None,
    tmp_path: Path,
    geometry: str,
    seed: int,
    tiers: tuple[str, ...],
    cpu: int | None,
    inject: str | None,
) -> None:
    """Traces of the real vLLM scheduler on two engines with rerouting (and one tiered)."""
    from tests.conftest import require_vllm

    require_vllm()
    import dataclasses

    from keytrace.vllm.lab.workload import WorkloadSpec, run_workload

    spec = WorkloadSpec(geometry=geometry, seed=seed, inject=inject, tiers=tiers)
    if cpu is not None:
        spec = dataclasses.replace(spec, cpu_chunks=cpu, reroute_rate=0.4)
    d = str(tmp_path / "trace")
    run_workload(spec, d)
    trace = open_trace(d)
    assert len(trace.instances()) == 2
    here = diff(trace, all_episodes=True)
    assert sum(here.counts.values()) > 0
    assert _outputs(diff(trace, all_episodes=True, runner=RayRunner(), partitions=2)) == _outputs(
        here
    )
