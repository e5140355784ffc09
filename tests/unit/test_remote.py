"""Traces on object storage (keytrace.format.remote) against a local S3-compatible server
(moto, on 127.0.0.1, started and stopped here): parts go up whole, a store that goes away
mid-run costs nothing but a wait in the spool, a full spool drops and the reader names the
gap, an earlier process's spool is adopted, and every reader command reads ``s3://``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from keytrace.format.keys import make_key
from keytrace.format.reader import open_trace
from keytrace.format.remote import Uploader, finish_uploads, is_remote, public, spool_root
from keytrace.format.schema import LookupResult
from keytrace.record.recorder import Recorder
from tests.s3 import Store

DATA = Path(__file__).resolve().parents[1] / "data"


def _record(directory: str, requests: int = 3) -> Recorder:
    """A recorder with a few store and lookup rows, flushed once per request."""
    rec = Recorder(directory, {"g": 1}, engine_id="e", dp_rank=0, tokens_per_chunk={0: 16})
    for i in range(requests):
        req, k = f"r{i}", make_key(bytes([i]) * 8, 0)
        rec.episode_begin(req, 0, None, 32, 32, 2)
        rec.lookup(k, req, 16, LookupResult.MISS, False)
        rec.episode_end(req, 0, False)
        rec.store_prepared(req, [k], {k: 16}, [k], [], i)
        rec.store_completed(req, [k], {k: 16}, i, True)
        rec.flush()
    return rec


def _wait(cond, timeout: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``cond`` until true (a bound on a hang, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def test_a_file_uri_is_its_local_path() -> None:
    assert open_trace(f"file://{DATA / 'v3'}").rows("store") == open_trace(str(DATA / "v3")).rows(
        "store"
    )


def test_uri_forms() -> None:
    assert is_remote("s3://b/p") and is_remote("gs://b/p") and is_remote("S3://b")
    assert not is_remote("/tmp/x") and not is_remote("file:///tmp/x") and not is_remote("x")
    assert public("s3://key:secret@b/p?endpoint_override=h:1") == "s3://b/p"


def test_parts_go_up_whole_and_read_back(s3: Store) -> None:
    rec = _record(s3.uri("run1"))
    rec.close()
    keys = s3.keys("run1/")
    assert keys and all(k.startswith("run1/kind=") and k.endswith(".parquet") for k in keys)
    assert not any("/." in k or k.endswith(".tmp") for k in keys)  # no temporary object
    trace = open_trace(s3.uri("run1"))
    assert trace.rows("store") == 6 and not trace.incomplete
    assert sorted(trace.collect("store")["req_id"].cast(str).unique().to_list()) == [
        "r0",
        "r1",
        "r2",
    ]
    # the spool is empty once the store has everything
    assert not list(spool_root(s3.uri("run1")).rglob("*.parquet"))


def test_a_store_that_goes_away_mid_run_only_delays_the_upload(s3: Store) -> None:
    uri = s3.uri("flaky")
    rec = _record(uri, requests=1)
    up = rec.writer.uploader
    assert up is not None and _wait(lambda: up.pending() == (0, 0))
    s3.proxy.down()
    for i in range(1, 4):  # recording goes on: parts close into the spool
        req, k = f"late{i}", make_key(bytes([i + 10]) * 8, 0)
        rec.store_prepared(req, [k], {k: 16}, [k], [], i)
        rec.flush()
    assert _wait(lambda: up.stats.failures > 0)
    parts, size = up.pending()
    assert parts >= 3 and size > 0  # waiting, not lost
    assert len(list(up.spool.rglob("*.parquet"))) == parts
    s3.proxy.up()
    assert _wait(lambda: up.pending() == (0, 0))
    rec.close()
    trace = open_trace(uri)
    assert trace.rows("store") == 2 + 3 and not trace.incomplete, trace.warnings


def test_a_full_spool_drops_parts_and_the_reader_names_the_gap(
    s3: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = s3.uri("full")
    monkeypatch.setenv("KEYTRACE_SPOOL_BYTES", "1")  # nothing fits while the store is away
    s3.proxy.down()
    rec = _record(uri, requests=2)
    up = rec.writer.uploader
    assert up is not None and up.stats.dropped_parts >= 2
    assert rec.writer.stats.dropped_parts == up.stats.dropped_parts
    s3.proxy.up()
    monkeypatch.delenv("KEYTRACE_SPOOL_BYTES")
    up.max_bytes = 1 << 30
    req, k = "after", make_key(b"z" * 8, 0)
    rec.store_prepared(req, [k], {k: 16}, [k], [], 9)
    rec.close()
    trace = open_trace(uri)
    assert trace.incomplete  # the dropped flushes are missing generations
    assert any("incomplete trace" in w for w in trace.warnings), trace.warnings


def test_an_earlier_process_spool_is_adopted(s3: Store, tmp_path: Path) -> None:
    uri = s3.uri("orphan")
    # a spool left by a process that died before it could upload (pid 2**22+1: not alive)
    dead = spool_root(uri) / f"{os.uname().nodename}-{2**22 + 1}" / "kind=store"
    dead.mkdir(parents=True)
    shutil.copy(DATA / "v3" / "store.parquet", dead / "other-000000.parquet")
    up = Uploader(uri)
    assert up.stats.adopted_parts == 1
    assert finish_uploads(up, timeout=60)
    assert s3.keys("orphan/") == ["orphan/kind=store/other-000000.parquet"]
    assert not (dead / "other-000000.parquet").exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keytrace", *args], capture_output=True, text=True, env=os.environ
    )


def test_every_reader_command_reads_s3_as_a_local_copy(s3: Store, tmp_path: Path) -> None:
    fs, root = pafs.FileSystem.from_uri(s3.uri("copy"))
    local = tmp_path / "local"
    for part in sorted((DATA / "v3").glob("*.parquet")):
        kind = part.stem
        dest = local / f"kind={kind}" / part.name
        dest.parent.mkdir(parents=True)
        shutil.copy(part, dest)
        with fs.open_output_stream(f"{root}/kind={kind}/{part.name}") as out:
            out.write(part.read_bytes())
    for command in (["diff", "--json"], ["summary", "--json"], ["header"]):
        here, there = _cli(*command, str(local)), _cli(*command, s3.uri("copy"))
        assert there.returncode == here.returncode, there.stderr
        assert there.stdout == here.stdout
    assert json.loads(_cli("diff", "--json", s3.uri("copy")).stdout)["verdict"]


def test_an_unreachable_store_is_one_line_and_exit_2(s3: Store) -> None:
    s3.proxy.down()
    out = _cli("diff", s3.uri("nothing"))
    assert out.returncode == 2
    assert out.stderr.strip().startswith("keytrace: error: s3://traces/nothing: cannot read"), (
        out.stderr
    )
    assert "Traceback" not in out.stderr
    s3.proxy.up()
    out = _cli("diff", s3.uri("nothing"))
    assert out.returncode == 2 and "holds no keytrace trace" in out.stderr


def test_a_store_that_is_away_is_retried_with_backoff_not_per_part(s3: Store) -> None:
    uri = s3.uri("backoff")
    s3.proxy.down()
    rec = _record(uri, requests=1)
    up = rec.writer.uploader
    assert up is not None and _wait(lambda: up.stats.failures >= 1)
    for i in range(10):  # ten new parts while it backs off: no attempt each
        k = make_key(bytes([i + 50]) * 8, 0)
        rec.store_prepared(f"b{i}", [k], {k: 16}, [k], [], i)
        rec.flush()
    assert up.pending()[0] == 2 + 10  # the first request's lookup and store parts, then ten
    assert up.stats.failures < 10, up.stats
    s3.proxy.up()
    rec.close()  # a closing writer's drain tries at once, backoff or not
    assert up.pending() == (0, 0) and len(s3.keys("backoff/")) == 2 + 10


def test_a_spool_of_another_user_or_a_link_is_refused(
    s3: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = s3.uri("foreign")
    root = spool_root(uri)
    root.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.symlink_to(elsewhere)  # someone points our spool at a folder of theirs
    with pytest.raises(PermissionError):
        Uploader(uri)
    rec = _record(uri, requests=1)  # the writer records nothing, says so once, never raises
    assert rec.writer.uploader is None and rec.writer.stats.errors >= 1
    rec.close()
    assert s3.keys("foreign/") == [] and not list(elsewhere.rglob("*"))
    assert any(
        "cannot write trace under s3://traces/foreign" in r.getMessage() for r in caplog.records
    )


def test_only_this_users_orphans_are_adopted_and_own_leftovers_too(s3: Store) -> None:
    uri = s3.uri("mine")
    host = os.uname().nodename
    theirs = spool_root(uri) / f"{host}-{2**22 + 3}" / "kind=store"
    own = spool_root(uri) / f"{host}-{os.getpid()}" / "kind=store"  # a restarted container
    for d in (theirs, own):
        d.mkdir(parents=True)
        shutil.copy(DATA / "v3" / "store.parquet", d / f"{d.parent.name}-000000.parquet")
    os.chown(theirs.parent, 65534, 65534)  # another user's: never uploaded by us
    up = Uploader(uri)
    assert finish_uploads(up, timeout=60)
    assert s3.keys("mine/") == [f"mine/kind=store/{own.parent.name}-000000.parquet"]


def test_new_parts_do_not_bring_a_retry_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a store that fails at once: one attempt, then nothing for the backoff's
    length however many parts arrive (watched for a second of a 60 s backoff)."""
    import keytrace.format.remote as remote

    monkeypatch.setenv("KEYTRACE_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setattr(remote, "RETRY_SECONDS", (60.0, 60.0))
    up = Uploader("s3://nowhere/x")

    def unreachable() -> Any:
        raise OSError("unreachable")

    monkeypatch.setattr(up, "_filesystem", unreachable)
    part = up.spool / "kind=store" / "p-000000.parquet"
    part.parent.mkdir(parents=True)
    shutil.copy(DATA / "v3" / "store.parquet", part)
    up.submit(part)
    assert _wait(lambda: up.stats.failures == 1)
    for i in range(50):
        more = part.with_name(f"p-{i + 1:06d}.parquet")
        shutil.copy(part, more)
        up.submit(more)
    assert not _wait(lambda: up.stats.failures > 1, timeout=1.0)
    assert up.pending()[0] == 51
