"""What keytrace adds to a server's shutdown: SIGTERM-to-exit of vLLM's engine core, with and
without recording, interleaved, on the CPU `vllm serve` of tools/serve_e2e.py.

    python tools/bench_shutdown.py [--rounds 4] [--shutdown-timeout 10] [--json]

Each round serves twice (recording off, then on, or the other way round on odd rounds: an
order effect cannot pose as keytrace's cost), sends examples/serve/send_prompts.py's traffic,
and SIGTERMs the API server at once after the last response (no settle time: the
recorder's buffers are full, the worst case for keytrace). Measured per run: seconds from
SIGTERM until the engine-core process is gone and until the API server exits, the server's
exit code, whether vLLM logged its own shutdown race (``EngineDeadError`` from
``output_handler``), and with recording, whether `keytrace diff` found the trace complete.

Prints a table with the median, min and max of each mode, the ratio of medians, and the
race's count per mode. Interpret with the spread: one run says nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_e2e import DEFAULT_VENV, ROOT, Server, ensure_venv, traffic


@dataclass
class Shutdown:
    mode: str
    engine_exit_s: float | None
    server_exit_s: float
    server_exit: int
    engine_dead_error: bool
    diff_exit: int | None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    # a zombie is gone for this purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def one(py: Path, work: Path, record: bool, shutdown_timeout: float) -> Shutdown:
    trace = work / "trace" if record else None
    server = Server(py, work, trace, None, ("--shutdown-timeout", f"{shutdown_timeout:g}"))
    server.wait_healthy()
    traffic(server)
    engine = server.engine_pid()
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    engine_at = None
    while server.proc.poll() is None or (engine is not None and engine_at is None):
        if engine is not None and engine_at is None and _gone(engine):
            engine_at = time.monotonic() - t0
        if time.monotonic() - t0 > 180:
            os.killpg(server.proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    server_at = time.monotonic() - t0
    code = server.proc.wait()
    server.log.close()
    log = server.log_path.read_text(errors="replace")
    diff_exit = None
    if trace is not None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        diff_exit = subprocess.run(
            [str(py), "-m", "keytrace.cli", "diff", str(trace)], capture_output=True, env=env
        ).returncode
    region = Path(f"/dev/shm/vllm_offload_{server.engine_id()}.mmap")
    if region.exists():
        region.unlink()
    return Shutdown(
        "on" if record else "off",
        engine_at,
        server_at,
        code,
        "EngineDeadError" in log,
        diff_exit,
    )


def _stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):6.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shutdown-timeout", type=float, default=10.0)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    py = ensure_venv(args.venv.expanduser())
    runs: list[Shutdown] = []
    with tempfile.TemporaryDirectory(prefix="keytrace-shutdown-") as tmp:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for record in order:
                work = Path(tmp) / f"r{r}-{'on' if record else 'off'}"
                work.mkdir()
                runs.append(one(py, work, record, args.shutdown_timeout))
                print(f"round {r + 1}/{args.rounds}: {runs[-1]}", file=sys.stderr)
    if args.json:
        json.dump([asdict(x) for x in runs], sys.stdout, indent=2)
        return 0
    print(f"SIGTERM to exit, --shutdown-timeout {args.shutdown_timeout:g}, {args.rounds} rounds")
    medians = {}
    for mode in ("off", "on"):
        mine = [x for x in runs if x.mode == mode]
        engine = [x.engine_exit_s for x in mine if x.engine_exit_s is not None]
        server = [x.server_exit_s for x in mine]
        medians[mode] = statistics.median(engine) if engine else None
        races = sum(x.engine_dead_error for x in mine)
        diffs = [x.diff_exit for x in mine if x.diff_exit is not None]
        print(
            f"  recording {mode:<3}  engine core {_stats(engine)}  API server {_stats(server)}"
            f"  EngineDeadError {races}/{len(mine)}" + (f"  diff exits {diffs}" if diffs else "")
        )
    if medians["off"] and medians["on"]:
        print(f"  engine-core exit, median on/off: {medians['on'] / medians['off']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
