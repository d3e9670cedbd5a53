"""Lazy reader of format-v1 dump stores.

`open_dump(path)` reads metadata only: the root's, and, when steps are first listed, each step's
(integrity.check_step: every layer, array and chunk file present, dtype attributes that fit);
array values are read only by `Dump.read`. A step that was cut off or is damaged is listed apart
(`incomplete_steps`, `damage`) and skipped with a one-line warning. Every problem a user can cause
(wrong path, not a dump, unknown format, missing step / layer / array / head, a chunk that cannot
be decoded) raises a one-line `DumpError` that says what exists.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import zarr

from fa_forensics.dump.guarded_store import RegularFileStore, bounded
from fa_forensics.dump.integrity import (
    Damage, bad_chunk, check_step, check_timeline, describe_error, link_leaving, relative,
)
from fa_forensics.dump.metadata_checks import ROOT_ATTRS, attribute_problems, read_metadata
from fa_forensics.dump.nodes import child_array, child_group
from fa_forensics.dump.ranks import rank_links_out, rank_tree_of, store_ranks
from fa_forensics.dump.safe_read import StrPath, special_kind
from fa_forensics.dump.schema import (
    ATTRS_KEY,
    CALL_ATTR_KEYS,
    FORMAT_VERSION,
    HEAD_TENSORS,
    LAYER_RE,
    MASK,
    ARRAY_NAMES,
    STEP_RE,
    TIMELINE_GROUP,
    LayerInfo,
    decode,
    layer_key,
    rank_key,
    supported_dtype_names,
)
from fa_forensics.errors import DumpError, UnknownRank

if TYPE_CHECKING:
    import torch


class IncompleteStepWarning(UserWarning):
    """A step of the dump was cut off (no `complete` flag) or is damaged; it is skipped."""


def _listed(values: Iterable[Any], limit: int = 12) -> str:
    """Steps, layers or names for a message: the first `limit`, comma-separated, and how many in all."""
    values = list(values)
    if not values:
        return "none"
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def _subdirs(path: Path) -> list[str]:
    """Names of the folders in `path` (a listing of the file system: zarr's would warn on stray files)."""
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir())
    except OSError:
        return []


# Steps, layers, heads or batch rows: one, several, or None (all of them).
Selection = int | Sequence[int] | None


def _attrs(node: zarr.Group | zarr.Array) -> dict[str, Any]:
    """A node's attributes: JSON that integrity.check_step has checked (metadata_checks) before zarr opens the step."""
    return dict(node.attrs)


@overload
def _as_list(sel: None) -> None: ...
@overload
def _as_list(sel: int | Sequence[int]) -> list[int]: ...
def _as_list(sel: Selection) -> list[int] | None:
    if sel is None:
        return None
    if isinstance(sel, (int, np.integer)):
        return [int(sel)]
    return [int(s) for s in sel]


def open_dump(path: StrPath, rank: int | None = None) -> Dump:
    """Open a dump store lazily (root metadata only). `rank`: which rank's tree (default 0). A rank's folder of a
    multi-rank store (`run.zarr/rank_1`) opens that rank of the store."""
    p = Path(path)
    tree = rank_tree_of(p)
    if tree is not None:
        if rank is not None and int(rank) != tree[1]:
            raise DumpError(f"{p} is rank {tree[1]}'s tree of the dump {tree[0]}, not rank {rank}'s; give the store "
                            f"{tree[0]} and the rank")
        p, rank = tree
    hint = "give the path of a .zarr dump made by `fa-forensics capture`, `synth` or `import`"
    if not p.exists():
        raise DumpError(f"no dump at {p}: the path does not exist; {hint}")
    if not p.is_dir():
        kind = special_kind(os.stat(p).st_mode)
        raise DumpError(f"{p} is {'a file' if kind is None else kind}, not a dump store (a .zarr folder); {hint}")
    if not any(p.iterdir()):
        raise DumpError(f"{p} is an empty folder, not a dump; {hint}")
    if not os.path.lexists(p / "zarr.json"):
        kind = "a zarr v2 store" if (p / ".zgroup").exists() else "not a zarr store (no zarr.json)"
        raise DumpError(f"{p} is {kind}, not an fa-forensics dump; {hint}")
    leaving = link_leaving(p / "zarr.json", p)
    if leaving is not None:
        raise DumpError(f"damaged: {p}/zarr.json: the run's description is a link leaving the store (-> {leaving}); "
                        f"a dump holds its own data; {hint}")
    try:
        root_meta = read_metadata(p)
    except ValueError as exc:
        raise DumpError(f"damaged: {p}/zarr.json: {exc}; {hint}") from None
    meta = root_meta.get("attributes", {}).get(ATTRS_KEY)
    if root_meta.get("node_type") != "group" or not isinstance(meta, dict):
        raise DumpError(f"{p} is a zarr store but not an fa-forensics dump (no '{ATTRS_KEY}' attributes); {hint}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DumpError(f"{p} has dump format_version {_short(version)}, this fa-forensics reads format "
                        f"{FORMAT_VERSION}; use a matching fa-forensics version or re-capture the dump")
    problems = attribute_problems(meta, ROOT_ATTRS, "run")
    if problems:
        raise DumpError(f"damaged: {p}/zarr.json: {problems[0]}; the dump's run description is malformed, "
                        "re-capture it")
    try:
        root = zarr.open_group(store=RegularFileStore(p, read_only=True), mode="r")
    except Exception as exc:
        raise DumpError(f"damaged: {p}/zarr.json: zarr cannot open it ({describe_error(exc)}); {hint}") from None
    return Dump(p, root, meta, rank)


class Dump:
    """One rank's tree of a dump store. Steps, layers and heads are ints; arrays come back as torch tensors."""

    def __init__(self, path: StrPath, root: zarr.Group, attrs: dict[str, Any], rank: int | None = None) -> None:
        self.path = Path(path)
        self.attrs = attrs
        self._root = root
        self.world_size = int(attrs.get("world_size", 1) or 1)
        self.rank = int(rank or 0)
        self._tree = self._rank_tree(self.rank)
        self._step_groups: dict[int, zarr.Group] = {}
        self._layer_groups: dict[tuple[int, int], zarr.Group] = {}
        self._checked: set[tuple[int, int]] = set()
        # With no whole step every reader method raises, naming the problem: no warning first (one line in all).
        cut = [s for s in self.incomplete_steps if s not in self.damage] if self.steps else []
        if cut:
            warnings.warn(
                f"{self.path}: step(s) {_listed(cut)} are incomplete (cut off while writing) and are skipped",
                IncompleteStepWarning,
                stacklevel=3,
            )
        if self.damage and self.steps:
            warnings.warn(self._damage_line(), IncompleteStepWarning, stacklevel=3)
        for problem in self.rank_damage:
            warnings.warn(f"{problem.line(self.path)}; it is not read as a rank of this run", IncompleteStepWarning,
                          stacklevel=3)

    def _damage_line(self, steps: list[int] | None = None) -> str:
        """'damaged: <file>: <what>; step(s) S are skipped (N more problems; verify lists them)'."""
        steps = list(self.damage) if steps is None else steps
        problems = [d for s in steps for d in self.damage[s]]
        more = len(problems) - 1
        return (f"{problems[0].line(self.path)}; step(s) {_listed(steps)} are damaged and are skipped"
                + (f" ({more} more problem(s): `fa-forensics verify {self.path}` lists them)" if more else ""))

    def _rank_tree(self, rank: int) -> zarr.Group:
        root_keys = set(_subdirs(self.path))
        ranks = [r for r in store_ranks(self.path) if r > 0]
        if rank == 0 and not (rank_key(0) in root_keys and not any(STEP_RE.match(k) for k in root_keys)):
            return self._root
        leaving = rank_links_out(self.path)
        if rank in leaving:
            raise DumpError(f"damaged: {self.path}/{rank_key(rank)}: rank {rank}'s tree is a link leaving the store "
                            f"({leaving[rank]}); a dump holds its own data, so rank {rank} cannot be read")
        if rank_key(rank) not in root_keys:
            have = sorted({0, *ranks})
            raise UnknownRank(rank, self.path, _listed(have))
        try:
            read_metadata(self.path / rank_key(rank))
            return child_group(self._root, rank_key(rank))
        except Exception as exc:
            what = str(exc) if isinstance(exc, ValueError) else f"zarr cannot open it ({describe_error(exc)})"
            raise DumpError(f"damaged: {self.path}/{rank_key(rank)}/zarr.json: {what}; rank {rank} cannot be read, "
                            "re-capture it") from None

    @cached_property
    def rank_damage(self) -> list[Damage]:
        """A Damage for every `rank_r` folder that is a link leaving the store (never read as a rank)."""
        return [Damage(None, None, rank_key(r), f"rank {r}'s tree is a link leaving the store ({where}); a dump holds "
                                                "its own data", rank_key(r))
                for r, where in sorted(rank_links_out(self.path).items())]

    @cached_property
    def ranks(self) -> list[int]:
        """Every rank whose tree the store holds (0, the root, always)."""
        return store_ranks(self.path)

    @property
    def _tree_path(self) -> Path:
        return self.path if self._tree is self._root else self.path / rank_key(self.rank)

    # -- steps ----------------------------------------------------------------------------
    @cached_property
    def _step_status(self) -> dict[int, bool]:
        """step -> whole? A step is whole when its `complete` flag is set and integrity.check_step
        finds no damage (metadata only); damaged steps go to `damage`. zarr opens only whole steps."""
        status: dict[int, bool] = {}
        damage: dict[int, list[Damage]] = {}
        tree = self._tree_path
        for key in _subdirs(tree):
            m = STEP_RE.match(key)
            if not m:
                continue
            step = int(m.group(1))
            problems = check_step(tree / key, step, self.path)
            try:
                complete = read_metadata(tree / key).get("attributes", {}).get("complete") is True
                readable = True
            except ValueError:  # metadata cut mid-write or damaged: check_step names it
                complete, readable = False, False
            g: zarr.Group | None = None
            if complete and not problems:
                try:
                    g = child_group(self._tree, key)
                except Exception as exc:  # metadata zarr refuses though it passed the checks
                    problems = [Damage(step, None, None, f"zarr cannot open it ({describe_error(exc)})",
                                       relative(tree / key / "zarr.json", self.path))]
            if problems and (complete or not readable):  # unreadable step metadata: damage (or a write cut short)
                damage[step] = problems
            status[step] = complete and not problems
            if status[step] and g is not None:
                self._step_groups[step] = g
        self._damage = damage
        return dict(sorted(status.items()))

    @property
    def damage(self) -> dict[int, list[Damage]]:
        """Damaged steps (complete flag set, but something is missing or malformed) -> what is wrong."""
        self._step_status  # noqa: B018 - the property fills _damage
        return self._damage

    @property
    def steps(self) -> list[int]:
        """Sorted complete step numbers."""
        return [s for s, ok in self._step_status.items() if ok]

    @property
    def incomplete_steps(self) -> list[int]:
        """Steps that were cut off while writing or are damaged (skipped by every reader method)."""
        return [s for s, ok in self._step_status.items() if not ok]

    def _step(self, step: int) -> zarr.Group:
        step = int(step)
        if step in self._step_groups:
            return self._step_groups[step]
        if step in self.damage:
            raise DumpError(f"{self._damage_line([step])}; whole steps: {_listed(self.steps)}")
        if step in self.incomplete_steps:
            raise DumpError(f"step {step} in {self.path} is incomplete (cut off while writing); complete steps: "
                            f"{_listed(self.steps)}")
        raise DumpError(f"step {step} is not in {self.path}; complete steps: {_listed(self.steps)}")

    def step_attrs(self, step: int) -> dict[str, Any]:
        """The step's attributes: step, complete, loss (if recorded), ..."""
        return dict(self._step(step).attrs)

    # -- layers and heads -----------------------------------------------------------------
    def layers(self, step: int | None = None) -> list[int]:
        """Layers of `step`, or the union over complete steps when step is None."""
        steps = self.steps if step is None else [int(step)]
        found: set[int] = set()
        for s in steps:
            self._step(s)
            for key in _subdirs(self._tree_path / f"step_{int(s):09d}"):
                if m := LAYER_RE.match(key):
                    found.add(int(m.group(1)))
        return sorted(found)

    def _layer(self, step: int, layer: int) -> zarr.Group:
        key = (int(step), int(layer))
        if key not in self._layer_groups:
            sg = self._step(step)
            lk = layer_key(layer)
            if lk not in sg:
                raise DumpError(f"layer {layer} is not in step {step} of {self.path}; layers: "
                                f"{_listed(self.layers(step))}")
            self._layer_groups[key] = child_group(sg, lk)
        return self._layer_groups[key]

    def _array_names(self, step: int, layer: int) -> list[str]:
        g = self._layer(step, layer)
        folder = set(_subdirs(self._tree_path / f"step_{int(step):09d}" / layer_key(layer)))
        present = [n for n in ARRAY_NAMES if n in folder]
        if (int(step), int(layer)) not in self._checked:
            listed = _attrs(g).get("arrays", present)
            missing = [n for n in listed if n not in present]
            if missing:
                raise DumpError(
                    f"step {step} layer {layer} of {self.path} lists array(s) {_listed(missing)} that are missing from "
                    f"the store (damaged dump; present: {_listed(present)}); re-capture or re-import it"
                )
            self._checked.add((int(step), int(layer)))
        return present

    def has(self, step: int, layer: int, name: str) -> bool:
        """Whether step/layer/name exists (False for a missing step or layer, too)."""
        try:
            return name in self._array_names(step, layer)
        except DumpError:
            return False

    def do_missing(self) -> dict[str, list[int]]:
        """{layer: [complete steps whose recorded layer has no dO]} (the layers a capture saw no gradient of)."""
        missing: dict[str, list[int]] = {}
        for s in self.steps:
            for l in self.layers(s):
                if not self.has(s, l, "do"):
                    missing.setdefault(str(l), []).append(int(s))
        return missing

    def _array(self, step: int, layer: int, name: str) -> zarr.Array:
        if name not in ARRAY_NAMES:
            raise DumpError(f"unknown array name {name!r}; dump arrays are {', '.join(ARRAY_NAMES)}")
        names = self._array_names(step, layer)
        if name not in names:
            raise DumpError(f"array '{name}' is not in step {step} layer {layer} of {self.path}; arrays there: "
                            f"{_listed(names)}")
        return bounded(child_array(self._layer(step, layer), name))

    def layer_info(self, step: int, layer: int) -> LayerInfo:
        """Attention settings and array shapes of one layer of one step."""
        a = _attrs(self._layer(step, layer))
        arrays = {n: tuple(int(s) for s in self._array(step, layer, n).shape) for n in self._array_names(step, layer)}
        head_shape = next((arrays[n] for n in HEAD_TENSORS if n in arrays), None)
        n_heads = int(a.get("n_heads") or (head_shape[1] if head_shape else 0))
        head_dim = int(a.get("head_dim") or (head_shape[3] if head_shape else 0))
        scale = a.get("scale")
        scale = float(scale) if scale is not None else (1.0 / math.sqrt(head_dim) if head_dim else float("nan"))
        return LayerInfo(
            module=a.get("module"),
            n_heads=n_heads,
            head_dim=head_dim,
            scale=scale,
            causal=bool(a.get("causal", True)),
            dtype=str(a.get("dtype") or "unknown"),
            arrays=arrays,
            dropout_p=float(a.get("dropout_p") or 0.0),
            mask=a.get("mask"),
            autocast=a.get("autocast"),
            input_dtype=a.get("input_dtype"),
            call={k: a[k] for k in CALL_ATTR_KEYS if k in a},
        )

    def heads(self, step: int, layer: int) -> list[int]:
        """The model's head numbers stored for one layer, in storage order.

        A capture restricted with --heads records them in the layer attribute `heads`; without
        it the stored heads are the model's heads 0 .. n_heads-1.
        """
        stored = _attrs(self._layer(step, layer)).get("heads")
        if stored is not None:
            return [int(h) for h in stored]
        return list(range(self.layer_info(step, layer).n_heads))

    def _head_positions(self, step: int, layer: int, heads: Selection | slice, where: str) -> slice | list[int]:
        """Storage positions (dim 1) of the requested model head numbers."""
        have = self.heads(step, layer)
        if heads is None:
            return slice(None)
        if isinstance(heads, slice):
            wanted = have[heads]
            if not wanted:
                raise DumpError(f"head selection {heads.start}:{heads.stop} is empty for {where} "
                                f"(heads: {_listed(have)})")
            return [have.index(h) for h in wanted]
        wanted = _as_list(heads)
        bad = [h for h in wanted if h not in have]
        if bad:
            raise DumpError(f"head {_listed(bad)} not in {where}; heads stored: {_listed(have)}")
        return [have.index(h) for h in wanted]

    # -- values ---------------------------------------------------------------------------
    def read(self, step: int, layer: int, name: str, heads: Selection | slice = None,
             batch: Selection | slice = None) -> torch.Tensor:
        """One array as a torch tensor in its original dtype (bf16 / fp8 bit-exact).

        heads: int | list[int] | slice | None: the model's head numbers (see `heads()`; dim 1 of
        q/k/v/o/do; ignored for x);
        batch: int | slice | None (dim 0). An int keeps its dimension, so q/k/v/o/do always
        come back 4-D (B', H', T, D) and x 3-D (B', T, C). `mask` comes back 4-D and broadcastable
        to (B', H', Tq, Tk): its dims of size 1 (broadcast in SDPA) ignore the batch and head selection.
        """
        arr = self._array(step, layer, name)
        where = f"step {step} layer {layer} array '{name}' of {self.path}"
        broadcast_batch = name == MASK and arr.shape[0] == 1  # a mask keeps SDPA's broadcast dims (size 1)
        b_sel = slice(None) if broadcast_batch else self._index(batch, arr.shape[0], "batch", where)
        sel: tuple = (b_sel,)
        if name in HEAD_TENSORS or (name == MASK and arr.shape[1] > 1):
            sel = (b_sel, self._head_positions(step, layer, heads, where))
        dname = arr.attrs.get("dtype", str(arr.dtype))
        if dname not in supported_dtype_names():
            raise DumpError(f"{where} has unknown dtype attribute {dname!r}; supported: "
                            f"{', '.join(supported_dtype_names())}")
        try:
            data = arr.oindex[sel] if any(isinstance(s, list) for s in sel) else arr[sel]
        except Exception as exc:  # a chunk that does not decode: name it
            key = bad_chunk(arr, sel)
            folder = self._tree_path / f"step_{int(step):09d}" / layer_key(layer) / name
            located, chunk = (f"{folder}/{key}", f"chunk {key}") if key else (str(folder), "a chunk")
            raise DumpError(f"damaged: {located}: {chunk} of step {step} layer {layer} array '{name}' cannot be "
                            f"decoded ({describe_error(exc)}); run `fa-forensics verify {self.path}` and re-capture "
                            "the step") from None
        return decode(np.asarray(data), dname)

    @staticmethod
    def _index(sel: Selection | slice, size: int, what: str, where: str) -> slice | list[int]:
        if sel is None:
            return slice(None)
        if isinstance(sel, slice):
            if len(range(*sel.indices(size))) == 0:
                raise DumpError(f"{what} selection {sel.start}:{sel.stop} is empty for {where} ({size} {what}s: "
                                f"0..{size - 1})")
            return sel
        idx = _as_list(sel)
        bad = [i for i in idx if not 0 <= i < size]
        if bad:
            raise DumpError(f"{what} {_listed(bad)} not in {where}; it has {size} {what}s: 0..{size - 1}")
        return idx

    # -- selections and summaries ---------------------------------------------------------
    def select(self, steps: Selection = None, layers: Selection = None,
               heads: Selection = None) -> list[tuple[int, int, list[int]]]:
        """(step, layer, heads) triples for the selection; None = everything that exists.

        Raises DumpError naming what is missing and what exists.
        """
        step_list = _as_list(steps)
        if step_list is None:
            step_list = self.steps
            if not step_list:
                raise DumpError(self._no_whole_step())
        out: list[tuple[int, int, list[int]]] = []
        for s in step_list:
            self._step(s)  # raises with the list of steps
            layer_list = _as_list(layers)
            for l in layer_list if layer_list is not None else self.layers(s):
                self._array_names(s, l)  # raises for a missing layer or a damaged one
                have = self.heads(s, l)
                head_list = _as_list(heads)
                if head_list is None:
                    head_list = have
                bad = [h for h in head_list if h not in have]
                if bad:
                    raise DumpError(f"head {_listed(bad)} not in step {s} layer {l} of {self.path}; heads stored: "
                                    f"{_listed(have)}")
                out.append((s, l, head_list))
        return out

    def _no_whole_step(self) -> str:
        if self.damage:
            return f"{self._damage_line()}; {self.path} has no whole step, re-capture it"
        return f"{self.path} has no complete step (incomplete: {_listed(self.incomplete_steps)}); re-capture it"

    @property
    def ground_truth(self) -> dict[str, Any] | None:
        """What `synth` planted (None for a captured dump)."""
        gt = self.attrs.get("ground_truth")
        return dict(gt) if isinstance(gt, dict) else None

    @cached_property
    def timeline_damage(self) -> list[Damage]:
        """What is wrong with the timeline's metadata or files ([] when it reads whole, or there is none)."""
        if TIMELINE_GROUP not in _subdirs(self._tree_path):
            return []
        return check_timeline(self._tree_path / TIMELINE_GROUP, self.path)

    def _timeline_arrays(self) -> dict[str, zarr.Array] | None:
        if TIMELINE_GROUP not in _subdirs(self._tree_path):
            return None
        if self.timeline_damage:
            more = len(self.timeline_damage) - 1
            raise DumpError(f"{self.timeline_damage[0].line(self.path)}; the timeline cannot be read"
                            + (f" ({more} more problem(s): `fa-forensics verify {self.path}` lists them)"
                               if more else "") + "; re-capture it")
        try:
            tl = child_group(self._tree, TIMELINE_GROUP)
            arrays = {k: bounded(child_array(tl, k)) for k in sorted(tl.array_keys())}
        except Exception as exc:  # metadata zarr refuses though it passed the checks
            raise DumpError(f"damaged: {self._tree_path / TIMELINE_GROUP}: zarr cannot open it "
                            f"({describe_error(exc)}); re-capture the timeline") from None
        return arrays or None

    @cached_property
    def timeline(self) -> dict[str, np.ndarray] | None:
        """Per-step series (name -> array with a leading step axis), or None if none were recorded."""
        arrays = self._timeline_arrays()
        if arrays is None:
            return None
        # Rows are appended array by array: a run killed mid-append leaves one array a row
        # longer. Keep only the rows every array holds, never a half-written row.
        n = min(a.shape[0] for a in arrays.values())
        try:
            return {k: np.asarray(a[:n]) for k, a in arrays.items()}
        except Exception as exc:  # a chunk that does not decode
            raise DumpError(f"damaged: {self._tree_path / TIMELINE_GROUP}: a chunk cannot be decoded "
                            f"({describe_error(exc)}); run `fa-forensics verify {self.path}`") from None

    def timeline_shapes(self) -> dict[str, list[int]] | None:
        """Shape of each timeline series as `timeline` returns it, from the metadata alone (no value is read)."""
        arrays = self._timeline_arrays()
        if arrays is None:
            return None
        n = min(a.shape[0] for a in arrays.values())
        return {k: [n, *a.shape[1:]] for k, a in arrays.items()}

    def summary(self, step: int | None = None, layer: int | None = None) -> dict[str, Any]:
        """Everything `fa-forensics info --json` prints (keys documented in docs/json.md).

        Layer details come from the first complete step holding each layer, or from `step`;
        `layer` restricts them to one layer. A missing step or layer raises DumpError.
        """
        if step is not None or layer is not None:
            self.select(steps=step, layers=layer)
        if self.damage and not self.steps:
            raise DumpError(self._no_whole_step())
        layers = self.layers(step) if layer is None else [int(layer)]
        arrays: dict[str, dict[str, Any]] = {}
        heads: dict[str, list[int]] = {}
        layer_infos: dict[str, dict[str, Any]] = {}
        for l in layers:
            s = int(step) if step is not None else next(s for s in self.steps if l in self.layers(s))
            info = self.layer_info(s, l)
            # the model's head numbers (layer attr `heads` when a capture kept only some)
            heads[str(l)] = self.heads(s, l)
            layer_infos[str(l)] = {k: v for k, v in info.to_dict().items() if k != "arrays"}
            arrays[str(l)] = {
                n: {"shape": list(shape), "dtype": child_array(self._layer(s, l), n).attrs.get("dtype"),
                    "chunks": list(child_array(self._layer(s, l), n).chunks)}
                for n, shape in info.arrays.items()
            }
        # every complete step is checked for damage, not only the first of each layer
        for s in self.steps:
            for l in self.layers(s):
                self._array_names(s, l)
        timeline = None
        try:
            timeline = self.timeline_shapes()
        except DumpError as exc:  # the steps are described all the same; the timeline's damage is said
            warnings.warn(str(exc), IncompleteStepWarning, stacklevel=2)
        return {
            "path": str(self.path),
            "format_version": self.attrs.get("format_version"),
            "tool_version": self.attrs.get("tool_version"),
            "torch_version": self.attrs.get("torch_version"),
            "device": self.attrs.get("device"),
            "amp_dtype": self.attrs.get("amp_dtype"),
            "world_size": self.world_size,
            "rank": self.rank,
            "ranks": self.ranks,
            "model": self.attrs.get("model", {}),
            "capture": self.attrs.get("capture", {}),
            "steps": self.steps,
            "incomplete_steps": self.incomplete_steps,
            "damage": {str(s): [str(d) for d in ds] for s, ds in self.damage.items()},
            "step_attrs": {str(s): {k: v for k, v in self.step_attrs(s).items() if k not in ("step", "complete")}
                           for s in self.steps},
            "layers": layers,
            "heads": heads,
            "layer_info": layer_infos,
            "arrays": arrays,
            "timeline": timeline or None,
            "ground_truth": self.ground_truth,
        }

    def __repr__(self) -> str:
        return f"Dump({str(self.path)!r}, steps={self.steps}, rank={self.rank})"
