"""JSON types of a result: what every --json and the report write. Imports nothing heavy, so that a command that
only reads metadata (info, verify) writes its JSON without the analyses' libraries."""
from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Convert dataclasses, enums, numpy/torch scalars and arrays, and paths into JSON types.

    Non-finite floats become None (JSON has no NaN), so files stay valid for every reader. A dataclass field
    whose metadata says {"json": False} is left out.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("json", True)}  # a field marked json=False is internal (sufficient statistics)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    # numpy and torch without importing them eagerly
    if hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return str(obj)
