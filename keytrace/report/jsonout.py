"""JSON rendering of library results (dataclasses -> plain JSON values)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import IO, Any

import polars as pl

from keytrace.analysis.results import EpisodeList, EpisodeVerdict
from keytrace.judge.trust import RulesStatus

_SCALARS = (int, str, float, bool, type(None))


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values from dataclasses, containers, bytes (hex). Hot for big reports, so
    it dispatches on exact types first."""
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, RulesStatus):  # what it means, not how it is kept
        return obj.as_json()
    d = getattr(obj, "__dict__", None)
    if d is not None and hasattr(obj, "__dataclass_fields__"):
        return {k: to_jsonable(v) for k, v in d.items() if _in_json(obj, k)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, EpisodeList)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # slotted dataclasses
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def _in_json(obj: Any, name: str) -> bool:
    """A dataclass field is in the JSON unless its metadata says ``json: False`` (a view
    for another reporter, `keytrace.analysis.results.NOT_IN_JSON`)."""
    f = obj.__dataclass_fields__.get(name)
    return f is None or f.metadata.get("json", True)


def _dataclass_fields(obj: Any) -> Any:
    """``json.dumps``' fallback for a detailed episode: its dataclasses (whose fields are JSON
    values, keys already hex) as their field dicts, so the C encoder walks the rest (a third
    of the time `to_jsonable`'s Python recursion takes on thousands of shortfalls)."""
    if hasattr(obj, "__dataclass_fields__"):
        d = getattr(obj, "__dict__", None)  # slotted ones (NeededChunk) have none
        return d if d is not None else {f: getattr(obj, f) for f in obj.__dataclass_fields__}
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


COMPACT_ABOVE = 1000
"""Episodes above which a report is written compact (one line): indentation triples the
bytes and the time for no reader's benefit."""


def write_json(obj: Any, file: IO[str], *, compact: bool | None = None) -> None:
    """Indented for small documents, compact for large ones (``compact`` forces either)."""
    episodes = getattr(obj, "episodes", None)
    if compact is None:
        compact = isinstance(episodes, Sequence) and len(episodes) > COMPACT_ABOVE
    if compact and isinstance(episodes, EpisodeList):
        _write_compact_with_episode_list(obj, episodes, file)
    elif compact:
        file.write(json.dumps(to_jsonable(obj), separators=(",", ":")))
    else:
        file.write(json.dumps(to_jsonable(obj), indent=2))
    file.write("\n")


EPISODES_PER_WRITE = 8192
"""Episodes encoded and written per call: json.dump's thousands of tiny writes were 20x
slower, and one string for the whole document was 4 copies of it in memory at once (the
encoded episodes, their join, the document, its UTF-8 bytes: +300 MB at 150k episodes)."""


def _write_compact_with_episode_list(obj: Any, episodes: EpisodeList, file: IO[str]) -> None:
    """The compact document, the plain episodes encoded by polars from their columns
    (no object per episode), the detailed ones as usual, written a slice at a time. Parses
    to what ``json.dumps(to_jsonable(obj))`` gives (polars writes non-ASCII text unescaped)."""
    # a field plain rows lack takes the dataclass default: None, or [] (default_factory)
    cols = [
        pl.col(f.name)
        if f.name in episodes.rows.columns
        else (
            pl.lit([], pl.List(pl.Int64))
            if f.default_factory is not dataclasses.MISSING
            else pl.lit(f.default)
        ).alias(f.name)
        for f in dataclasses.fields(EpisodeVerdict)
    ]
    encoded = episodes.rows.lazy().select(pl.struct(cols).struct.json_encode().alias("j"))
    file.write("{")
    for n, f in enumerate(f for f in dataclasses.fields(obj) if _in_json(obj, f.name)):
        value = getattr(obj, f.name)
        file.write(("," if n else "") + json.dumps(f.name) + ":")
        if value is not episodes:
            file.write(json.dumps(to_jsonable(value), separators=(",", ":")))
            continue
        file.write("[")
        for start in range(0, len(episodes), EPISODES_PER_WRITE):
            plain = encoded.slice(start, EPISODES_PER_WRITE).collect()["j"].to_list()
            for i in range(start, start + len(plain)):
                if i in episodes.detailed:
                    v = episodes.detailed[i]
                    plain[i - start] = json.dumps(
                        v, separators=(",", ":"), default=_dataclass_fields
                    )
            file.write(("," if start else "") + ",".join(plain))
        file.write("]")
    file.write("}")
