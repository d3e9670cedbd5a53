"""DumpWriter: create (or extend) a format-v1 dump store, one array at a time.

A step's `complete` flag is written last, in its own metadata write, after every array of the
step is on disk: a process killed mid-step leaves a step the reader reports as incomplete,
never one it mistakes for whole. Every chunk is written, all-zero ones too, and each carries a
zstd checksum: a missing chunk is damage the reader detects (integrity.py), never zeros, and
`fa-forensics verify` detects flipped bits. One writer per store (lock.py); appending steps of
another model is refused (identity.py).
"""
from __future__ import annotations

import math
import os
import shutil
import threading
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zarr
import zarr.codecs

from fa_forensics.dump.identity import check_same_model
from fa_forensics.dump.lock import StoreLock
from fa_forensics.dump.metadata_checks import read_metadata
from fa_forensics.dump.nodes import child_array, child_group
from fa_forensics.dump.ranks import other_rank_trees, ready_line, wait_for_rank0
from fa_forensics.dump.safe_files import check_parent_links
from fa_forensics.dump.safe_read import StrPath
from fa_forensics.dump.schema import (
    ATTRS_KEY,
    CALL_ATTR_KEYS,
    FORMAT_VERSION,
    HEAD_TENSORS,
    ARRAY_NAMES,
    MASK,
    TIMELINE_GROUP,
    dtype_name,
    encode,
    layer_key,
    rank_key,
    step_key,
)
from fa_forensics.errors import DumpError

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams
    from zarr.core.chunk_key_encodings import ChunkKeyEncodingParams

# Flat chunk files ("c.0.1.0.0") instead of nested folders: one file per head, no folder per index.
CHUNK_KEY_ENCODING: ChunkKeyEncodingParams = {"name": "default", "separator": "."}
# Every chunk on disk (zarr skips all-zero chunks by default, which would make a lost chunk read as zeros).
ARRAY_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}
_LAYER_ATTR_KEYS = ("module", "n_heads", "head_dim", "scale", "causal", "dtype", "heads", "dropout_p", "mask",
                    "autocast", "input_dtype", *CALL_ATTR_KEYS)


def _existing_format(path: Path) -> int | None:
    """format_version of an existing fa-forensics store at `path`, or None if it is not one."""
    try:  # read as the reader does: a FIFO or device in its place never blocks
        meta = read_metadata(Path(path)).get("attributes", {}).get(ATTRS_KEY)
    except ValueError:  # not zarr, zarr v2, unreadable: not ours
        return None
    if not isinstance(meta, Mapping):
        return None
    return meta.get("format_version")


def _default_run_attrs(run_attrs: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    from fa_forensics import __version__

    attrs: dict[str, Any] = {
        "tool_version": __version__,
        "torch_version": torch.__version__,
        "device": "cpu",
        "amp_dtype": None,
        "model": {},
        "capture": {},
    }
    attrs.update(dict(run_attrs))
    attrs["format_version"] = FORMAT_VERSION
    attrs["world_size"] = int(world_size)
    return attrs


def _refuse_inner_links(store: Path, rank: int) -> None:
    """An existing store is written into only if the folders the writer writes into are not links: zarr
    creates files inside them, so a planted `step_…` link would let it write outside the store. Folders are
    checked down to the arrays (step/layer/array); chunk files are replaced by zarr's renames, never written
    through, so the (many) chunk listings are not read."""
    tree = store if rank == 0 else store / rank_key(rank)
    if tree.is_symlink():
        raise DumpError(f"{tree} is a symbolic link; fa-forensics never writes a store through a link, "
                        f"write a new store")
    for folder, dirs, _files in os.walk(tree):
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                raise DumpError(f"{os.path.join(folder, name)} is a symbolic link inside the store; fa-forensics never "
                                f"writes through a link, write a new store (or remove the link)")
        if len(Path(folder).relative_to(tree).parts) >= 2:  # step/layer: its array folders are checked, not walked
            dirs.clear()


def _move_aside(path: Path) -> Path:
    """Rename an existing dump to a free `<path>.replaced-<n>` and return the new name."""
    n = 0
    while (aside := path.with_name(f"{path.name}.replaced-{n}")).exists():
        n += 1
    path.rename(aside)
    return aside


class DumpWriter:
    """Write q, k, v, o, do, x arrays into a format-v1 store.

    DumpWriter(path, run_attrs, overwrite=False, rank=0, world_size=1, allow_other_model=False):
    - a missing path or an empty folder: a new store with root attrs `fa_forensics = run_attrs`
      (format_version, tool_version, torch_version filled in);
    - an existing format-1 dump: re-opened to add steps (run_attrs are not changed, but a model
      fingerprint that differs from the store's is refused unless allow_other_model);
    - anything else (a file, a folder that is not a dump, another format): DumpError, unless
      overwrite=True and it is an fa-forensics dump (then, from rank 0 only, it is replaced: moved
      aside to `<path>.replaced-<n>` and deleted by close() after a run that ended well; a run that
      dies, or close(failed=True), keeps it, so nothing is lost).
    Another process writing the same store (rank) is refused with a DumpError naming it.
    Rank r > 0 writes under `rank_{r}/` of a store rank 0 created (never the root attributes); rank 0
    writes the root tree. `rank0_wait` (seconds): rank r > 0 first waits for rank 0 of the run `run_id`
    to have opened the store (dump/ranks.py); rank 0 announces it. Meant for one writer
    thread per rank; a lock makes concurrent calls from several threads safe, not fast.
    """

    def __init__(self, path: StrPath, run_attrs: Mapping[str, Any] | None = None, *, overwrite: bool = False,
                 rank: int = 0, world_size: int = 1, allow_other_model: bool = False, run_id: str | None = None,
                 rank0_wait: float | None = None) -> None:
        self.path = Path(path)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.allow_other_model = bool(allow_other_model)
        self._lock = threading.Lock()
        self._closed = False
        self._replaced: Path | None = None  # the dump that `overwrite` replaces, kept until close()
        self._timeline_group: zarr.Group | None = None  # timeline/ and its arrays, opened at the first row
        self._timeline_arrays: dict[str, zarr.Array] | None = None
        self._created: str | None = None  # "new" / "empty folder" when this writer made the store
        self._wrote = False  # anything written (a step, an array, a timeline row)
        check_parent_links(self.path, "out")  # a folder on the way planted as a link in a shared place
        if self.rank > 0 and rank0_wait is not None:
            wait_for_rank0(self.path, self.rank, run_id, rank0_wait)
        self._store_lock = StoreLock(self.path, self.rank).acquire()
        try:
            self._root = self._open_root(dict(run_attrs or {}), overwrite)
            if self.rank == 0:
                self._store_lock.announce(ready_line(run_id))
            self._tree = self._root if self.rank == 0 else self._root.require_group(rank_key(self.rank))
        except BaseException:
            self._store_lock.release()
            raise
        self._steps: dict[int, zarr.Group] = {}
        self._layers: dict[tuple[int, int], zarr.Group] = {}
        self._step_layers: dict[int, set[int]] = {}

    # -- store ----------------------------------------------------------------------------
    def _open_root(self, run_attrs: dict[str, Any], overwrite: bool) -> zarr.Group:
        p = self.path
        if p.is_symlink():
            raise DumpError(f"{p} is a symbolic link to {os.readlink(p)}; fa-forensics never writes a store "
                            f"through a link, give the real path or another one")
        if p.exists() and not p.is_dir():
            raise DumpError(f"{p} exists and is a file, not a dump store; choose another path")
        is_empty_dir = p.is_dir() and not any(p.iterdir())
        if self.rank > 0 and (not p.exists() or is_empty_dir):
            raise DumpError(f"rank {self.rank} found no dump at {p} to add its tree {rank_key(self.rank)}/ to: rank 0 "
                            "creates the store and writes its run description; open rank 0's writer first")
        if p.exists() and not is_empty_dir:
            version = _existing_format(p)
            if version is None:
                raise DumpError(f"{p} exists and is not an fa-forensics dump; refusing to write into it, choose "
                                "another path")
            if overwrite and self.rank == 0:
                self._replaced = _move_aside(p)
            elif version != FORMAT_VERSION:
                raise DumpError(f"{p} is a dump of format_version {version}, this tool writes {FORMAT_VERSION}; pass "
                                "overwrite to replace it")
            else:
                _refuse_inner_links(p, self.rank)
                root = zarr.open_group(str(p), mode="r+")
                self._check_model(root, run_attrs.get("model"))
                return root
        self._created = "empty folder" if is_empty_dir else "new"
        root = zarr.open_group(str(p), mode="a")
        if ATTRS_KEY not in root.attrs:
            root.attrs[ATTRS_KEY] = _default_run_attrs(run_attrs, self.world_size)
        return root

    def _check_model(self, root: zarr.Group, model: Mapping[str, Any] | None) -> None:
        """Refuse another model's steps (identity.py); record the fingerprint if the store has none."""
        meta = _mapping(root.attrs.get(ATTRS_KEY))
        if check_same_model(self.path, meta.get("model"), model, self.allow_other_model) and self.rank == 0:
            meta["model"] = {**_mapping(meta.get("model")), **(model or {})}
            root.attrs[ATTRS_KEY] = meta

    def set_model(self, model: Mapping[str, Any]) -> None:
        """Give the model once it is known (a launcher binds it at the first forward): checked as at opening."""
        with self._lock:
            self._check_open()
            self._check_model(self._root, model)

    def register_step(self, step: int) -> None:
        """Create the step's group (complete: false) now: a run killed before the step is written lists it as
        incomplete."""
        with self._lock:
            self._check_open()
            self._wrote = True
            self._step_group(int(step))

    def _step_group(self, step: int) -> zarr.Group:
        if step not in self._steps:
            key = step_key(step)
            if key in self._tree:
                g = child_group(self._tree, key)
                if g.attrs.get("complete") is True:
                    raise DumpError(f"step {step} is already complete in {self.path}; write to a new store or pass "
                                    "overwrite")
            else:
                g = self._tree.create_group(key, attributes={"step": int(step), "complete": False})
            self._steps[step] = g
        return self._steps[step]

    def _layer_group(self, step: int, layer: int, tensor: torch.Tensor, name: str,
                     layer_attrs: Mapping[str, Any] | None) -> zarr.Group:
        key = (step, layer)
        given = {k: v for k, v in dict(layer_attrs or {}).items() if v is not None}
        unknown = set(given) - set(_LAYER_ATTR_KEYS)
        if unknown:
            raise ValueError(f"unknown layer_attrs {sorted(unknown)}; allowed: {_LAYER_ATTR_KEYS}")
        if key not in self._layers:
            sg = self._step_group(step)
            lk = layer_key(layer)
            self._step_layers.setdefault(step, set()).add(int(layer))
            if lk in sg:
                self._layers[key] = child_group(sg, lk)
            else:
                attrs: dict[str, Any] = {"module": None, "causal": True, "arrays": []}
                if name in HEAD_TENSORS:
                    B, H, T, D = tensor.shape
                    attrs.update(n_heads=int(H), head_dim=int(D), scale=1.0 / math.sqrt(D),
                                 dtype=dtype_name(tensor.dtype))
                attrs.update(given)
                self._layers[key] = sg.create_group(lk, attributes=attrs)
                return self._layers[key]
        g = self._layers[key]
        update = dict(given)
        if name in HEAD_TENSORS and "n_heads" not in g.attrs:  # x came first: fill in from this tensor
            B, H, T, D = tensor.shape
            update = {"n_heads": int(H), "head_dim": int(D), "scale": 1.0 / math.sqrt(D),
                      "dtype": dtype_name(tensor.dtype), **update}
        if update:
            g.attrs.update(update)
        return g

    # -- public API -----------------------------------------------------------------------
    def write_array(self, step: int, layer: int, name: str, tensor: torch.Tensor,
                    layer_attrs: Mapping[str, Any] | None = None) -> None:
        """Store one tensor (already on the CPU) bit-exactly as step/layer/name.

        q, k, v, o, do: (B, H, T, D), chunks (1, 1, T, D); x: (B, T, C), chunks (1, T, C).
        layer_attrs (module, n_heads, head_dim, scale, causal, dtype) are set on first use of
        the layer; missing ones are inferred (scale 1/sqrt(D), causal True).
        """
        if name not in ARRAY_NAMES:
            raise ValueError(f"unknown tensor name {name!r}; expected one of {', '.join(ARRAY_NAMES)}")
        want_dim = 4 if name in HEAD_TENSORS or name == MASK else 3
        if tensor.dim() != want_dim:
            layout = "B, T, C" if want_dim == 3 else ("B, H, Tq, Tk" if name == MASK else "B, H, T, D")
            raise ValueError(f"{name} must have {want_dim} dims ({layout}), got shape {tuple(tensor.shape)}")
        data, dname = encode(tensor)
        chunks = (1, 1, *data.shape[2:]) if want_dim == 4 else (1, *data.shape[1:])
        with self._lock:
            self._check_open()
            self._wrote = True
            lg = self._layer_group(int(step), int(layer), tensor, name, layer_attrs)
            arr = lg.create_array(
                name,
                shape=data.shape,
                dtype=data.dtype,
                chunks=chunks,
                compressors=zarr.codecs.ZstdCodec(checksum=True),
                chunk_key_encoding=CHUNK_KEY_ENCODING,
                attributes={"dtype": dname},
                overwrite=True,
                config=ARRAY_CONFIG,
            )
            arr[...] = data
            listed = lg.attrs.get("arrays", [])
            names = sorted(set(listed if isinstance(listed, list) else []) | {name}, key=ARRAY_NAMES.index)
            lg.attrs["arrays"] = names

    def complete_step(self, step: int, loss: float | None = None, **attrs: Any) -> None:
        """Mark a step whole: its other attrs (and `layers`, the layers written) first, then `complete: True` in a
        last write."""
        with self._lock:
            self._check_open()
            if int(step) not in self._steps and step_key(step) not in self._tree:
                raise DumpError(f"nothing was written for step {step}; write its arrays before complete_step")
            g = self._step_group(int(step))
            if not self._step_layers.get(int(step)):
                raise DumpError(f"nothing was written for step {step}; write its arrays before complete_step")
            extra = {"layers": sorted(self._step_layers[int(step)]), **attrs}
            if loss is not None:
                extra["loss"] = float(loss)
            if extra:
                g.attrs.update(extra)
            g.attrs["complete"] = True  # last: a cut-off step never reads as complete

    def update_run_attrs(self, attrs: Mapping[str, Any]) -> None:
        """Merge `attrs` into the run description (dict values merge one level deep); rank 0 only,
        the root belongs to it. Used when the model becomes known after the store was created."""
        if self.rank != 0:
            return
        with self._lock:
            self._check_open()
            meta = _mapping(self._root.attrs[ATTRS_KEY])
            for key, value in attrs.items():
                merge = isinstance(value, Mapping) and isinstance(meta.get(key), Mapping)
                meta[key] = {**meta.get(key, {}), **value} if merge else value
            self._root.attrs[ATTRS_KEY] = meta

    def append_timeline(self, step: int, **series: Any) -> None:
        """Append one row (this step) to per-step series under timeline/ (see append_timeline_rows)."""
        self.append_timeline_rows([(step, series)])

    def append_timeline_rows(self, rows: list[tuple[int, Mapping[str, Any]]]) -> None:
        """Append rows [(step, {series: value})] to timeline/, one zarr append per series.

        Each value may be a scalar or an array (e.g. (L, H)); the stored series gets a leading step
        axis (float64; `step` int64). A series a row lacks gets NaN; a new series is back-filled
        with NaN. The timeline's arrays stay open between calls (looking them up reads metadata
        files, a third of the cost of an append): this writer must be the timeline's only writer.
        """
        if not rows:
            return
        batch = _timeline_block(rows)
        n_new = len(rows)
        with self._lock:
            self._check_open()
            self._wrote = True
            if self._timeline_group is None or self._timeline_arrays is None:
                group = self._timeline_group = self._tree.require_group(TIMELINE_GROUP)
                self._timeline_arrays = {k: child_array(group, k) for k in group.array_keys()}
            group, arrays = self._timeline_group, self._timeline_arrays
            n_rows = arrays["step"].shape[0] if "step" in arrays else 0
            for key, arr in arrays.items():
                if key not in batch:  # a series this batch lacks: NaN (an integer series: -1)
                    batch[key] = np.full((n_new, *arr.shape[1:]), np.nan if arr.dtype.kind == "f" else -1,
                                         dtype=arr.dtype)
            for key, block in batch.items():
                if key not in arrays:
                    arr = group.create_array(key, shape=(0, *block.shape[1:]), dtype=block.dtype,
                                             chunks=(256, *block.shape[1:]),
                                             compressors=zarr.codecs.ZstdCodec(), config=ARRAY_CONFIG)
                    if n_rows:
                        fill = np.nan if block.dtype.kind == "f" else -1
                        arr.append(np.full((n_rows, *block.shape[1:]), fill, dtype=block.dtype), axis=0)
                    arrays[key] = arr
                arrays[key].append(block, axis=0)

    def close(self, failed: bool = False) -> None:
        """Finish writing and release the store. The dump an `overwrite` replaced is deleted only
        now, and only if the run did not fail: a run that dies (or failed=True) leaves it beside
        the new one (`<path>.replaced-<n>`, named by `replaced`), so nothing is lost."""
        if self._closed:
            return
        self._closed = True
        try:
            if failed and self._created and not self._wrote and self.rank == 0:
                self._undo_create()
            elif self._replaced is not None and not failed:
                shutil.rmtree(self._replaced, ignore_errors=True)
                self._replaced = None
        finally:
            self._store_lock.release()

    def _undo_create(self) -> None:
        """A failed run that wrote nothing leaves the path as it found it (the replaced dump back in place),
        unless other ranks wrote their trees into the store meanwhile."""
        if other_rank_trees(self.path):
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self._replaced is not None:
            os.replace(self._replaced, self.path)
            self._replaced = None
        elif self._created == "empty folder":
            self.path.mkdir(exist_ok=True)

    @property
    def replaced(self) -> Path | None:
        """Where the dump that `overwrite` replaced still is (None once deleted, or if none)."""
        return self._replaced

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DumpWriter is closed")

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _mapping(value: Any) -> dict[str, Any]:
    """A copy of a mapping attribute; {} for one that is absent (None) or not a mapping."""
    return dict(value) if isinstance(value, Mapping) else {}


def _timeline_block(rows: list[tuple[int, Mapping[str, Any]]]) -> dict[str, np.ndarray]:
    """{"step": (K,) int64, name: (K, ...) float64 with NaN where a row lacks the series}."""
    n_new = len(rows)
    columns: dict[str, list[np.ndarray | None]] = {}  # name -> per row: float64 array or None
    for i, (_, series) in enumerate(rows):
        for key, value in series.items():
            if key == "step":
                raise ValueError("'step' is the timeline's own axis; pass it as the first element of a row")
            v = np.asarray(value.detach().cpu().float() if isinstance(value, torch.Tensor) else value, dtype="float64")
            columns.setdefault(key, [None] * n_new)[i] = v
    batch = {"step": np.asarray([int(step) for step, _ in rows], dtype="int64")}  # (K,)
    for key, values in columns.items():
        shape = next(v.shape for v in values if v is not None)
        block = np.full((n_new, *shape), np.nan)  # (K, ...) float64
        for i, row in enumerate(values):
            if row is not None:
                block[i] = row
        batch[key] = block
    return batch
