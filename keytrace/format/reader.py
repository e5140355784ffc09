"""Read a trace: any mix of part files, compacted files, directories and globs.

Every part is checked before a row is read: it must be Parquet, carry a
``keytrace.schema_version`` this keytrace reads (``READABLE_VERSIONS``; every part of one
trace the same), name its kind, hold that kind's columns in that version, and share one
header (geometry + vLLM version) with every other part.

Unreadable parts (torn by a kill, truncated copies, zero-byte files) are skipped with a
warning naming them, and the trace is marked ``incomplete``; only when *nothing* readable is
left does reading fail. Completeness is checked, never assumed: every part names the flush
that wrote it and everything that flush wrote (`keytrace.format.schema.META_FLUSH`), so a
flush torn by a kill (its store part on disk, its lookup part not) or a flush missing
between two others is named (`missing_parts`) and marks the trace ``incomplete`` too; a
writer's last flush cut short by a kill was never flushed and is set aside with a warning
(`cut_short`). Leftover ``.*.tmp`` files from a killed writer are ignored with a note. Everything else that is wrong is a `TraceError` with a one-line message naming the file.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from keytrace.errors import SchemaVersionError, TraceError
from keytrace.format.remote import is_remote, mirror, public
from keytrace.format.schema import (
    FLUSH_ORDER,
    KINDS,
    LOOKUP_RESULTS,
    META_FLUSH,
    META_HEADER,
    META_INCOMPLETE,
    META_KIND,
    META_SOURCE,
    META_VERSION,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SCHEMAS_BY_VERSION,
    LookupResult,
)

_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Part:
    """One readable Parquet part of a trace."""

    path: str
    kind: str
    rows: int
    header_json: str
    source: dict[str, Any]
    version: int = SCHEMA_VERSION
    row_slice: tuple[int, int] | None = None
    """(offset, rows): only these rows of the file (a batch of a big file's row groups)."""
    flush: dict[str, Any] | None = None
    """The manifest of the flush that wrote this part (None: a part without one)."""
    lacks: tuple[str, ...] = ()
    """What the trace a compacted file was made from was known to lack."""


@dataclass
class Trace:
    """A validated set of parts. ``frame(kind)`` gives the rows as a polars LazyFrame."""

    parts: list[Part]
    header: dict[str, Any]
    version: int = SCHEMA_VERSION
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    episodes: tuple[int | None, int | None] | None = None
    """``[lo, hi)``: only the lookup-side rows (kinds in `EPISODE_KINDS`) of episodes whose
    sequence number is in this range (a bound of None: open); see `episode_range`."""
    missing: list[str] = field(default_factory=list)
    """What the parts' flush manifests say was written and is not here (`missing_parts`)."""
    only: frozenset[int] | None = None
    """Only the rows of these recorder instances (``instance_id``); see `of_instances`."""

    @property
    def incomplete(self) -> bool:
        """True when some part could not be read or is known to be missing: a verdict
        would rest on partial evidence."""
        return bool(self.skipped or self.missing)

    def parts_of(self, kind: str) -> list[Part]:
        return [p for p in self.parts if p.kind == kind]

    def rows(self, kind: str) -> int:
        return sum(p.rows for p in self.parts_of(kind))

    def frame(self, kind: str) -> pl.LazyFrame:
        """Lazily scan all parts of ``kind`` with the versioned schema (empty if none)."""
        paths = [p.path for p in self.parts_of(kind)]
        if kind not in SCHEMAS_BY_VERSION[self.version]:
            raise TraceError(f"trace schema version {self.version} has no {kind!r} rows")
        schema = _polars_schema(kind, self.version)
        if not paths:
            return pl.LazyFrame(schema=schema)
        parts = self.parts_of(kind)
        if all(p.row_slice is None for p in parts):
            frame = pl.scan_parquet(paths, schema=schema, hive_partitioning=False)
        else:
            # a slice reaches the Parquet reader: only the row groups it covers are read
            frame = pl.concat(
                pl.scan_parquet(p.path, schema=schema, hive_partitioning=False).slice(*p.row_slice)
                if p.row_slice is not None
                else pl.scan_parquet(p.path, schema=schema, hive_partitioning=False)
                for p in parts
            )
        if self.episodes is not None and kind in EPISODE_KINDS:
            frame = frame.filter(_within("episode", *self.episodes))
        if self.only is not None and self._mixed(kind):
            frame = frame.filter(pl.col("instance_id").is_in(sorted(self.only)))
        return frame

    def _mixed(self, kind: str) -> bool:
        """Whether some part of ``kind`` may hold rows of several instances (a compacted
        file names none in its source), so an instance view must filter rows too."""
        return any(_instance_of(p) is None for p in self.parts_of(kind))

    def of_instances(self, instances: Iterable[int]) -> Trace:
        """This trace with only the rows these recorder instances wrote (``instance_id``):
        the parts other instances wrote are dropped unread (a writer's part names its
        instance in its source); a part of several (compacted) is filtered row by row. What
        the differ judges at once (`keytrace.analysis.partition`)."""
        keep = frozenset(instances)
        parts = [p for p in self.parts if (i := _instance_of(p)) is None or i in keep]
        # engines may differ in their own settings (`PER_ENGINE_KEYS`): these instances'
        # rows are judged under their own header, not the first part's of the whole trace
        own = next((p.header_json for p in parts if _instance_of(p) is not None), None)
        header = json.loads(own) if own is not None else self.header
        return dataclasses.replace(self, parts=parts, only=keep, header=header)

    def absolute(self) -> Trace:
        """This trace with every part's path absolute: what a worker in another working
        directory (a process pool, a Ray task) is handed."""
        parts = [dataclasses.replace(p, path=os.path.abspath(p.path)) for p in self.parts]
        return dataclasses.replace(self, parts=parts)

    def instances(self) -> list[int]:
        """The recorder instances whose rows this trace holds, sorted."""
        return sorted(self.instance_rows())

    def instance_rows(self) -> dict[int, int]:
        """Rows per recorder instance, from the parts' sources; only a part that names none
        (compacted) is scanned for them."""
        rows: dict[int, int] = {}
        for p in self.parts:
            i = _instance_of(p)
            if i is not None:
                rows[i] = rows.get(i, 0) + p.rows
                continue
            ids = pl.scan_parquet(p.path, hive_partitioning=False).select("instance_id")
            if p.row_slice is not None:
                ids = ids.slice(*p.row_slice)
            for inst, n in ids.group_by("instance_id").len().collect().iter_rows():
                rows[inst] = rows.get(inst, 0) + n
        if self.only is not None:
            rows = {i: n for i, n in rows.items() if i in self.only}
        return rows

    def episode_range(self, lo: int | None, hi: int | None) -> Trace:
        """This trace with only the lookup-side rows of episodes ``lo <= episode < hi``
        (None: no bound); store rows stay whole (an episode's causes read the store history
        before it). The filter reaches the Parquet reader, which skips the row groups
        outside the range by their statistics (parts are written in sequence order)."""
        return dataclasses.replace(self, episodes=(lo, hi))

    def collect(self, kind: str) -> pl.DataFrame:
        return self.frame(kind).collect()

    def batches(self, kind: str, max_bytes: int) -> list[Trace]:
        """This trace cut into traces of consecutive ``kind`` parts of at most ``max_bytes``
        on disk each (a bigger part is a batch of its own; no part: one empty batch).

        For queries whose working set grows with what they read rather than with what they
        keep: run once per batch, their peak memory is bounded by the batch, not the trace.
        """
        batches: list[list[Part]] = [[]]
        size = 0
        for part in self.parts_of(kind):
            for piece, n in _pieces(part, max_bytes):
                if batches[-1] and size + n > max_bytes:
                    batches.append([])
                    size = 0
                batches[-1].append(piece)
                size += n
        return [dataclasses.replace(self, parts=b) for b in batches]

    @property
    def kinds(self) -> list[str]:
        return [k for k in KINDS if self.parts_of(k)]


def _instance_of(part: Part) -> int | None:
    """The recorder instance that wrote ``part`` (None: a part of several, or unnamed)."""
    value = part.source.get("instance_id")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pieces(part: Part, max_bytes: int) -> list[tuple[Part, int]]:
    """``part`` with its on-disk size, or, when it is bigger than ``max_bytes`` (a compacted
    file), runs of its row groups of at most ``max_bytes`` each (a bigger row group is a
    run of its own)."""
    size = os.path.getsize(part.path)
    if size <= max_bytes or part.row_slice is not None:
        return [(part, size)]
    meta = pq.ParquetFile(part.path).metadata
    runs: list[list[int]] = []  # [offset, rows, bytes]
    offset = 0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        n = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        if not runs or runs[-1][2] + n > max_bytes:
            runs.append([offset, 0, 0])
        runs[-1][1] += rg.num_rows
        runs[-1][2] += n
        offset += rg.num_rows
    if len(runs) <= 1:
        return [(part, size)]
    return [
        (dataclasses.replace(part, rows=rows, row_slice=(off, rows)), n) for off, rows, n in runs
    ]


def _polars_schema(kind: str, version: int) -> dict[str, pl.DataType]:
    empty = pl.from_arrow(SCHEMAS_BY_VERSION[version][kind].empty_table())
    assert isinstance(empty, pl.DataFrame)
    return dict(empty.schema)


def _mirrored(uri: str) -> str:
    """A remote trace (``s3://bucket/prefix``), mirrored into the local cache
    (`keytrace.format.remote.mirror`)."""
    try:
        local = mirror(uri)
    except (OSError, ValueError) as exc:
        raise TraceError(f"{public(uri)}: cannot read the trace from its store ({exc})") from exc
    if not any(Path(local).rglob("*.parquet")):
        raise TraceError(f"{public(uri)}: holds no keytrace trace (no .parquet objects)")
    return local


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Files, directories (searched recursively) and globs -> sorted part candidates.

    Raises `TraceError` for a missing path, a glob matching nothing, or a directory with no
    ``.parquet`` file, each naming the offending argument.
    """
    if not paths:
        raise TraceError("no trace given: pass part files, a trace directory or a quoted glob")
    out: list[str] = []
    for arg in paths:
        if arg.startswith("file://"):  # a local URI is its path
            arg = urlsplit(arg).path
        if is_remote(arg):
            out.extend(_expand_one(_mirrored(arg)))
            continue
        if any(c in arg for c in _GLOB_CHARS) and not os.path.exists(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise TraceError(f"{arg}: the glob matches nothing")
            for m in matches:
                out.extend(_expand_one(m))
            continue
        if not os.path.exists(arg):
            raise TraceError(f"{arg}: no such file or directory")
        found = _expand_one(arg)
        if os.path.isdir(arg) and not any(f.endswith(".parquet") for f in found):
            raise TraceError(f"{arg}: directory holds no keytrace trace (no .parquet files)")
        out.extend(found)
    seen: set[str] = set()
    unique = []
    for p in out:
        rp = os.path.realpath(p)
        if rp not in seen:
            seen.add(rp)
            unique.append(p)
    return unique


def _expand_one(path: str) -> list[str]:
    if os.path.isdir(path):
        found = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".parquet") or f.endswith(".tmp"):
                    found.append(os.path.join(root, f))
        return found
    return [path]


EPISODE_KINDS = ("lookup", "episode")
LOOKUP_READS = ("store", "tier")
"""The kinds a lookup is judged against (what the store path offered, what tiers held):
`missing_parts` asks for them wherever lookup-side parts are given."""
"""Kinds whose rows belong to one lookup episode (column ``episode``)."""


def _within(col: str, lo: int | None, hi: int | None) -> pl.Expr:
    inside = pl.lit(True)
    if lo is not None:
        inside &= pl.col(col) >= lo
    if hi is not None:
        inside &= pl.col(col) < hi
    return inside


def open_trace(paths: Sequence[str] | str, *, kinds: Iterable[str] | None = None) -> Trace:
    """Validate and open a trace. See the module docstring for what is checked.

    ``kinds`` restricts which row kinds are kept (others are still validated).
    """
    if isinstance(paths, str):
        paths = [paths]
    candidates = expand_paths(paths)
    parts: list[Part] = []
    warnings: list[str] = []
    notes: list[str] = []
    skipped: list[str] = []
    tmp_files = [p for p in candidates if p.endswith(".tmp")]
    if tmp_files:
        notes.append(
            f"ignored {len(tmp_files)} unfinished temporary part(s) left by a killed writer "
            f"(e.g. {tmp_files[0]})"
        )
    files = [p for p in candidates if not p.endswith(".tmp")]
    if not files:
        raise TraceError(f"{paths[0]}: nothing to read (only unfinished temporary parts)")
    for path in files:
        try:
            part = _inspect(path)
        except _Unreadable as exc:
            skipped.append(path)
            warnings.append(f"skipped unreadable part {path}: {exc}")
            continue
        parts.append(part)
    if not parts:
        if len(files) == 1:
            raise TraceError(f"{files[0]}: {warnings[0].split(': ', 1)[1]}")
        raise TraceError(
            f"nothing readable among {len(files)} part(s); first problem: {warnings[0]}"
        )
    header_json = parts[0].header_json
    for p in parts[1:]:
        if p.version != parts[0].version:
            raise TraceError(
                f"{p.path}: schema version {p.version} mixed with version {parts[0].version} "
                f"({parts[0].path}); keep one version per trace (re-record or compact separately)"
            )
        if p.header_json != header_json and _configuration(p.header_json) != _configuration(
            header_json
        ):
            raise TraceError(_mixed_message(parts[0], p))
    header = json.loads(header_json)
    # a trace directory stands for every kind; one of its kind=X folders, for that kind
    whole = any(
        (is_remote(p) or os.path.isdir(p))
        and not os.path.basename(os.path.normpath(p)).startswith("kind=")
        for p in paths
    )
    cut = cut_short(parts, whole=whole)
    if cut:  # a warning: it travels with the report (diff --json), not only to stderr
        parts = [p for p in parts if _flush_key(p) not in cut]
        warnings.extend(cut.values())
    missing = missing_parts(parts, whole=whole)
    warnings.extend(f"incomplete trace: {m}" for m in missing[:MAX_MISSING_SHOWN])
    if len(missing) > MAX_MISSING_SHOWN:
        warnings.append(f"incomplete trace: ... {len(missing) - MAX_MISSING_SHOWN} more")
    if kinds is not None:
        keep = set(kinds)
        parts = [p for p in parts if p.kind in keep]
    trace = Trace(
        parts=parts,
        header=header,
        version=parts[0].version,
        warnings=warnings,
        notes=notes,
        skipped=skipped,
        missing=missing,
    )
    _check_values(trace)
    return trace


MAX_MISSING_SHOWN = 3
"""Missing parts named one by one in the warnings; the rest are counted."""


def missing_parts(parts: Sequence[Part], *, whole: bool) -> list[str]:
    """What the parts' flush manifests prove is missing, one line each.

    A flush wrote one part per kind it held, each carrying the flush's manifest: a kind the
    manifest lists with no part of that flush here is a *torn flush* (a kill between two of
    its parts, or a part deleted since). With ``whole`` (a trace directory was given) a
    flush generation missing between two present ones of one writer is a lost flush, and
    every kind counts; for a list of files the kinds given are checked, and with lookup-side
    parts among them the kinds a lookup is judged against (`LOOKUP_READS`: asking for the
    store parts alone is not a torn trace; asking for the lookups alone would judge them
    against no store). A compacted file passes on what its source
    lacked. Parts without a manifest (older keytrace) prove nothing either way.
    """
    present_kinds = {p.kind for p in parts}
    # a lookup is judged against the stores and tier rows before it: a list of files with
    # lookup-side parts needs those kinds too (lookups alone read as all cold: "agree")
    judged = bool(present_kinds & set(EPISODE_KINDS))
    seen: dict[tuple[str, int], set[str]] = {}
    listed: dict[tuple[str, int], dict[str, Any]] = {}
    capped: dict[str, tuple[int, dict[str, Any]]] = {}
    out: list[str] = []
    for p in parts:
        out.extend(p.lacks)
        if p.flush is None:
            continue
        key = (str(p.source.get("instance", "?")), int(p.flush.get("gen", 0)))
        seen.setdefault(key, set()).add(p.kind)
        listed[key] = p.flush.get("kinds", {})
        if isinstance(p.flush.get("capped"), dict):
            capped[key[0]] = (key[1], p.flush["capped"])
    for instance, (_gen, cap) in sorted(capped.items()):
        out.append(
            f"writer {instance} stopped at its disk cap (KEYTRACE_MAX_BYTES = "
            f"{cap.get('max_bytes')} bytes) after seq {cap.get('last_seq')}: what it recorded "
            "later is not in this trace"
        )
    for (instance, gen), kinds in sorted(listed.items()):
        for kind, extent in sorted(kinds.items()):
            if kind in seen[(instance, gen)] or not (
                whole or kind in present_kinds or (judged and kind in LOOKUP_READS)
            ):
                continue
            lo, hi = extent.get("seq", [None, None])
            why = (
                "not written: the disk cap"
                if instance in capped and gen < capped[instance][0]
                else "not given: the lookups are judged against it; pass the trace directory"
                if not whole and kind not in present_kinds
                else "torn by a kill, or removed"
            )
            out.append(
                f"writer {instance}, flush {gen}: its {kind} part ({extent.get('rows')} rows, "
                f"seq {lo}-{hi}) is missing ({why})"
            )
    if judged and not whole and "store" not in present_kinds and not listed:
        # parts without manifests (older keytrace) cannot say what was written: with no
        # store part at all among the files given, every lookup would read as cold
        out.append(
            "no store part among the files given: lookups are judged against the stores "
            "before them (pass the trace directory, or its kind=store parts too)"
        )
    if whole:
        by_writer: dict[str, list[int]] = {}
        for instance, gen in listed:
            by_writer.setdefault(instance, []).append(gen)
        for instance, gens in sorted(by_writer.items()):
            lost = sorted(set(range(1, max(gens) + 1)) - set(gens))
            if lost:
                shown = ", ".join(map(str, lost[:5])) + (" ..." if len(lost) > 5 else "")
                out.append(
                    f"writer {instance}: {len(lost)} flush(es) missing entirely "
                    f"(generation {shown})"
                )
    return list(dict.fromkeys(out))


def _flush_key(p: Part) -> tuple[str, int] | None:
    """(writer instance, flush generation) of a part with a manifest; None without one."""
    if p.flush is None:
        return None
    return (str(p.source.get("instance", "?")), int(p.flush.get("gen", 0)))


def cut_short(parts: Sequence[Part], *, whole: bool) -> dict[tuple[str, int], str]:
    """The last flush of the trace's writer that a kill cut short, with the warning that
    says so: {(instance, generation): text}; empty when there is none.

    A writer flushes on SIGTERM beside vLLM's teardown, and vLLM's default shutdown sends
    SIGKILL right after SIGTERM: on a busy server that kill often lands between two parts of
    the writer's *last* flush. A flush is written in `FLUSH_ORDER`, so a kill leaves a
    prefix of that order; when the last flush holds exactly such a prefix of the kinds its
    manifest lists, it never completed (it was not flushed), and the trace ends at the
    flush before it, as it would had the kill come a moment earlier. Its parts are set
    aside, not judged.

    Only where that is a consistent end of the evidence: one writer in the trace (another
    writer's rows may be later than the cut, and judging them against a cut one could lose
    an explanation), its flush before the cut one present (else a lost flush would hide
    behind the cut), and not stopped at its disk cap. Anything else missing stays
    `missing_parts`: the trace is incomplete.
    """
    present_kinds = {p.kind for p in parts}
    kinds_seen: dict[tuple[str, int], set[str]] = {}
    listed: dict[tuple[str, int], list[str]] = {}
    rows: dict[tuple[str, int], int] = {}
    capped: set[str] = set()
    for p in parts:
        key = _flush_key(p)
        if key is None or p.lacks:
            continue
        assert p.flush is not None
        kinds_seen.setdefault(key, set()).add(p.kind)
        listed[key] = sorted(
            (k for k in p.flush.get("kinds", {}) if k in FLUSH_ORDER),
            key=FLUSH_ORDER.index,
        )
        rows[key] = rows.get(key, 0) + p.rows
        if isinstance(p.flush.get("capped"), dict):
            capped.add(key[0])
    writers = {instance for instance, _gen in listed}
    if len(writers) != 1 or writers <= capped:
        return {}
    (instance,) = writers
    gen = max(g for _i, g in listed)
    key = (instance, gen)
    wanted = [k for k in listed[key] if whole or k in present_kinds]
    have = [k for k in wanted if k in kinds_seen[key]]
    if (instance, gen - 1) not in listed or len(have) == len(wanted) or wanted[: len(have)] != have:
        return {}
    return {
        key: f"writer {instance}: its last flush ({gen}) has only its {', '.join(have)} "
        f"part(s), not its {', '.join(wanted[len(have) :])} (a kill during the flush, or parts "
        f"not yet written or uploaded): the trace ends at flush {gen - 1}, and the "
        f"{rows[key]:,} rows of the unfinished flush are set aside"
    }


class _Unreadable(Exception):
    pass


def _inspect(path: str) -> Part:
    if os.path.getsize(path) == 0:
        raise _Unreadable("empty file (0 bytes)")
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow  # a property that rebuilds the schema on every access
        meta = schema.metadata or {}
        rows = pf.metadata.num_rows
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "magic bytes" in msg or "footer" in msg.lower() or "size" in msg.lower():
            raise _Unreadable(f"not a complete Parquet file ({msg})") from exc
        raise _Unreadable(f"not readable as Parquet ({msg})") from exc
    version = meta.get(META_VERSION)
    if version is None:
        raise TraceError(
            f"{path}: not a keytrace trace (Parquet without keytrace.schema_version metadata)"
        )
    try:
        v = int(version.decode())
    except ValueError as exc:
        raise SchemaVersionError(f"{path}: unparseable schema version {version!r}") from exc
    if v not in READABLE_VERSIONS:
        newer = "newer" if v > SCHEMA_VERSION else "older"
        raise SchemaVersionError(
            f"{path}: trace schema version {v} is {newer} than this keytrace reads "
            f"(schema versions {', '.join(map(str, READABLE_VERSIONS))}); "
            + ("upgrade keytrace" if v > SCHEMA_VERSION else "re-record with this keytrace")
        )
    kind = meta.get(META_KIND, b"").decode()
    schemas = SCHEMAS_BY_VERSION[v]
    if kind not in schemas:
        raise TraceError(
            f"{path}: unknown row kind {kind!r} for schema version {v} "
            f"(expected one of {', '.join(schemas)})"
        )
    names = set(schema.names)
    missing = [n for n in schemas[kind].names if n not in names]
    if missing:
        raise TraceError(f"{path}: {kind} part lacks column(s) {', '.join(missing)}")
    for expected in schemas[kind]:
        found = schema.field(expected.name).type
        if not _same_type(found, expected.type):
            raise TraceError(
                f"{path}: {kind} column {expected.name} is {found}, schema version {v} has "
                f"{_plain(expected.type)}"
            )
    header_json = meta.get(META_HEADER, b"").decode()
    try:
        json.loads(header_json)
    except ValueError as exc:
        raise TraceError(f"{path}: header metadata is not valid JSON") from exc
    source_raw = meta.get(META_SOURCE, b"{}").decode()
    try:
        source = json.loads(source_raw)
    except ValueError:
        source = {}
    return Part(
        path=path,
        kind=kind,
        rows=rows,
        header_json=header_json,
        source=source,
        version=v,
        flush=_json_meta(meta, META_FLUSH, path, dict),
        lacks=tuple(_json_meta(meta, META_INCOMPLETE, path, list) or ()),
    )


def _json_meta(meta: dict[bytes, bytes], key: bytes, path: str, typ: type) -> Any:
    """An optional JSON metadata value (None when absent); malformed is a `TraceError`: a
    completeness record that cannot be read proves nothing, and silence would claim it."""
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw.decode())
    except ValueError as exc:
        raise TraceError(f"{path}: {key.decode()} metadata is not valid JSON") from exc
    if not isinstance(value, typ):
        raise TraceError(f"{path}: {key.decode()} metadata is not a JSON {typ.__name__}")
    return value


def _plain(t: pa.DataType) -> pa.DataType:
    """A type as its values read: dictionary encoding and large offsets are storage only."""
    if pa.types.is_dictionary(t):
        return _plain(t.value_type)
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_plain(t.value_type))
    return t


def _same_type(found: pa.DataType, expected: pa.DataType) -> bool:
    """A part's column holds the values its schema version says (a ``seq`` rewritten as
    strings would order events by text, silently; a narrower integer would overflow)."""
    return bool(_plain(found) == _plain(expected))


PER_ENGINE_KEYS = frozenset(
    {
        "hash_identity",
        "tier_scope",
        "hash_algo",
        "pythonhashseed_set",
        "num_hash_lookahead_tokens",
        "use_lookahead_block_hashes",
        "eagle_proof_margins",
    }
)
"""Header keys that describe one engine, not the configuration: parts may differ in them
(two engines, two runs, a random seed per process, one engine with lookahead block hashes
and one without) and still be one trace. The differ compares them across engines
(`keytrace.judge.identity`) before it judges any key, and judges engines that hash
differently apart, each under its own header (`Trace.of_instances`)."""


def _configuration(header_json: str) -> str:
    """A header without its `PER_ENGINE_KEYS`: what every part of a trace must share."""
    header = json.loads(header_json)
    return json.dumps({k: v for k, v in header.items() if k not in PER_ENGINE_KEYS}, sort_keys=True)


def engine_headers(trace: Trace) -> dict[str, tuple[dict[str, Any], frozenset[int]]]:
    """Per writing engine, named ``<engine id> (<instance>)`` (the recorder instance alone
    without an engine id): its header and its recorder instance ids. A part naming no
    instance (compacted) is left out: its engines are not known apart."""
    out: dict[str, tuple[dict[str, Any], set[int]]] = {}
    cache: dict[str, dict[str, Any]] = {}
    for p in trace.parts:
        inst = _instance_of(p)
        if inst is None:
            continue
        if trace.only is not None and inst not in trace.only:
            continue
        instance = str(p.source.get("instance") or inst)
        engine = p.source.get("engine_id")
        name = f"{engine} ({instance})" if engine else instance
        header = cache.get(p.header_json)
        if header is None:
            header = cache[p.header_json] = json.loads(p.header_json)
        out.setdefault(name, (header, set()))[1].add(inst)
    return {n: (h, frozenset(ids)) for n, (h, ids) in sorted(out.items())}


def _mixed_message(a: Part, b: Part) -> str:
    ha, hb = json.loads(a.header_json), json.loads(b.header_json)
    diffs = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
    what = "vLLM versions" if "vllm_version" in diffs else "geometries"
    detail = ", ".join(diffs[:4]) + (" ..." if len(diffs) > 4 else "")
    return (
        f"{b.path}: mixes traces of different {what} with {a.path} (header fields differ: "
        f"{detail}); diff one configuration at a time"
    )


def _check_values(trace: Trace) -> None:
    """Reject lookup results this version does not know.

    v1: one lazy pass over every ``result``. v2: every scan's *head* results (short lists)
    and its summary counts, which must add up to its ``n_keys``: the recorder counts each
    raw result under one of the four names, so a result outside them shows as a shortfall
    in the sum. The long *tail* lists (most of a trace's bytes) are checked where the
    differ reads them (`keytrace.analysis.frames`), so no unknown value reaches a verdict
    without one full pass over tens of millions of strings at open. On failure the parts
    are checked one by one, tails included, so the message names the offending file.
    """
    parts = trace.parts_of("lookup")
    if not parts:
        return
    if _unknown_results(trace.frame("lookup"), trace.version, tails=False) or (
        trace.version > 1 and _miscounted(trace.frame("lookup"))
    ):
        raise_unknown_results(trace)


def raise_unknown_results(trace: Trace) -> NoReturn:
    """Name the first lookup part holding an unknown result value (a full pass; called
    only once something is known to be wrong)."""
    for part in trace.parts_of("lookup"):
        frame = pl.scan_parquet(part.path, schema=_polars_schema("lookup", trace.version))
        unknown = _unknown_results(frame, trace.version, tails=True)
        if unknown or (trace.version > 1 and _miscounted(frame)):
            raise TraceError(
                f"{part.path}: unknown lookup result value(s) "
                f"{', '.join(sorted(unknown)) or '(scan counts do not add up)'} "
                f"(expected {', '.join(LOOKUP_RESULTS)})"
            )
    raise TraceError(f"unknown lookup result value(s) (expected {', '.join(LOOKUP_RESULTS)})")


def _miscounted(frame: pl.LazyFrame) -> bool:
    counts = pl.sum_horizontal("n_hit", "n_pending", "n_retry", "n_miss")
    bad = frame.filter((pl.col("scan") >= 0) & (counts != pl.col("n_keys"))).select(pl.len())
    return bool(bad.collect(engine="streaming").item())


def _unknown_results(frame: pl.LazyFrame, version: int, *, tails: bool) -> set[str]:
    # A strict cast to an Enum of the known names is checked on each page's dictionary,
    # not per value: one cheap pass (measured 0.45 s against 0.71 s for a unique() over
    # 39M results). Only when it fails are the values listed, to name them.
    known = pl.Enum(LookupResult)
    if version == 1:
        cols = [pl.col("result").cast(pl.String)]
    else:
        cols = [pl.col("head_results")] + ([pl.col("tail_results")] if tails else [])
    try:
        frame.select(
            c.cast(pl.List(known) if version > 1 else known).is_null().sum() for c in cols
        ).collect(engine="streaming")
        return set()
    except pl.exceptions.InvalidOperationError:
        pass
    values: set[str] = set()
    for c in cols:
        flat = c.explode() if version > 1 else c
        values |= set(frame.select(flat.unique().alias("r")).collect()["r"].to_list())
    return values - set(LOOKUP_RESULTS) - {None}
