"""`verify`: the full check of a dump store behind `fa-forensics verify`.

It opens the store with the reader (which runs `integrity.check_step` on every complete step and
skips damaged ones), decodes every chunk of every whole step (`integrity.check_chunk_data`), reads
the timeline, and lists what killed writers left beside the store (`debris.leftovers`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from fa_forensics.dump.debris import leftovers
from fa_forensics.dump.integrity import Damage, check_chunk_data, describe_error
from fa_forensics.dump.reader import open_dump


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` found in one rank's tree: whole steps, cut-off steps, and every problem."""

    path: str
    rank: int
    steps: list[int]  # complete, and every chunk decodes
    incomplete_steps: list[int]  # cut off while writing (no `complete` flag)
    damaged_steps: list[int]
    problems: list[Damage]
    arrays_checked: int
    chunks_checked: int
    leftovers: list = field(default_factory=list)  # debris.Leftover beside the store: files of killed writers

    @property
    def ok(self) -> bool:
        return not self.problems and not self.incomplete_steps

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "rank": self.rank, "ok": self.ok, "steps": self.steps,
                "incomplete_steps": self.incomplete_steps,
                "damaged_steps": self.damaged_steps, "problems": [d.to_dict() for d in self.problems],
                "arrays_checked": self.arrays_checked, "chunks_checked": self.chunks_checked,
                "leftovers": [x.to_dict() for x in self.leftovers]}


def verify(path, rank: int | None = None) -> VerifyReport:
    """Check a store fully: metadata (check_step) of every step, then every chunk of every whole step decodes.

    Raises DumpError (bad input) when `path` is not a dump at all.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(path, rank=rank)
    problems: list[Damage] = [d for ds in dump.damage.values() for d in ds]
    arrays = chunks = 0
    whole = []
    for step in dump.steps:
        found = []
        for layer in dump.layers(step):
            group = dump._layer(step, layer)
            for name in dump._array_names(step, layer):
                array = group[name]
                arrays += 1
                chunks += math.prod(math.ceil(s / c) for s, c in zip(array.shape, array.chunks))
                found.extend(check_chunk_data(array, step, layer, name))
        problems.extend(found)
        if not found:
            whole.append(step)
    timeline = _timeline_problems(dump)
    problems.extend(timeline)
    damaged = sorted({d.step for d in problems if d.step is not None})
    cut = [s for s in dump.incomplete_steps if s not in dump.damage]
    return VerifyReport(str(dump.path), dump.rank, whole, cut, damaged, problems, arrays, chunks, leftovers(dump.path))


def _timeline_problems(dump) -> list[Damage]:
    try:
        dump.timeline  # noqa: B018 - read only to see whether it can be read
    except Exception as exc:
        return [Damage(None, None, "timeline", f"cannot be read ({describe_error(exc)})")]
    return []
