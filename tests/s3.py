"""A local S3-compatible store for the tests: moto's server on 127.0.0.1 (started and stopped
by the fixture), behind a TCP proxy the test can take down and bring back (an endpoint that
goes away mid-run, its state kept)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


class Proxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``down()`` drops every connection and
    refuses new ones until ``up()``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.is_up = True
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.is_up:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def down(self) -> None:
        self.is_up = False
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()

    def up(self) -> None:
        self.is_up = True

    def close(self) -> None:
        self._stop = True
        self.down()
        self.listener.close()


@dataclass
class Store:
    bucket: str
    endpoint: str
    """What clients use (through the proxy)."""
    direct: str
    """moto itself (for the test's own checks while the proxy is down)."""
    proxy: Proxy

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self) -> Any:
        """A boto3 client of moto itself (not through the proxy)."""
        return _client(self.direct)

    def keys(self, prefix: str) -> list[str]:
        out = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in out.get("Contents", []))


def _client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


@contextlib.contextmanager
def local_store(tmp: Path) -> Iterator[tuple[Store, dict[str, str]]]:
    """moto on 127.0.0.1 with one bucket ``traces`` and the proxy in front; the environment a
    client needs (the AWS variables, keytrace's spool and cache under ``tmp``)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = Proxy((host, port))
    direct = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
        "KEYTRACE_SPOOL_DIR": str(tmp / "spool"),
        "KEYTRACE_CACHE_DIR": str(tmp / "cache"),
    }
    try:
        _client(direct).create_bucket(Bucket="traces")
        yield Store("traces", env["AWS_ENDPOINT_URL"], direct, proxy), env
    finally:
        proxy.close()
        server.stop()


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """`local_store`, its environment set for the test."""
    with local_store(tmp_path) as (store, env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield store
