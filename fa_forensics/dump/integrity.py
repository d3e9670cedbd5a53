"""Integrity of a dump store: what is damaged, named per step, layer, array and chunk.

Two depths:
- `check_step` (metadata only: JSON files and directory listings, no chunk data) finds what can
  make a step read wrong without an error: an unreadable or malformed `zarr.json`, a layer or
  array the step lists but lacks, a missing chunk (the writer stores every chunk, so a missing
  one is damage, never zeros), a chunk replaced by a folder, an empty array, an array whose
  `dtype` attribute does not fit its stored data type, layer attributes of the wrong type. The
  reader runs it for every complete step when it lists steps, and skips a damaged step.
- `check_chunk_data` decodes every chunk of an array (zstd checksums, when the store has them,
  catch flipped bits); `dump.verify.verify` (the `fa-forensics verify` command) runs it.

Only local stores (a folder) are supported, as everywhere in fa-forensics.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fa_forensics.dump.schema import ARRAY_NAMES, HEAD_TENSORS, LAYER_RE, MASK

# The stored (zarr) data type each `dtype` attribute needs: bf16 / fp8 travel as same-width ints.
STORED_TYPE = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "bool": "bool",
}


@dataclass(frozen=True)
class Damage:
    """One problem found in a store; `where` names the step / layer / array / chunk."""

    step: int | None
    layer: int | None
    array: str | None
    what: str

    @property
    def where(self) -> str:
        parts = []
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.array is not None:
            parts.append(f"array '{self.array}'")
        return " ".join(parts) or "store"

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "layer": self.layer, "array": self.array, "what": self.what}


def read_metadata(node: Path) -> dict[str, Any]:
    """The parsed `zarr.json` of a group or array folder; ValueError saying why it cannot be read."""
    meta_path = node / "zarr.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise ValueError("zarr.json is missing") from None
    except IsADirectoryError:
        raise ValueError("zarr.json is a folder") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"zarr.json cannot be read ({type(exc).__name__})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"zarr.json is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("attributes", {}), dict):
        raise ValueError("zarr.json is not a zarr v3 metadata object")
    return meta


# No attention tensor has a dimension this long: a larger one is hostile metadata, refused before any work.
MAX_DIM = 2**31 - 1


def chunk_grid(meta: dict[str, Any]) -> tuple[list[int], str] | None:
    """(chunks per dimension, key separator) of a regular-grid array under the default key encoding, or None."""
    try:
        shape = [int(s) for s in meta["shape"]]
        chunk_shape = [int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"]]
        encoding = meta.get("chunk_key_encoding", {"name": "default"})
        if encoding.get("name") != "default" or len(shape) != len(chunk_shape):
            return None
        sep = encoding.get("configuration", {}).get("separator", "/")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return [-(-s // c) if c > 0 else 0 for s, c in zip(shape, chunk_shape)], str(sep)


def chunk_keys(meta: dict[str, Any]) -> Iterator[str] | None:
    """Every chunk key of a regular-grid array under the default key encoding (lazily), or None if unknown."""
    grid = chunk_grid(meta)
    if grid is None:
        return None
    counts, sep = grid
    return (sep.join(["c", *map(str, idx)]) for idx in grid_indices(counts))


def grid_indices(counts: list[int]) -> Iterator[tuple[int, ...]]:
    """Every index of a grid in C order, one at a time (itertools.product would first build each range as a
    tuple: gigabytes for the chunk counts hostile metadata can claim)."""
    if any(n <= 0 for n in counts):
        return
    idx = [0] * len(counts)
    while True:
        yield tuple(idx)
        d = len(counts) - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < counts[d]:
                break
            idx[d] = 0
            d -= 1
        if d < 0:
            return


def _chunk_index(name: str, counts: list[int], sep: str) -> tuple[int, ...] | None:
    """The grid index of a chunk file name ('c.0.1.0.0'), or None when it is not a key of this grid."""
    parts = name.split(sep)
    if len(parts) != len(counts) + 1 or parts[0] != "c":
        return None
    try:
        idx = tuple(int(p) for p in parts[1:])
    except ValueError:
        return None
    return idx if all(0 <= i < n for i, n in zip(idx, counts)) else None


def link_leaving(path: Path, root: Path | None) -> str | None:
    """Where `path` points when it is a symbolic link whose target lies outside `root` (None otherwise)."""
    if root is None or not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    base = os.path.realpath(root)
    if target == base or target.startswith(base + os.sep):
        return None
    return target


def _check_layer_attrs(attrs: dict[str, Any], step: int, layer: int) -> list[Damage]:
    out = []
    for key in ("n_heads", "head_dim"):
        value = attrs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            out.append(Damage(step, layer, None, f"layer attribute {key}={value!r} is not a count"))
    scale = attrs.get("scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        out.append(Damage(step, layer, None, f"layer attribute scale={scale!r} is not a number"))
    elif scale is not None and not (math.isfinite(scale) and scale > 0):
        out.append(Damage(step, layer, None, f"layer attribute scale={scale!r} is not a positive finite softmax scale"))
    causal = attrs.get("causal")
    if causal is not None and not isinstance(causal, bool):
        out.append(Damage(step, layer, None, f"layer attribute causal={causal!r} is not true/false"))
    heads = attrs.get("heads")
    if heads is not None and (not isinstance(heads, list)
                              or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads)
                              or len(set(heads)) != len(heads)):
        out.append(Damage(step, layer, None, f"layer attribute heads={heads!r} is not a list of distinct head numbers"))
    arrays = attrs.get("arrays")
    if arrays is not None and (not isinstance(arrays, list) or not all(a in ARRAY_NAMES for a in arrays)):
        out.append(Damage(step, layer, None, f"layer attribute arrays={arrays!r} names unknown arrays"))
    return out


def check_array(array_dir: Path, step: int, layer: int, name: str, n_heads: Any = None,
                root: Path | None = None) -> list[Damage]:
    """Metadata-level damage of one array: metadata, dtype attribute, shape, chunk files."""
    try:
        meta = read_metadata(array_dir)
    except ValueError as exc:
        return [Damage(step, layer, name, str(exc))]
    if meta.get("node_type") != "array":
        return [Damage(step, layer, name, "zarr.json does not describe an array")]
    stored = str(meta.get("data_type"))
    dname = meta.get("attributes", {}).get("dtype")
    if not isinstance(dname, str) or dname not in STORED_TYPE:
        return [Damage(step, layer, name, f"dtype attribute {dname!r} is not one of {', '.join(STORED_TYPE)}")]
    if STORED_TYPE[dname] != stored:
        return [Damage(step, layer, name, f"dtype attribute {dname!r} does not fit the stored data type {stored} "
                                          f"({dname} is stored as {STORED_TYPE[dname]})")]
    shape = meta.get("shape")
    want_dims = 4 if name in HEAD_TENSORS or name == MASK else 3
    if not isinstance(shape, list) or len(shape) != want_dims or not all(isinstance(s, int) for s in shape):
        return [Damage(step, layer, name, f"shape {shape!r} is not {want_dims}-D")]
    if 0 in shape:
        return [Damage(step, layer, name, f"array is empty (shape {tuple(shape)})")]
    if name in HEAD_TENSORS and isinstance(n_heads, int) and name in ("q", "o", "do") and shape[1] != n_heads:
        return [Damage(step, layer, name, f"holds {shape[1]} heads but the layer attribute n_heads is {n_heads}")]
    if any(d > MAX_DIM for d in shape):
        return [Damage(step, layer, name, f"shape {tuple(shape)} is absurd (a dimension above {MAX_DIM}); "
                                          f"the metadata is hostile or corrupt")]
    grid = chunk_grid(meta)
    if grid is None:
        return []
    return _check_chunk_files(array_dir, grid, step, layer, name, root if root is not None else array_dir.parents[2])


def _check_chunk_files(array_dir: Path, grid: tuple[list[int], str], step: int, layer: int, name: str,
                       root: Path | None) -> list[Damage]:
    """Missing chunks, chunks that are folders, chunk links leaving the store: counted from one streamed
    listing of the folder (memory bounded by the files present, never by the chunk count the metadata claims)."""
    counts, sep = grid
    total = math.prod(counts)
    present, folders, outside = 0, [], []
    n_folders = n_outside = 0
    try:
        entries = os.scandir(array_dir)
    except OSError:
        entries = None
    if entries is not None:
        with entries:
            for entry in entries:
                if _chunk_index(entry.name, counts, sep) is None:
                    continue
                if entry.is_dir():
                    n_folders += 1
                    if len(folders) < 3:
                        folders.append(entry.name)
                    continue
                target = link_leaving(Path(entry.path), root)
                if target is not None:
                    n_outside += 1
                    if len(outside) < 3:
                        outside.append(f"{entry.name} -> {target}")
                if entry.is_file():
                    present += 1
    n_missing = total - present - n_folders
    out = []
    if n_missing > 0:
        missing = []
        for idx in grid_indices(counts):  # stops at the third missing key
            key = sep.join(["c", *map(str, idx)])
            if not (array_dir / key).exists():
                missing.append(key)
                if len(missing) == 3:
                    break
        out.append(Damage(step, layer, name, f"{_plural(n_missing, 'chunk')} missing ({_first(missing, n_missing)})"))
    if n_folders:
        out.append(Damage(step, layer, name,
                          f"{_plural(n_folders, 'chunk')} replaced by a folder ({_first(folders, n_folders)})"))
    if n_outside:
        verb = "is a link" if n_outside == 1 else "are links"
        out.append(Damage(step, layer, name, f"{_plural(n_outside, 'chunk')} {verb} leaving the store "
                                              f"({_first(outside, n_outside)}); a dump holds its own data"))
    return out


def _links_out(paths: list[Path], root: Path | None, step: int, layer: int | None = None,
               name: str | None = None) -> list[Damage]:
    """A Damage for each of `paths` (folders, zarr.json files) that is a link leaving the store."""
    out = []
    for path in paths:
        target = link_leaving(path, root)
        if target is not None:
            out.append(Damage(step, layer, name,
                              f"{path.name} is a link leaving the store (-> {target}); a dump holds its own data"))
    return out


def check_step(step_dir: Path, step: int, root: Path | None = None) -> list[Damage]:
    """Metadata-level damage of one step (see the module docstring); [] when it reads whole.

    `root`: the store's folder; links (folders, metadata, chunks) that point outside it are damage."""
    if root is None:
        root = step_dir.parent
    leaving = _links_out([step_dir, step_dir / "zarr.json"], root, step)
    if leaving:
        return leaving
    try:
        read_metadata(step_dir)
    except ValueError as exc:
        return [Damage(step, None, None, str(exc))]
    out: list[Damage] = []
    layers = sorted(int(m.group(1)) for d in _listdir(step_dir) if (m := LAYER_RE.match(d)) and (step_dir / d).is_dir())
    step_meta = read_metadata(step_dir)
    listed_layers = step_meta.get("attributes", {}).get("layers")
    if isinstance(listed_layers, list):
        for l in listed_layers:
            if isinstance(l, int) and l not in layers:
                out.append(Damage(step, l, None, "layer folder is missing though the step lists it"))
    if not layers and not out:
        out.append(Damage(step, None, None, "holds no layer"))
    for layer in layers:
        layer_dir = step_dir / f"layer_{layer:03d}"
        leaving = _links_out([layer_dir, layer_dir / "zarr.json"], root, step, layer)
        if leaving:
            out.extend(leaving)
            continue
        try:
            attrs = read_metadata(layer_dir).get("attributes", {})
        except ValueError as exc:
            out.append(Damage(step, layer, None, str(exc)))
            continue
        out.extend(_check_layer_attrs(attrs, step, layer))
        present = [n for n in ARRAY_NAMES if (layer_dir / n).is_dir()]
        listed = attrs.get("arrays")
        for name in listed if isinstance(listed, list) else []:
            if name in ARRAY_NAMES and name not in present:
                out.append(Damage(step, layer, name, "array is missing though the layer lists it"))
        if not present:
            out.append(Damage(step, layer, None, "holds no array"))
        for name in present:
            leaving = _links_out([layer_dir / name, layer_dir / name / "zarr.json"], root, step, layer, name)
            out.extend(leaving or check_array(layer_dir / name, step, layer, name, attrs.get("n_heads"), root))
    return out


def check_chunk_data(array, step: int, layer: int, name: str) -> list[Damage]:
    """Decode every chunk of a zarr array one at a time; each chunk that fails is one Damage naming it."""
    out = []
    chunks = array.chunks
    grid = [range(math.ceil(s / c)) for s, c in zip(array.shape, chunks)]
    sep = _separator(array)
    for idx in itertools.product(*grid):
        sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunks))
        try:
            array[sel]
        except Exception as exc:  # a codec error: truncated, flipped bits (checksum), not zstd at all
            key = sep.join(["c", *map(str, idx)])
            out.append(Damage(step, layer, name, f"chunk {key} cannot be decoded ({describe_error(exc)})"))
    return out


def bad_chunk(array, selection) -> str | None:
    """Key of the first chunk in `selection` (a tuple of slices / index lists) that fails to decode."""
    import numpy as np

    chunks = array.chunks
    per_dim = []
    for sel, size, c in zip(tuple(selection) + (slice(None),) * (len(chunks) - len(selection)), array.shape, chunks):
        idx = np.arange(size)[sel] if not isinstance(sel, list) else np.asarray(sel)
        per_dim.append(sorted({int(i) // c for i in np.atleast_1d(idx)}))
    sep = _separator(array)
    for idx in itertools.product(*per_dim):
        sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunks))
        try:
            array[sel]
        except Exception:
            return sep.join(["c", *map(str, idx)])
    return None


def describe_error(exc: BaseException) -> str:
    """'ZstdError: ...' in one short line."""
    text = " ".join(str(exc).split())
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _separator(array) -> str:
    try:
        return array.metadata.chunk_key_encoding.separator
    except AttributeError:
        return "/"


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _first(keys: list[str], n: int) -> str:
    """The first (up to 3) of `n` keys."""
    return ", ".join(keys[:3]) + (", ..." if n > 3 else "")
