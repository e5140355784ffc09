"""Completeness is checked, never assumed: a torn flush, a lost flush, stores without their
lookups and a compacted torn trace are reported incomplete and get no verdict (exit 2)
unless --allow-incomplete. A kill between two parts of a writer's *last* flush (vLLM's default
shutdown) is not a gap: that flush never completed and the trace ends before it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from keytrace.analysis.diff import diff
from keytrace.cli import main
from keytrace.format.reader import open_trace
from keytrace.format.schema import FLUSH_ORDER
from tests.factories import new_builder

DATA = Path(__file__).resolve().parents[1] / "data"

ROOT = Path(__file__).resolve().parents[2]


def _two_requests(directory: Path, *, flush_between: bool = True) -> None:
    """Three flushes: r1 primes chain c; r2 hits it and stores; r3 stores and hits."""
    b = new_builder(directory)
    b.prime("r1", "c", 64)
    if flush_between:
        b.rec.writer.flush()
    b.episode("r2", 64, external=48, scans=[(0, [(0, "HIT"), (1, "HIT"), (2, "HIT")])], chain="c")
    b.rec.close_episode("r2")
    b.store("r2", "c", 1, [3])  # flush 2: r2's lookups and a store of its own
    b.rec.writer.flush()
    b.store("r3", "c", 0, [3])  # flush 3: a store, and r3's lookup rows with it
    b.episode("r3", 80, external=48, scans=[(0, [(0, "HIT"), (1, "HIT"), (2, "HIT")])], chain="c")
    b.close()


def _parts(directory: Path, kind: str) -> list[Path]:
    return sorted((directory / f"kind={kind}").glob("*.parquet"))


def _flush_of(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(json.loads(pq.read_schema(path).metadata[b"keytrace.flush"])["gen"])


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["diff", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_complete_trace_is_complete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _two_requests(tmp_path / "t")
    trace = open_trace(str(tmp_path / "t"))
    assert not trace.incomplete and trace.missing == []
    code, out, err = _cli(capsys, str(tmp_path / "t"))
    assert code == 0 and out.startswith("AGREE: ") and err == ""


def test_a_torn_flush_is_named_and_gets_no_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "t"
    _two_requests(d)
    # flush 2's lookup part is gone (the kill came after its store part... or it was deleted)
    [torn] = [p for p in _parts(d, "lookup") if _flush_of(p) == 2]
    torn.unlink()
    trace = open_trace(str(d))
    [missing] = trace.missing
    assert missing.startswith(f"writer {trace.parts[0].source['instance']}, flush 2: its lookup")
    assert missing.endswith("is missing (torn by a kill, or removed)")
    code, out, err = _cli(capsys, str(d))
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("keytrace: error: the trace is incomplete: writer ")
    code, out, err = _cli(capsys, str(d), "--allow-incomplete", "--json")
    assert code == 0 and json.loads(out)["evidence_incomplete"] is True


@pytest.mark.parametrize("gap", ["torn flush", "stores without lookups"])
@pytest.mark.parametrize(
    "command",
    [["replay"], ["minimize", "-o", "{tmp}/min"], ["report", "-o", "{tmp}/report"]],
)
def test_every_command_that_judges_refuses_an_incomplete_trace(
    command: list[str], gap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """replay, minimize and report start from the trace's verdict: on a torn trace, or one
    whose requests stored without lookups, they stop before anything runs (no vLLM needed
    to say so), exit 2, one line."""
    d = tmp_path / "t"
    if gap == "torn flush":
        _two_requests(d)
        [torn] = [p for p in _parts(d, "lookup") if _flush_of(p) == 2]
        torn.unlink()
        said = "the trace is incomplete: writer "
    else:
        b = new_builder(d)
        b.prime("r1", "c", 64)
        b.store("ghost", "g", 0, [0, 1])
        b.close()
        said = "the trace is incomplete: 1 request(s) stored keys and have no lookup rows"
    args = [a.format(tmp=tmp_path) for a in command]
    code = main([args[0], str(d), *args[1:]])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith(f"keytrace: error: {said}"), err
    assert "Traceback" not in err


def test_a_lost_flush_between_two_others(tmp_path: Path) -> None:
    d = tmp_path / "t"
    _two_requests(d)
    for kind in ("store", "lookup", "episode", "step"):
        for p in _parts(d, kind):
            if _flush_of(p) == 2:
                p.unlink()
    assert any(
        "1 flush(es) missing entirely (generation 2)" in m for m in open_trace(str(d)).missing
    )


def test_files_given_one_by_one_are_checked_for_their_kinds_only(tmp_path: Path) -> None:
    d = tmp_path / "t"
    _two_requests(d)
    # the store parts alone: no lookup asked for, none missing (diff itself refuses them)
    assert open_trace([str(p) for p in _parts(d, "store")]).missing == []
    assert open_trace(str(d / "kind=store")).missing == []
    # both kinds, one lookup part left out: torn
    files = _parts(d, "store") + _parts(d, "lookup")[1:]
    assert open_trace([str(p) for p in files]).missing


def test_lookups_given_without_their_stores_are_incomplete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lookup is judged against the stores before it: lookup parts alone would read as
    all cold, an "agree" on no evidence. The manifests say what each flush wrote; parts
    without one (older keytrace) are refused when no store part is given at all."""
    d = tmp_path / "t"
    _two_requests(d)
    for given in ([str(p) for p in _parts(d, "lookup")], str(d / "kind=lookup")):
        missing = open_trace(given).missing
        assert missing and all("store part" in m and "not given" in m for m in missing)
        assert main(["diff", *([given] if isinstance(given, str) else given)]) == 2
        err = capsys.readouterr().err
        assert "pass the trace directory" in err.splitlines()[-1] and "Traceback" not in err
    assert open_trace([str(p) for p in _parts(d, "lookup") + _parts(d, "store")]).missing == []
    # a v5 part from before manifests: no store part among the files at all
    old = open_trace(str(DATA / "v5" / "lookup.parquet")).missing
    assert old and "no store part among the files given" in old[0]
    assert (
        open_trace([str(DATA / "v5" / k) for k in ("lookup.parquet", "store.parquet")]).missing
        == []
    )


def test_stores_without_lookups_are_incomplete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An older part without manifests cannot show a torn flush; a request that stored and
    has no lookup row at all still proves its lookups are missing."""
    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("r1", "c", 64)
    b.store("ghost", "g", 0, [0, 1])  # offered keys, never looked up: impossible in vLLM
    b.close()
    report = diff(open_trace(str(d)))
    assert report.evidence_incomplete
    assert report.warnings[-1] == (
        "incomplete trace: 1 request(s) stored keys and have no lookup rows at all (ghost): "
        "their lookups are not in this trace"
    )
    code, _out, err = _cli(capsys, str(d))
    assert code == 2 and "1 request(s) stored keys and have no lookup rows" in err


def test_compacting_a_torn_trace_keeps_it_torn(tmp_path: Path) -> None:
    from keytrace.format.compact import compact

    d = tmp_path / "t"
    _two_requests(d)
    [torn] = [p for p in _parts(d, "lookup") if _flush_of(p) == 2]
    torn.unlink()
    result = compact([str(d)], str(tmp_path / "c"))
    compacted = open_trace(list(result.files.values()))
    assert compacted.incomplete and "flush 2: its lookup part" in compacted.missing[0]


def test_a_flush_writes_stores_first() -> None:
    assert FLUSH_ORDER.index("store") < FLUSH_ORDER.index("lookup")
    assert set(FLUSH_ORDER) >= {"store", "lookup", "episode", "load", "step", "tier"}


KILLED_MID_FLUSH = """
import os, signal, sys
from keytrace.format import writer as w
from tests.factories import new_builder

real = w.TraceWriter._write_part
def write_then_die(self, kind, buf, manifest):
    real(self, kind, buf, manifest)
    if manifest["gen"] == 2 and kind == "store":  # between the parts of one flush
        os.kill(os.getpid(), signal.SIGKILL)
w.TraceWriter._write_part = write_then_die

b = new_builder(sys.argv[1])
b.prime("r1", "c", 64)
b.rec.writer.flush()
b.prime("r2", "d", 64)     # flush 2: stores and lookups of r2
b.rec.writer.flush()
print("not killed")
"""


def test_a_real_sigkill_in_the_last_flush_ends_the_trace_at_the_flush_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's default shutdown: SIGTERM (keytrace's writer starts a flush) and SIGKILL right
    after, between two parts of that last flush. The flush never completed: the trace ends at
    flush 1, as if the kill had come a moment earlier, the note says so, and the verdict is
    the one on flush 1's evidence (r1 primed its chain: AGREE), not a refusal."""
    d = tmp_path / "t"
    r = subprocess.run(
        [sys.executable, "-c", KILLED_MID_FLUSH, str(d)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL and "not killed" not in r.stdout, r.stderr
    assert any(_flush_of(p) == 2 for p in _parts(d, "store"))  # on disk, set aside
    trace = open_trace(str(d))
    assert not trace.incomplete and {_flush_of(Path(p.path)) for p in trace.parts} == {1}
    instance = trace.parts[0].source["instance"]
    said = (
        f"writer {instance}: its last flush (2) has only its store part(s), not its lookup "
        "(a kill during the flush, or parts not yet written or uploaded): the trace ends at "
        "flush 1, and the 8 rows of the unfinished flush are set aside"
    )
    assert trace.warnings == [said]
    code, out, err = _cli(capsys, str(d), "--json")
    report = json.loads(out)
    assert code == 0 and report["counts"] == {"cold": 1} and report["warnings"] == [said]
    assert report["evidence_incomplete"] is False
    assert f"keytrace: warning: {said}" in err


def test_a_last_flush_missing_a_part_a_kill_cannot_explain_is_incomplete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kill leaves a prefix of `FLUSH_ORDER`: a last flush with its lookup part on disk
    and its store part gone was not cut by a kill (a part was removed), so no verdict."""
    d = tmp_path / "t"
    _two_requests(d)
    [store] = [p for p in _parts(d, "store") if _flush_of(p) == 3]
    store.unlink()
    trace = open_trace(str(d))
    assert trace.incomplete and any("flush 3: its store part" in m for m in trace.missing)
    assert not [n for n in trace.notes if "cut short" in n]
    code, out, _err = _cli(capsys, str(d))
    assert (code, out) == (2, "")


def test_a_last_flush_cut_after_its_stores_is_set_aside(tmp_path: Path) -> None:
    """The same flush 3 with its lookup part gone instead (the kill came after the stores):
    a cut, so the trace is flush 1 and 2, complete."""
    d = tmp_path / "t"
    _two_requests(d)
    [lookup] = [p for p in _parts(d, "lookup") if _flush_of(p) == 3]
    lookup.unlink()
    trace = open_trace(str(d))
    assert not trace.incomplete, trace.missing
    assert {_flush_of(Path(p.path)) for p in trace.parts} == {1, 2}
    assert [w for w in trace.warnings if "last flush (3) has only its store part(s)" in w]


def test_a_lost_flush_does_not_hide_behind_a_cut_one(tmp_path: Path) -> None:
    """Flush 2 lost whole (a full spool, a disk error) and flush 3 cut by the kill: the
    lost flush is a gap, so nothing is set aside and the trace is incomplete."""
    d = tmp_path / "t"
    _two_requests(d)
    for kind in ("store", "lookup"):
        for p in _parts(d, kind):
            if _flush_of(p) == 2 or (kind == "lookup" and _flush_of(p) == 3):
                p.unlink()
    trace = open_trace(str(d))
    assert trace.incomplete and not [w for w in trace.warnings if "set aside" in w]
    assert any("1 flush(es) missing entirely (generation 2)" in m for m in trace.missing)


def test_a_writers_only_flush_is_never_set_aside(tmp_path: Path) -> None:
    """A server killed during its first flush: no flush before it to end at, so the trace
    stays readable and incomplete (``--allow-incomplete`` judges it), as before."""
    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("r1", "c", 64)
    b.close()
    for p in _parts(d, "lookup"):
        p.unlink()
    trace = open_trace(str(d))
    assert (
        trace.incomplete and trace.parts and any("flush 1: its lookup" in m for m in trace.missing)
    )


def test_with_two_writers_a_cut_is_a_gap(tmp_path: Path) -> None:
    """Another writer's rows may be later than one writer's cut: judged together the cut
    could lose an explanation, so with two writers a torn last flush stays incomplete."""
    d = tmp_path / "t"
    _two_requests(d)
    other = new_builder(tmp_path / "other")
    other.prime("x1", "e", 64)
    other.close()
    for p in (tmp_path / "other").rglob("*.parquet"):  # its own writer name: no clash
        p.rename(d / p.parent.name / p.name)
    [lookup] = [p for p in _parts(d, "lookup") if _flush_of(p) == 3 and "other" not in p.name]
    lookup.unlink()
    trace = open_trace(str(d))
    assert len({p.source["instance"] for p in trace.parts}) == 2
    assert trace.incomplete and any("flush 3: its lookup part" in m for m in trace.missing)


def test_a_column_of_the_wrong_type_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A part whose ``seq`` was rewritten as strings would be ordered by text: exit 2,
    naming the part and the column, never a verdict."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "t"
    _two_requests(d)
    part = _parts(d, "lookup")[0]
    table = pq.read_table(part)
    i = table.schema.get_field_index("seq")
    as_text = table.set_column(i, "seq", pa.array([str(x) for x in table["seq"].to_pylist()]))
    pq.write_table(as_text.replace_schema_metadata(table.schema.metadata), part)
    code, out, err = _cli(capsys, str(d))
    assert (code, out) == (2, "")
    assert err.strip() == (
        f"keytrace: error: {part}: lookup column seq is string, schema version 5 has int64"
    )


def test_request_accepts_the_id_the_api_returned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The OpenAI server answers ``cmpl-<hex>``; the trace holds vLLM's
    ``cmpl-<hex>-<choice>-<random>``: ``--request`` with the API's id finds it."""
    d = tmp_path / "t"
    b = new_builder(d)
    b.prime("cmpl-b9ee44ee58fc8024-0-9a8fd555", "c", 64)
    b.prime("cmpl-b9ee44ee58fc80249-0-00000000", "e", 64)  # a different id, same prefix
    b.close()
    code = main(["diff", str(d), "--request", "cmpl-b9ee44ee58fc8024", "--all", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [e["req_id"] for e in out["episodes"]] == ["cmpl-b9ee44ee58fc8024-0-9a8fd555"]


def test_the_disk_cap_is_never_exceeded_and_the_trace_says_it_was_capped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop and count: recording goes on without error while nothing more is written, the
    bytes on disk stay under the cap, one empty marker part says where it stopped, and the
    differ gives no verdict on the prefix unless asked."""
    from keytrace.format import budget as budget_mod
    from keytrace.format import writer as w

    cap = 600 << 10
    budget = w.DiskBudget(cap)
    monkeypatch.setattr(budget_mod, "_BUDGET", budget)
    d = tmp_path / "t"
    b = new_builder(d)
    for i in range(400):  # far more than fits
        b.prime(f"r{i}", f"chain{i}", 256)
        b.rec.writer.flush()
    stats = b.rec.writer.stats
    b.close()
    on_disk = sum(p.stat().st_size for p in d.rglob("*.parquet"))
    assert on_disk <= cap and budget.used == on_disk == stats.bytes_written
    assert stats.capped and stats.dropped_parts > 0 and stats.dropped_rows > 0
    trace = open_trace(str(d))
    [capped] = [m for m in trace.missing if "disk cap" in m and "stopped" in m]
    assert capped.startswith(f"writer {trace.parts[0].source['instance']} stopped at its disk cap")
    code, out, err = _cli(capsys, str(d))
    assert (code, out) == (2, "") and "stopped at its disk cap" in err.splitlines()[-1]
    code, out, _err = _cli(capsys, str(d), "--allow-incomplete")
    assert code == 0 and out.startswith("AGREE (on INCOMPLETE evidence)")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (None, 4 << 30),
        ("", 4 << 30),
        ("1048576", 1 << 20),
        ("512M", 512 << 20),
        ("4G", 4 << 30),
        ("2GiB", 2 << 30),
        ("64k", 64 << 10),
        ("lots", 4 << 30),  # a typo never lifts the cap
    ],
)
def test_max_bytes_spellings(text: str | None, value: int) -> None:
    from keytrace.format.budget import DEFAULT_MAX_BYTES
    from keytrace.format.remote import parse_bytes

    assert parse_bytes(text, DEFAULT_MAX_BYTES) == value


def test_compact_says_what_it_set_aside(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The compacted files hold what was read: compacting a trace whose last flush was cut
    repeats the reader's warning, so nobody deletes the source without being told."""
    d = tmp_path / "t"
    _two_requests(d)
    [lookup] = [p for p in _parts(d, "lookup") if _flush_of(p) == 3]
    lookup.unlink()
    assert main(["compact", str(d), "-o", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "keytrace: warning: writer " in err and "last flush (3) has only its store" in err


@pytest.mark.parametrize("gap", ["torn flush", "stores without lookups"])
@pytest.mark.parametrize("command", ["diff", "replay", "minimize", "report"])
def test_a_refusal_is_said_once(
    gap: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error line names what is missing; no warning line says it again before it."""
    d = tmp_path / "t"
    if gap == "torn flush":
        _two_requests(d)
        [torn] = [p for p in _parts(d, "lookup") if _flush_of(p) == 2]
        torn.unlink()
    else:
        b = new_builder(d)
        b.prime("r1", "c", 64)
        b.store("ghost", "g", 0, [0, 1])
        b.close()
    extra = ["-o", str(tmp_path / "out")] if command in ("minimize", "report") else []
    assert main([command, str(d), *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("keytrace: error: the trace is incomplete: "), err
    # with --allow-incomplete the warnings are all there is to say it
    if command == "diff":
        assert main([command, str(d), "--allow-incomplete"]) == 0
        assert "keytrace: warning: incomplete trace: " in capsys.readouterr().err
