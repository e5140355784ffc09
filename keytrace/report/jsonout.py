"""JSON rendering of library results (dataclasses -> plain JSON values)."""

from __future__ import annotations

import dataclasses
import json
from typing import IO, Any

_SCALARS = (int, str, float, bool, type(None))


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values from dataclasses, containers, bytes (hex). Hot for big reports, so
    it dispatches on exact types first."""
    if isinstance(obj, _SCALARS):
        return obj
    d = getattr(obj, "__dict__", None)
    if d is not None and hasattr(obj, "__dataclass_fields__"):
        return {k: to_jsonable(v) for k, v in d.items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # slotted dataclasses
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def write_json(obj: Any, file: IO[str]) -> None:
    """Indented for small documents; compact (one line) for large ones, where indentation
    triples the bytes and the time for no reader's benefit."""
    data = to_jsonable(obj)
    episodes = data.get("episodes") if isinstance(data, dict) else None
    # dumps + one write: json.dump streams thousands of tiny writes (20x slower here)
    if isinstance(episodes, list) and len(episodes) > 1000:
        file.write(json.dumps(data, separators=(",", ":")))
    else:
        file.write(json.dumps(data, indent=2))
    file.write("\n")
