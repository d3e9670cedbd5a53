"""`verify`: the full check of a dump store behind `fa-forensics verify`.

It opens the store with the reader (which runs `integrity.check_step` on every step and skips damaged
ones), then decodes every chunk file of every array whose metadata is sound, in whole and damaged steps
alike (`integrity.check_chunk_data`), so a step with a missing chunk and a corrupt one shows both; checks
and decodes the timeline; and lists what killed writers left beside the store (`debris.leftovers`).
Every problem is reported, none hides another.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zarr

from fa_forensics.dump.debris import leftovers
from fa_forensics.dump.guarded_store import RegularFileStore, bounded
from fa_forensics.dump.integrity import Damage, check_chunk_data, relative, sound_arrays, sound_series
from fa_forensics.dump.reader import Dump, open_dump
from fa_forensics.dump.safe_read import StrPath
from fa_forensics.dump.schema import TIMELINE_GROUP, step_key


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


def verify(path: StrPath, rank: int | None = None) -> VerifyReport:
    """Check a store fully: metadata (check_step) of every step, then every chunk of every sound array decodes.

    Raises DumpError (bad input) when `path` is not a dump at all.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(path, rank=rank)
    problems: list[Damage] = [*dump.rank_damage, *(d for ds in dump.damage.values() for d in ds)]
    arrays = chunks = 0
    whole = []
    tree = dump._tree_path
    for step in [*dump.steps, *dump.damage]:
        found = []
        for layer, name, array_dir in sound_arrays(tree / step_key(step), dump.path):
            array = _open(array_dir)
            if array is None:
                continue
            arrays += 1
            chunks += math.prod(math.ceil(s / c) for s, c in zip(array.shape, array.chunks))
            found.extend(check_chunk_data(array, step, layer, name, array_dir, dump.path))
        problems.extend(found)
        if not found and step not in dump.damage:
            whole.append(step)
    problems.extend(_timeline_problems(dump, tree / TIMELINE_GROUP))
    damaged = sorted({d.step for d in problems if d.step is not None})
    cut = [s for s in dump.incomplete_steps if s not in dump.damage]
    return VerifyReport(str(dump.path), dump.rank, sorted(whole), cut, damaged, problems, arrays, chunks,
                        leftovers(dump.path))


def _open(array_dir: Path) -> zarr.Array | None:
    """The array at `array_dir`, read through the guarded store and the bounded zstd codec."""
    try:
        return bounded(zarr.open_array(store=RegularFileStore(array_dir, read_only=True), mode="r"))
    except Exception:  # metadata zarr refuses: check_step has named it
        return None


def _timeline_problems(dump: Dump, timeline_dir: Path) -> list[Damage]:
    """The timeline's metadata damage, and every chunk of its sound series that does not decode."""
    if not timeline_dir.is_dir():
        return []
    out = list(dump.timeline_damage)
    for name, series in sound_series(timeline_dir, dump.path):
        array = _open(series)
        if array is None:
            out.append(Damage(None, None, f"timeline/{name}", "zarr cannot open it", relative(series, dump.path)))
            continue
        out.extend(check_chunk_data(array, None, None, f"timeline/{name}", series, dump.path))
    return out
