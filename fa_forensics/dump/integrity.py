"""Integrity of a dump store: what is damaged, named per step, layer, array, chunk and file.

Two depths:
- `check_step` (metadata only: JSON files and directory listings, no chunk data) finds what can make a
  step read wrong, or read at all unsafely: a `zarr.json` that cannot be read or is malformed
  (`metadata_checks`: a FIFO or device in its place, too large, too deeply nested, not JSON, a shape,
  chunk grid or codec fa-forensics does not read, attributes of the wrong type), a layer or array the
  step lists but lacks, a chunk that is missing (the writer stores every chunk, so a missing one is
  damage, never zeros), replaced by a folder, a FIFO, a device or a socket, or a link leaving the
  store, a `heads` list other than the heads stored. It reports every problem it finds and never
  raises: what it cannot check is itself a problem of that step. The reader runs it for every step
  when it lists steps, and skips a damaged step.
- `check_chunk_data` decodes every chunk file of an array (zstd checksums, when the store has them,
  catch flipped bits; `guarded_store` bounds each chunk by its byte size); `dump.verify.verify` (the
  `fa-forensics verify` command) runs it.

Only local stores (a folder) are supported, as everywhere in fa-forensics.
"""
from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fa_forensics.dump.metadata_checks import (
    MAX_DIM, MAX_RATIO, NUMERIC_TYPES, STEP_ATTRS, STORED_TYPE, array_problems, attribute_problems, chunk_bytes,
    chunk_grid, describe_error, layer_attribute_problems, read_metadata,
)
from fa_forensics.dump.safe_read import StrPath, allocated_bytes, is_sparse, special_kind
from fa_forensics.dump.schema import ARRAY_NAMES, HEAD_TENSORS, LAYER_RE, MASK

if TYPE_CHECKING:
    import zarr

__all__ = ["MAX_DIM", "STORED_TYPE", "Damage", "bad_chunk", "check_array", "check_chunk_data", "check_step",
           "check_timeline", "chunk_grid", "chunk_keys", "describe_error", "grid_indices", "link_leaving",
           "read_metadata", "relative", "sound_arrays", "sound_series"]


@dataclass(frozen=True)
class Damage:
    """One problem found in a store; `where` names the step / layer / array / chunk, `file` the file or folder
    it is in (relative to the store's folder, '/'-separated; None: the store itself)."""

    step: int | None
    layer: int | None
    array: str | None
    what: str
    file: str | None = None

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

    def line(self, store: StrPath) -> str:
        """'damaged: <file>: <what>', the file named by its path under `store`."""
        located = f"{store}/{self.file}" if self.file else str(store)
        return f"damaged: {located}: {self.what}"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "layer": self.layer, "array": self.array, "file": self.file, "what": self.what}


def relative(path: Path, root: Path | None) -> str:
    """`path` under the store's folder `root`, '/'-separated (its name alone without a root)."""
    if root is None:
        return Path(path).name
    try:
        return Path(os.path.relpath(path, root)).as_posix()
    except ValueError:
        return Path(path).as_posix()


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


_HEAD_DIMS = 4  # (B, H, T, D), and a mask (B or 1, H or 1, Tq, Tk)
MAX_TIMELINE_ROW = 2**20  # values one timeline row may hold ((L, H) statistics of a million layer-heads)
_ARRAY_TYPES = tuple(sorted(set(STORED_TYPE.values())))


def check_array(array_dir: Path, step: int, layer: int, name: str, n_heads: Any = None,
                root: Path | None = None) -> list[Damage]:
    """Metadata-level damage of one array: metadata, dtype attribute, shape, chunk files."""
    return _check_array(array_dir, step, layer, name, n_heads, root)[0]


def _check_array(array_dir: Path, step: int, layer: int, name: str, n_heads: Any,
                 root: Path | None) -> tuple[list[Damage], list[int] | None]:
    """(damage, the shape when the metadata is sound) of one array."""
    def damage(what: str) -> Damage:
        return Damage(step, layer, name, what, relative(array_dir / "zarr.json", root))

    try:
        meta = read_metadata(array_dir)
    except ValueError as exc:
        return [damage(str(exc))], None
    dims = _HEAD_DIMS if name in HEAD_TENSORS or name == MASK else 3
    problems = array_problems(meta, dims, _ARRAY_TYPES)
    stored = str(meta.get("data_type"))
    dname = meta.get("attributes", {}).get("dtype")
    if not isinstance(dname, str) or dname not in STORED_TYPE:
        problems.append(f"dtype attribute {dname!r} is not one of {', '.join(STORED_TYPE)}"[:200])
    elif STORED_TYPE[dname] != stored:
        problems.append(f"dtype attribute {dname!r} does not fit the stored data type {stored} "
                        f"({dname} is stored as {STORED_TYPE[dname]})")
    if problems:
        return [damage(p) for p in problems], None
    shape = meta["shape"]
    if name in ("q", "o", "do") and isinstance(n_heads, int) and not isinstance(n_heads, bool) and shape[1] != n_heads:
        return [damage(f"holds {shape[1]} heads but the layer attribute n_heads is {n_heads}")], shape
    grid = chunk_grid(meta)
    return _check_chunk_files(array_dir, grid, step, layer, name, root, nbytes=chunk_bytes(meta)), shape


def _check_chunk_files(array_dir: Path, grid: tuple[list[int], str] | None, step: int | None, layer: int | None,
                       name: str, root: Path | None, missing_ok: bool = False, nbytes: int = 0) -> list[Damage]:
    """Missing chunks, chunks that are folders or special files, chunk links leaving the store, chunk files too
    short to ever hold `nbytes` (a chunk's decoded size) however they inflate: counted from one streamed listing
    of the folder (memory bounded by the files present, never by the chunk count the metadata claims; a file is
    stat'ed only for chunks of more than a MiB). `missing_ok`: absent chunks are fill values the writer skipped,
    not damage."""
    if grid is None:  # metadata that passed array_problems always has a regular grid
        return [Damage(step, layer, name, "chunk grid cannot be read", relative(array_dir / "zarr.json", root))]
    counts, sep = grid
    total = math.prod(counts)
    present = 0
    found: dict[str, list[tuple[str, str]]] = {kind: [] for kind in (
        "folder", "special", "outside", "short", "sparse", "long", "dangling", "unreadable")}
    n = dict.fromkeys(found, 0)

    def note(kind: str, key: str, text: str | None = None) -> None:
        n[kind] += 1
        if len(found[kind]) < 3:
            found[kind].append((key, text or key))

    for key, entry in _grid_entries(array_dir, counts, sep):
        if entry.is_dir():
            note("folder", key)
            continue
        target = link_leaving(Path(entry.path), root)
        if target is not None:
            note("outside", key, f"{key} -> {target}")
        if entry.is_file():
            present += 1
            try:
                st = entry.stat()
            except OSError:
                continue
            if is_sparse(st):
                note("sparse", key, f"{key}: {st.st_size} bytes claimed, {allocated_bytes(st)} on disk")
            elif nbytes and st.st_size > max_chunk_file(nbytes):
                note("long", key, f"{key}: {st.st_size} bytes")
            elif nbytes > 2**20 and st.st_size * MAX_RATIO < nbytes:
                note("short", key)
            continue
        kind = _special(entry.path)
        if kind is not None:
            note("special", key, f"{key}: {kind}")
        elif os.path.islink(entry.path):
            present += 1
            note("dangling", key, f"{key} -> {_readlink(entry.path)}")
        else:
            present += 1
            note("unreadable", key)
    missing: list[tuple[str, str]] = []
    n["missing"] = 0 if missing_ok else total - present - n["folder"] - n["special"]
    if n["missing"] > 0:
        for idx in grid_indices(counts):  # stops at the third missing key
            key = sep.join(["c", *map(str, idx)])
            if not os.path.lexists(array_dir / key):
                missing.append((key, key))
                if len(missing) == 3:
                    break
    if n["missing"] > 0 and not missing:  # present in no listing, yet named by none: say so rather than "()"
        missing.append(("", "their keys could not be listed"))
    found["missing"] = missing
    words = {
        "missing": lambda count, first: f"{_plural(count, 'chunk')} missing ({first})",
        "folder": lambda count, first: f"{_plural(count, 'chunk')} replaced by a folder ({first})",
        "special": lambda count, first: f"{_plural(count, 'chunk')} not a regular file ({first})",
        "short": lambda count, first: (f"{_plural(count, 'chunk file')} too short to hold the chunk's {nbytes} bytes, "
                                       f"however zstd inflates ({first}); the shape is hostile or the file damaged"),
        "outside": lambda count, first: (f"{_plural(count, 'chunk')} {'is a link' if count == 1 else 'are links'} "
                                         f"leaving the store ({first}); a dump holds its own data"),
        "sparse": lambda count, first: (f"{_plural(count, 'chunk file')} sparse, claiming far more bytes than "
                                        f"{'its blocks hold' if count == 1 else 'their blocks hold'} ({first}); "
                                        "the file is hostile or damaged"),
        "long": lambda count, first: (f"{_plural(count, 'chunk file')} longer than any encoding of the chunk's "
                                      f"{nbytes} bytes ({first}); the file is hostile or damaged"),
        "dangling": lambda count, first: (f"{_plural(count, 'chunk')} {'is a link' if count == 1 else 'are links'} "
                                          f"to nothing ({first})"),
        "unreadable": lambda count, first: f"{_plural(count, 'chunk')} cannot be read ({first})",
    }
    out = []
    for kind, say in words.items():
        count, keys = n[kind], found[kind]
        if count > 0:
            folder = relative(array_dir, root)
            file = f"{folder}/{keys[0][0]}" if count == 1 and keys else folder
            out.append(Damage(step, layer, name, say(count, _first([text for _, text in keys], count)), file))
    return out


def _grid_entries(array_dir: Path, counts: list[int], sep: str) -> Iterator[tuple[str, os.DirEntry]]:
    """(key, directory entry) of every name in `array_dir` that is a chunk key of the grid, streamed: flat keys
    ('c.0.1') from one listing, nested keys ('c/0/1') by walking only folders named by grid indices."""
    if sep != "/":
        for entry in _scan(array_dir):
            if _chunk_index(entry.name, counts, sep) is not None:
                yield entry.name, entry
        return
    stack: list[tuple[Path, list[str]]] = [(array_dir, [])]
    while stack:
        folder, parts = stack.pop()
        depth = len(parts)
        for entry in _scan(folder):
            if depth == 0:
                if entry.name != "c":
                    continue
            elif not (entry.name.isdigit() and int(entry.name) < counts[depth - 1]):
                continue
            key_parts = [*parts, entry.name]
            if depth == len(counts):
                yield "/".join(key_parts), entry
            elif entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), key_parts))


def _scan(folder: Path) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            yield from entries
    except OSError:
        return


def _decodable_size(entry: os.DirEntry, nbytes: int) -> bool:
    """Whether a chunk file's size is one its chunk can have: not sparse, not longer than any encoding of its
    `nbytes` (those are damage named by check_step, never read)."""
    try:
        st = entry.stat()
    except OSError:
        return False
    return not is_sparse(st) and not (nbytes and st.st_size > max_chunk_file(nbytes))


def max_chunk_file(nbytes: int) -> int:
    """The largest file a chunk of `nbytes` decoded bytes is written as: zstd's compress bound (ZSTD_COMPRESSBOUND)
    with room for the frame's header and checksum and crc32c's 4 bytes; the raw bytes themselves are shorter."""
    block = 128 * 1024
    return nbytes + (nbytes >> 8) + ((block - nbytes) >> 11 if nbytes < block else 0) + 64


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _special(path: str) -> str | None:
    """What a path that is neither a file nor a folder is ('a FIFO (named pipe)', ...); None when it is missing."""
    try:
        return special_kind(os.stat(path).st_mode)
    except OSError:
        return None


def _links_out(paths: list[Path], root: Path | None, step: int | None, layer: int | None = None,
               name: str | None = None) -> list[Damage]:
    """A Damage for each of `paths` (folders, zarr.json files) that is a link leaving the store."""
    out = []
    for path in paths:
        target = link_leaving(path, root)
        if target is not None:
            out.append(Damage(step, layer, name,
                              f"{path.name} is a link leaving the store (-> {target}); a dump holds its own data",
                              relative(path, root)))
    return out


def check_step(step_dir: Path, step: int, root: Path | None = None) -> list[Damage]:
    """Metadata-level damage of one step (see the module docstring); [] when it reads whole. Never raises:
    whatever cannot be checked is damage of that step.

    `root`: the store's folder; links (folders, metadata, chunks) that point outside it are damage."""
    if root is None:
        root = step_dir.parent
    try:
        return _check_step(Path(step_dir), step, Path(root))
    except MemoryError:
        raise
    except Exception as exc:  # a check that failed on metadata no writer makes: the step is damaged
        return [Damage(step, None, None, f"cannot be checked ({describe_error(exc)})", relative(step_dir, root))]


def _check_step(step_dir: Path, step: int, root: Path) -> list[Damage]:
    leaving = _links_out([step_dir, step_dir / "zarr.json"], root, step)
    if leaving:
        return leaving
    out: list[Damage] = []
    step_file = relative(step_dir / "zarr.json", root)
    try:
        step_meta = read_metadata(step_dir)
    except ValueError as exc:
        out.append(Damage(step, None, None, str(exc), step_file))
        step_meta = None
    if step_meta is not None:
        if step_meta.get("node_type") != "group":
            out.append(Damage(step, None, None, "zarr.json does not describe a group", step_file))
        out += [Damage(step, None, None, p, step_file)
                for p in attribute_problems(step_meta.get("attributes", {}), STEP_ATTRS, "step")]
    layers = sorted(int(m.group(1)) for d in _listdir(step_dir) if (m := LAYER_RE.match(d)) and (step_dir / d).is_dir())
    listed_layers = (step_meta or {}).get("attributes", {}).get("layers")
    if isinstance(listed_layers, list):
        missing = [l for l in dict.fromkeys(listed_layers) if isinstance(l, int) and l not in layers]
        for l in missing[:3]:
            out.append(Damage(step, l, None, "layer folder is missing though the step lists it",
                              relative(step_dir / f"layer_{l:03d}", root)))
        if len(missing) > 3:
            out.append(Damage(step, None, None, f"{len(missing) - 3} more layer folders are missing though the step "
                                                "lists them", relative(step_dir / "zarr.json", root)))
    if not layers and not out:
        out.append(Damage(step, None, None, "holds no layer", relative(step_dir, root)))
    for layer in layers:
        out.extend(_check_layer(step_dir / f"layer_{layer:03d}", step, layer, root))
    return out


def _check_layer(layer_dir: Path, step: int, layer: int, root: Path) -> list[Damage]:
    leaving = _links_out([layer_dir, layer_dir / "zarr.json"], root, step, layer)
    if leaving:
        return leaving
    out: list[Damage] = []
    layer_file = f"{relative(layer_dir, root)}/zarr.json"
    try:
        meta = read_metadata(layer_dir)
        attrs = meta.get("attributes", {})
        if meta.get("node_type") != "group":
            out.append(Damage(step, layer, None, "zarr.json does not describe a group", layer_file))
    except ValueError as exc:
        out.append(Damage(step, layer, None, str(exc), layer_file))
        attrs = {}
    out += [Damage(step, layer, None, p, layer_file) for p in layer_attribute_problems(attrs)]
    present = [n for n in ARRAY_NAMES if (layer_dir / n).is_dir()]
    listed = attrs.get("arrays")
    for name in listed if isinstance(listed, list) else []:
        if name in ARRAY_NAMES and name not in present:
            out.append(Damage(step, layer, name, "array is missing though the layer lists it",
                              relative(layer_dir / name, root)))
    if not present:
        out.append(Damage(step, layer, None, "holds no array", relative(layer_dir, root)))
    shapes: dict[str, list[int]] = {}
    for name in present:
        leaving = _links_out([layer_dir / name, layer_dir / name / "zarr.json"], root, step, layer, name)
        if leaving:
            out.extend(leaving)
            continue
        found, shape = _check_array(layer_dir / name, step, layer, name, attrs.get("n_heads"), root)
        out.extend(found)
        if shape is not None:
            shapes[name] = shape
    heads = attrs.get("heads")
    stored = next((shapes[n][1] for n in ("q", "o", "do") if n in shapes), None)
    if isinstance(heads, list) and stored is not None and len(heads) != stored:
        out.append(Damage(step, layer, None, f"layer attribute heads lists {len(heads)} heads but the arrays hold "
                                             f"{stored}", layer_file))
    head_dim = attrs.get("head_dim")
    width = next((shapes[n][3] for n in ("q", "k", "v", "o", "do") if n in shapes), None)
    if isinstance(head_dim, int) and not isinstance(head_dim, bool) and width is not None and head_dim != width:
        out.append(Damage(step, layer, None, f"layer attribute head_dim={head_dim} but the arrays hold {width} values "
                                             "per head", layer_file))
    return out


def check_timeline(timeline_dir: Path, root: Path | None = None) -> list[Damage]:
    """Metadata-level damage of the timeline group: every series an array of numbers with every chunk present
    (its values read only after this, so a claimed length never drives an allocation). Never raises."""
    try:
        return _check_timeline(Path(timeline_dir), root)
    except MemoryError:
        raise
    except Exception as exc:  # a check that failed on metadata no writer makes
        return [Damage(None, None, "timeline", f"cannot be checked ({describe_error(exc)})",
                       relative(timeline_dir, root))]


def _check_timeline(timeline_dir: Path, root: Path | None) -> list[Damage]:
    leaving = _links_out([timeline_dir, timeline_dir / "zarr.json"], root, None, None, "timeline")
    if leaving:
        return leaving
    out = []
    steps_found = False
    try:
        read_metadata(timeline_dir)
    except ValueError as exc:
        out.append(Damage(None, None, "timeline", str(exc), relative(timeline_dir / "zarr.json", root)))
    for name in _listdir(timeline_dir):
        series = timeline_dir / name
        if not series.is_dir():
            continue
        where = f"timeline/{name}"
        leaving = _links_out([series, series / "zarr.json"], root, None, None, where)
        if leaving:
            out.extend(leaving)
            continue
        meta_file = relative(series / "zarr.json", root)
        try:
            meta = read_metadata(series)
        except ValueError as exc:
            out.append(Damage(None, None, where, str(exc), meta_file))
            continue
        if meta.get("node_type") == "group":
            continue
        problems = array_problems(meta, None, NUMERIC_TYPES)
        if not problems and not meta["shape"]:
            problems.append("shape () has no step axis")
        elif not problems and math.prod(meta["shape"][1:]) > MAX_TIMELINE_ROW:
            problems.append(f"shape {tuple(meta['shape'])} is absurd (more than {MAX_TIMELINE_ROW} values per "
                            "step); the metadata is hostile or corrupt")
        if problems:
            out.extend(Damage(None, None, where, p, meta_file) for p in problems)
            continue
        steps_found = steps_found or name == "step"
        # the writer skips chunks that hold only the fill value, except in `step` (distinct step numbers): its
        # chunks, all present, bound the rows a reader takes from every series
        out.extend(_check_chunk_files(series, chunk_grid(meta), None, None, where, root, missing_ok=name != "step",
                                      nbytes=chunk_bytes(meta)))
    if not steps_found and not out and any(_listdir(timeline_dir)):
        out.append(Damage(None, None, "timeline", "holds no step series", relative(timeline_dir, root)))
    return out


def sound_arrays(step_dir: Path, root: Path | None = None) -> Iterator[tuple[int, str, Path]]:
    """(layer, array name, folder) of every array of a step whose metadata is sound and that stays in the store:
    the arrays whose chunks can be decoded, whatever else is wrong with the step."""
    for d in _listdir(step_dir):
        m = LAYER_RE.match(d)
        layer_dir = step_dir / d
        if not m or not layer_dir.is_dir() or _links_out([step_dir, layer_dir], root, None):
            continue
        for name in ARRAY_NAMES:
            array_dir = layer_dir / name
            if not array_dir.is_dir() or _links_out([array_dir, array_dir / "zarr.json"], root, None):
                continue
            try:
                meta = read_metadata(array_dir)
            except ValueError:
                continue
            dims = _HEAD_DIMS if name in HEAD_TENSORS or name == MASK else 3
            if not array_problems(meta, dims, _ARRAY_TYPES):
                yield int(m.group(1)), name, array_dir


def sound_series(timeline_dir: Path, root: Path | None = None) -> Iterator[tuple[str, Path]]:
    """(name, folder) of every timeline series whose metadata is sound and that stays in the store."""
    if _links_out([timeline_dir], root, None):
        return
    for name in _listdir(timeline_dir):
        series = timeline_dir / name
        if not series.is_dir() or _links_out([series, series / "zarr.json"], root, None):
            continue
        try:
            meta = read_metadata(series)
        except ValueError:
            continue
        if meta.get("node_type") == "array" and not array_problems(meta, None, NUMERIC_TYPES) and meta["shape"]:
            yield name, series


def check_chunk_data(array: zarr.Array, step: int | None, layer: int | None, name: str,
                     array_dir: Path | None = None, root: Path | None = None) -> list[Damage]:
    """Decode every chunk of a zarr array one at a time; each chunk that fails is one Damage naming it. With
    `array_dir`, only the chunk files present as regular files inside the store are decoded, found by one
    streamed listing (the others are named by check_step; a grid the metadata claims is never walked)."""
    out = []
    chunks = array.chunks
    sep = _separator(array)
    if array_dir is None:
        keys = (sep.join(["c", *map(str, idx)])
                for idx in itertools.product(*[range(math.ceil(s / c)) for s, c in zip(array.shape, chunks)]))
    else:
        counts = [math.ceil(s / c) for s, c in zip(array.shape, chunks)]
        nbytes = math.prod(chunks) * array.dtype.itemsize if getattr(array.dtype, "itemsize", 0) else 0
        keys = (key for key, entry in _grid_entries(array_dir, counts, sep)
                if entry.is_file() and link_leaving(Path(entry.path), root) is None and _decodable_size(entry, nbytes))
    for key in keys:
        idx = [int(i) for i in key.split(sep)[1:]]
        sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunks))
        try:
            array[sel]
        except Exception as exc:  # a codec error: truncated, flipped bits (checksum), not zstd, a bomb
            file = relative(array_dir / key, root) if array_dir is not None else None
            out.append(Damage(step, layer, name, f"chunk {key} cannot be decoded ({describe_error(exc)})", file))
    return out


def bad_chunk(array: zarr.Array, selection: tuple[Any, ...]) -> str | None:
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


def _separator(array: zarr.Array) -> str:
    encoding = getattr(array.metadata, "chunk_key_encoding", None)  # zarr v2 metadata has none
    separator = getattr(encoding, "separator", "/")
    return separator if isinstance(separator, str) else "/"


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
