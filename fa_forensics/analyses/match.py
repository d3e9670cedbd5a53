"""Replay fidelity: which recipe reproduces the O that training stored, bit for bit.

Every analysis compares a low-precision replay with an fp32 one; its findings describe the run
only if the low-precision replay computes what training computed. `match_layer` replays the
stored Q, K, V of one layer-step (with the dump's scale and causal flag) under each candidate
recipe, a preset with its own tiling under an accumulation model, and counts the stored-O
elements it reproduces bit for bit. Bits are compared in the stored O's dtype (a replay whose O
is wider is rounded to it, nearest-even, as a kernel's epilogue would). The search stops at the
first candidate that reproduces every element, unless `try_all`.

`best_recipe` is the cached form behind `--preset auto`: the match of one whole layer-step, kept in
the layer group's attributes with a fingerprint of the stored arrays (a changed dump recomputes).

Only the forward is fingerprinted: O is what the dump stores. Recipes that differ only in their
backward (bf16-autocast and bf16-autocast-train) give the same O; the candidate order puts the
training recipe first, so a dump made by training names it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import zarr

from fa_forensics.analyses.selection import LayerSelection, LayerTensors, load, replay_layer
from fa_forensics.errors import DumpError
from fa_forensics.replay.config import PRESETS, Accumulation, Precision, ReplayConfig
from fa_forensics.replay.kernel_recipes import KERNEL_RECIPES, kernel_presets

# Most likely first: the reference code as it trains, with and without its fix, then the
# forward-only readings, hardware kernels, and the rest.
_PRESET_ORDER = ("bf16-autocast-train", "bf16-autocast-stabilized", "bf16-autocast", "bf16-hw", "bf16",
                 "stabilized", "fp32", "fp8-s1", "fp8-s256", "fp8-s448")


@dataclass(frozen=True)
class CandidateRecipe:
    """One candidate: a preset (with its own tiling) under an accumulation model."""

    preset: str
    accumulation: str

    def config(self) -> ReplayConfig:
        return ReplayConfig.preset(self.preset).with_(accumulation=Accumulation(self.accumulation))


@dataclass(frozen=True)
class Candidate:
    """How well one recipe reproduces the stored O of one layer-step."""

    preset: str
    accumulation: str
    o_bits_equal: float  # share of stored-O elements reproduced bit for bit, in [0, 1]
    max_abs_err: float  # max |O_replay − O_stored| over finite elements (in fp64)
    n_elements: int


@dataclass(frozen=True)
class LayerMatch:
    step: int
    layer: int
    heads: list[int]
    best: Candidate
    candidates: list[Candidate]  # in the order tried


@dataclass(frozen=True)
class MatchResult:
    layers: list[LayerMatch]
    tried_all: bool
    compared_in: str  # dtype of the stored O the bits are compared in


_KERNEL_PRESETS = {r.preset for r in KERNEL_RECIPES}
_KERNELS_AFTER = "bf16-autocast"  # on a GPU dump the kernel recipes follow the reference code's readings


def candidate_recipes(head_dim: int = 64, n_keys: int = 1024, dtype: str = "bfloat16",
                      device: Optional[str] = None) -> list[CandidateRecipe]:
    """Every preset in `_PRESET_ORDER` (then any other non-stochastic one), each under ieee and
    tensor-core; tensor-core is left out where no product has low-precision operands (it would
    fall back to ieee and repeat the same replay). The hardware kernels' recipes for a layer of this
    head dim, key count and stored dtype (with their tiles, tensor-core only: they model tensor-core
    kernels) come after the reference code's on a CUDA dump, last on any other (a CPU run stops early)."""
    names = list(_PRESET_ORDER) + [n for n in PRESETS if n not in _PRESET_ORDER and n != "stochastic"
                                   and n not in _KERNEL_PRESETS]
    kernels = [CandidateRecipe(k, Accumulation.TENSOR_CORE.value) for k in kernel_presets(head_dim, n_keys, dtype)]
    on_gpu = str(device or "").startswith("cuda")
    recipes = []
    for name in names:
        cfg = ReplayConfig.preset(name)
        recipes.append(CandidateRecipe(name, Accumulation.IEEE.value))
        if cfg.input_dtype is not Precision.FP32:
            recipes.append(CandidateRecipe(name, Accumulation.TENSOR_CORE.value))
        if name == _KERNELS_AFTER and on_gpu:
            recipes += kernels
    return recipes if on_gpu else recipes + kernels


def layer_candidates(t: LayerTensors) -> list[CandidateRecipe]:
    """candidate_recipes for the layer's head dim, key count, stored O dtype and the run's device."""
    dtype = str((t.o if t.o is not None else t.q).dtype).replace("torch.", "")
    device = (getattr(t.source, "attrs", None) or {}).get("device")
    return candidate_recipes(t.q.shape[-1], t.k.shape[-2], dtype, device)


def compare_o(replayed: torch.Tensor, stored: torch.Tensor) -> tuple[float, float, int]:
    """(share of elements with equal bits in stored's dtype, max |difference|, n elements)."""
    r = replayed.to(stored.dtype)
    n = stored.numel()
    if stored.dtype.itemsize == 2:
        equal = r.view(torch.int16) == stored.view(torch.int16)
    elif stored.dtype.itemsize == 4:
        equal = r.view(torch.int32) == stored.view(torch.int32)
    elif stored.dtype.itemsize == 1:
        equal = r.view(torch.int8) == stored.view(torch.int8)
    else:
        equal = r.view(torch.int64) == stored.view(torch.int64)
    diff = (replayed.double() - stored.double()).abs()
    finite = torch.isfinite(diff)
    max_err = float(diff[finite].max()) if finite.any() else math.nan
    return float(equal.sum()) / n, max_err, n


def match_layer(t: LayerTensors, recipes: Sequence[CandidateRecipe], *, try_all: bool = False, backend: str = "emulate") -> LayerMatch:
    """Replay one layer-step under each recipe until one reproduces every stored-O element."""
    if t.o is None:
        raise DumpError(f"{t.where}: the dump has no 'o' array; match compares replays with the stored O")
    tried: list[Candidate] = []
    for recipe in recipes:
        out = replay_layer(t, recipe.config(), backward=False, backend=backend)
        share, max_err, n = compare_o(out.o, t.o)
        tried.append(Candidate(recipe.preset, recipe.accumulation, share, max_err, n))
        if share == 1.0 and not try_all:
            break
    order = {id(c): i for i, c in enumerate(tried)}
    best = max(tried, key=lambda c: (c.o_bits_equal, -(c.max_abs_err if math.isfinite(c.max_abs_err) else math.inf), -order[id(c)]))
    return LayerMatch(t.step, t.layer, list(t.heads), best, tried)


def match(dump, selections: Sequence[LayerSelection], *, try_all: bool = False, backend: str = "emulate",
          recipes: Optional[Sequence[CandidateRecipe]] = None, progress: Optional[Callable[..., None]] = None,
          workers=None) -> MatchResult:
    """match_layer for every selected layer-step (all selected heads at once), each a work item on
    `workers`. A whole layer-step (every stored head) under the default candidates is `best_recipe`'s:
    read from the dump's cache and written there, so `match` and `--preset auto` share one result."""
    from fa_forensics.analyses.fanout import Workers, map_layers

    cached = recipes is None and not try_all and backend == "emulate"
    recipes = list(recipes) if recipes is not None else None
    parts = map_layers(_match_part, dump, selections, workers or Workers(), progress,
                       args=(recipes, cached, try_all, backend), whole_layers=True)
    return MatchResult([lm for lm, _ in parts], try_all, parts[-1][1] if parts else "")


def _match_part(t: LayerTensors, recipes, cached: bool, try_all: bool, backend: str) -> tuple[LayerMatch, str]:
    """(the match of one layer-step, the stored O's dtype)."""
    if t.o is None:
        raise DumpError(f"{t.where}: the dump has no 'o' array; match compares replays with the stored O")
    dump = t.source
    lm = None
    if cached and dump is not None and list(t.heads) == list(dump.heads(t.step, t.layer)):
        lm = best_recipe(dump, t.step, t.layer, backend=backend)
    if lm is None:
        lm = match_layer(t, recipes if recipes is not None else layer_candidates(t), try_all=try_all, backend=backend)
    return lm, str(t.o.dtype).replace("torch.", "")


# ---- the per-layer cache behind `--preset auto` ---------------------------------------------
CACHE_ATTR = "replay_match"  # layer-group attribute holding the cached result (one per accumulation restriction)
CACHE_VERSION = 1  # part of the fingerprint: raise it when a recipe's arithmetic changes

# Per opened Dump: (step, layer, accumulation restriction) -> LayerMatch (or None: no stored O).
_BEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fingerprint(t: LayerTensors, recipes: Sequence[CandidateRecipe]) -> str:
    """sha256 of what a match result depends on: the stored q, k, v, o (and mask) bytes, scale,
    causal flag and the recipes tried (a changed dump or recipe list invalidates the cache)."""
    h = hashlib.sha256()
    for x in (t.q, t.k, t.v, t.o, t.mask):
        if x is None:
            h.update(b"none")
            continue
        h.update(str((tuple(x.shape), str(x.dtype))).encode())
        h.update(x.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr((CACHE_VERSION, t.scale, t.causal, [(r.preset, r.accumulation) for r in recipes])).encode())
    return h.hexdigest()


def _to_attr(lm: LayerMatch, key: str) -> dict:
    return {"fingerprint": key, "heads": lm.heads, "best": dataclasses.asdict(lm.best),
            "candidates": [dataclasses.asdict(c) for c in lm.candidates]}


def _from_attr(a: dict, step: int, layer: int) -> LayerMatch:
    cands = [Candidate(**c) for c in a["candidates"]]
    return LayerMatch(step, layer, list(a["heads"]), Candidate(**a["best"]), cands)


def _write_cache(dump, step: int, layer: int, name: str, value: dict) -> None:
    """Store the match in the layer group's attributes under the dump's writer lock; skipped, with no
    error, when another process holds the lock or the store cannot be written (the result stands).
    A local store's group metadata is replaced atomically (written beside it, then renamed), so an
    interrupted write never leaves the dump unreadable."""
    from fa_forensics.dump.lock import StoreLock

    try:
        with StoreLock(dump.path):
            meta_path = Path(dump.path) / dump._layer(step, layer).path / "zarr.json"
            if meta_path.is_file():
                meta = json.loads(meta_path.read_text())
                meta.setdefault("attributes", {})[name] = value
                tmp = meta_path.with_name(f".zarr.json.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(meta, indent=2))
                os.replace(tmp, meta_path)
            else:  # not a local directory store: zarr writes it
                zarr.open_group(str(dump.path), mode="r+")[dump._layer(step, layer).path].attrs[name] = value
    except Exception:  # held lock, read-only store or file system
        pass


def best_recipe(dump, step: int, layer: int, *, accumulation: Optional[Accumulation] = None,
                backend: str = "emulate") -> Optional[LayerMatch]:
    """The match of one whole layer-step (every stored head) over the candidate recipes (those under
    `accumulation` only, when given), or None when the layer stores no O. Read from the dump's cache
    when its fingerprint still fits, else computed and written back to the layer group's attributes."""
    try:
        memo = _BEST.setdefault(dump, {})
    except TypeError:  # not weak-referenceable (an in-memory stand-in): no reuse
        memo = {}
    acc = None if accumulation is None else Accumulation(accumulation).value
    if (step, layer, acc) in memo:
        return memo[(step, layer, acc)]
    t = load(dump, LayerSelection(step, layer, dump.heads(step, layer)))
    if t.o is None:
        memo[(step, layer, acc)] = None
        return None
    recipes = [r for r in layer_candidates(t) if acc is None or r.accumulation == acc]
    key = fingerprint(t, recipes)
    name = CACHE_ATTR if acc is None else f"{CACHE_ATTR}_{acc}"
    cached = dump._layer(step, layer).attrs.get(name)
    lm = None
    if isinstance(cached, dict) and cached.get("fingerprint") == key:
        try:
            lm = _from_attr(cached, step, layer)
        except (KeyError, TypeError):
            lm = None  # an unreadable cache is recomputed
    if lm is None:
        lm = match_layer(t, recipes, backend=backend)
        _write_cache(dump, step, layer, name, _to_attr(lm, key))
    memo[(step, layer, acc)] = lm
    return lm


# Per opened Dump: (step, layer, heads, config, backend) -> compare_o of the replayed O (None: no stored O).
_O_SHARES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fidelity(dump, selections: Sequence[LayerSelection], recipe, backend: str = "emulate") -> Optional[dict]:
    """The `replay_fidelity` of every analysis JSON: the share of stored-O elements the recipe's
    low-precision config (per layer-step, `recipe.lp_config_for`) reproduces bit for bit, pooled
    over the selected layer-steps and heads, and per layer-step with the preset replayed there.
    `preset` / `accumulation` name the replayed recipe ("per layer" when `auto` chose several),
    `requested` the one asked for; `unmatched` lists the layer-steps with no stored O to compare
    with. None when no layer stores O, unless `auto` had to fall back there (then o_bits_equal is None)."""
    from fa_forensics.analyses.recipe import lp_config_for, preset_at

    per_layer, unmatched, equal, total = [], [], 0.0, 0
    try:
        shares = _O_SHARES.setdefault(dump, {})
    except TypeError:  # not weak-referenceable (an in-memory stand-in): no reuse
        shares = {}
    for sel in selections:
        config = lp_config_for(dump, sel.step, sel.layer, recipe)
        key = (sel.step, sel.layer, tuple(sel.heads), config, backend)
        if key not in shares:  # the analyses of one report share a dump: replay each layer-step once
            t = load(dump, sel)
            shares[key] = None if t.o is None else compare_o(replay_layer(t, config, backward=False, backend=backend).o, t.o)
        if shares[key] is None:
            unmatched.append({"step": sel.step, "layer": sel.layer, "preset": preset_at(dump, sel.step, sel.layer, recipe)})
            continue
        share, _, n = shares[key]
        per_layer.append({"step": sel.step, "layer": sel.layer, "preset": preset_at(dump, sel.step, sel.layer, recipe),
                          "accumulation": config.accumulation.value, "o_bits_equal": share})
        equal, total = equal + share * n, total + n
    if not total and not (recipe.is_auto and unmatched):
        return None
    replayed = {(p["preset"], p["accumulation"]) for p in per_layer}
    preset, accumulation = replayed.pop() if len(replayed) == 1 else ("per layer", "per layer")
    if not per_layer:
        preset, accumulation = unmatched[0]["preset"], recipe.accumulation_name
    return {"preset": preset, "accumulation": accumulation, "requested": recipe.preset,
            "o_bits_equal": equal / total if total else None, "per_layer": per_layer, "unmatched": unmatched}
