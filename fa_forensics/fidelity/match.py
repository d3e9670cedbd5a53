"""Replay fidelity: which recipe reproduces the O that training stored, bit for bit.

Every analysis compares a low-precision replay with an fp32 one; its findings describe the run
only if the low-precision replay computes what training computed. `match_layer` replays the
stored Q, K, V of one layer-step (with the dump's scale and causal flag) under each candidate
recipe, a preset with its own tiling under an accumulation model, and counts the stored-O
elements it reproduces bit for bit. Bits are compared in the stored O's dtype (a replay whose O
is wider is rounded to it, nearest-even, as a kernel's epilogue would). The search stops at the
first candidate that reproduces every element, unless `try_all`. The candidates are those the
layer's recorded facts admit (`fidelity.candidates`), and the best is named preferring the
accumulation model the recorded device implies.

`best_recipe` is the cached form behind `--preset auto`: the match of one whole layer-step, kept in
the match cache beside the dump under a fingerprint of the stored arrays (`fidelity.match_cache`;
a changed dump recomputes; the dump is never written). `fidelity` is every analysis's
`replay_fidelity`: the share reproduced, why it cannot be measured where it cannot, and the sign
test of the mismatching elements (`fidelity.mismatch`).

Only the forward is fingerprinted: O is what the dump stores. Recipes that differ only in their
backward (bf16-autocast and bf16-autocast-train) give the same O; the candidate order puts the
training recipe first, so a dump made by training names it.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.enums import Accumulation, Precision
from fa_forensics.errors import DumpError
from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.candidates import admissible, pick_best
from fa_forensics.fidelity.mismatch import sign_test, tally
from fa_forensics.fidelity.recipe import lp_config_for, preset_at
from fa_forensics.fidelity.run_facts import UNKNOWN, RunFacts, facts_at
from fa_forensics.layers.fanout import Workers, map_layers
from fa_forensics.layers.selection import LayerSelection, LayerTensors, load, replay_layer
from fa_forensics.replay.config import PRESETS, ReplayConfig
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


def match_layer(t: LayerTensors, recipes: Sequence[CandidateRecipe], *, try_all: bool = False, backend: str = "emulate",
                facts: RunFacts = UNKNOWN) -> LayerMatch:
    """Replay one layer-step under each recipe until one reproduces every stored-O element; the best
    is named by `candidates.pick_best` (the accumulation model the recorded device implies first)."""
    if t.o is None:
        raise DumpError(f"{t.where}: the dump has no 'o' array; match compares replays with the stored O")
    tried: list[Candidate] = []
    for recipe in recipes:
        out = replay_layer(t, recipe.config(), backward=False, backend=backend)
        share, max_err, n = compare_o(out.o, t.o)
        tried.append(Candidate(recipe.preset, recipe.accumulation, share, max_err, n))
        if share == 1.0 and not try_all:
            break
    return LayerMatch(t.step, t.layer, list(t.heads), pick_best(tried, facts), tried)


def match(dump, selections: Sequence[LayerSelection], *, try_all: bool = False, backend: str = "emulate",
          recipes: Optional[Sequence[CandidateRecipe]] = None, progress: Optional[Callable[..., None]] = None,
          workers=None) -> MatchResult:
    """match_layer for every selected layer-step (all selected heads at once), each a work item on
    `workers`. A whole layer-step (every stored head) under the default candidates is `best_recipe`'s:
    read from the match cache and kept there, so `match` and `--preset auto` share one result."""
    cached = recipes is None and not try_all and backend == "emulate"
    parts = map_layers(_match_part, dump, selections, workers or Workers(), progress,
                       args=(None if recipes is None else list(recipes), cached, try_all, backend), whole_layers=True)
    return MatchResult([lm for lm, _ in parts], try_all, parts[-1][1] if parts else "")


def _match_part(t: LayerTensors, recipes, cached: bool, try_all: bool, backend: str) -> tuple[LayerMatch, str]:
    """(the match of one layer-step, the stored O's dtype); without given recipes, the candidates
    the layer's recorded facts admit."""
    if t.o is None:
        raise DumpError(f"{t.where}: the dump has no 'o' array; match compares replays with the stored O")
    dump = t.source
    lm = None
    if cached and dump is not None and list(t.heads) == list(dump.heads(t.step, t.layer)):
        lm = best_recipe(dump, t.step, t.layer, backend=backend)
    if lm is None:
        facts = facts_at(dump, t.step, t.layer)
        recipes = recipes if recipes is not None else admissible(layer_candidates(t), facts)
        lm = match_layer(t, recipes, try_all=try_all, backend=backend, facts=facts)
    return lm, str(t.o.dtype).replace("torch.", "")


# ---- the per-layer cache behind `--preset auto` ---------------------------------------------
CACHE_ATTR = match_cache.IN_DUMP_ATTR  # the layer attribute a dump may carry its match in (read, never written)
CACHE_VERSION = 5  # part of the fingerprint: raise it when a recipe's arithmetic changes

# Per opened Dump: (step, layer, accumulation restriction) -> LayerMatch (or None: no stored O).
_BEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(t: LayerTensors, recipes: Sequence[CandidateRecipe]) -> str:
    """sha256 of what a match result depends on: the stored q, k, v, o (and mask) bytes, scale,
    causal flag and the recipes tried (a changed dump or recipe list has another fingerprint)."""
    return match_cache.data_hash(t, (CACHE_VERSION, t.scale, t.causal, [(r.preset, r.accumulation) for r in recipes]))


def _to_entry(lm: LayerMatch) -> dict:
    return {"heads": lm.heads, "best": dataclasses.asdict(lm.best),
            "candidates": [dataclasses.asdict(c) for c in lm.candidates]}


def _from_entry(entry: dict, step: int, layer: int, allowed: Sequence[CandidateRecipe],
                facts: RunFacts) -> Optional[LayerMatch]:
    """The cached candidates the recipes `allowed` include, the best named by `pick_best`; None when the
    entry cannot answer (unreadable, or it stopped at a recipe not allowed before trying those that are)."""
    try:
        tried = [Candidate(**c) for c in entry["candidates"]]
        heads = list(entry["heads"])
    except (KeyError, TypeError):
        return None
    names = {(r.preset, r.accumulation) for r in allowed}
    kept = [c for c in tried if (c.preset, c.accumulation) in names]
    stopped_early = any(c.o_bits_equal == 1.0 for c in tried)
    if not kept or (stopped_early and not any(c.o_bits_equal == 1.0 for c in kept)):
        return None
    return LayerMatch(step, layer, heads, pick_best(kept, facts), kept)


def best_recipe(dump, step: int, layer: int, *, accumulation: Optional[Accumulation] = None,
                backend: str = "emulate") -> Optional[LayerMatch]:
    """The match of one whole layer-step (every stored head) over the candidate recipes the dump's
    recorded facts admit (those under `accumulation` only, when given), or None when the layer stores
    no O. Read from the match cache (or the match a dump carries in its attributes) when its fingerprint
    fits, else computed and kept in the cache (`fidelity.match_cache`); the dump is never written."""
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
    facts = facts_at(dump, step, layer)
    recipes = admissible([r for r in layer_candidates(t) if acc is None or r.accumulation == acc], facts)
    key = fingerprint(t, recipes)
    lm = None
    for entry in (match_cache.read(key), match_cache.in_dump(dump, step, layer, t, acc)):
        if entry is not None and lm is None:
            lm = _from_entry(entry, step, layer, recipes, facts)
    if lm is None:
        lm = match_layer(t, recipes, backend=backend, facts=facts)
        match_cache.write(key, _to_entry(lm))
    memo[(step, layer, acc)] = lm
    return lm


# Per opened Dump: (step, layer, heads, config, backend) -> (compare_o of the replayed O, its MismatchTally),
# or None: no stored O.
_O_SHARES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unverifiable_reason(facts: RunFacts) -> Optional[str]:
    """Why stored O cannot tell whether a replay computes what training computed (None: it can)."""
    if facts.has_dropout:
        return (f"attention dropout p={facts.dropout_p:g}: stored O includes dropout, which no replay of the stored "
                f"Q, K, V reproduces")
    if facts.is_fp32_run:
        return "trained in fp32: stored O is fp32 attention, not the low-precision recipe replayed"
    return None


def _precision_name(facts_list: Sequence[RunFacts]) -> Optional[str]:
    names = {f.precision for f in facts_list}
    return names.pop() if len(names) == 1 else ("mixed" if len(names) > 1 else None)


def fidelity(dump, selections: Sequence[LayerSelection], recipe, backend: str = "emulate", *,
             alpha: float) -> Optional[dict]:
    """The `replay_fidelity` of every analysis JSON: the share of stored-O elements the recipe's
    low-precision config (per layer-step, `recipe.lp_config_for`) reproduces bit for bit, pooled
    over the selected layer-steps and heads, and per layer-step with the preset replayed there;
    `mismatch`: the sign test of the elements it does not reproduce at level `alpha` (`fidelity.mismatch`).
    `preset` / `accumulation` name the replayed recipe ("per layer" where they differ between
    layer-steps), `requested` the one asked for; `unmatched` lists the layer-steps with no stored O
    to compare with, `unverifiable` those whose stored O cannot be compared (attention dropout, an
    fp32 run) with the reason; `run_precision` is the recorded precision (fp32, bf16, ...; None:
    not recorded). None when no layer stores O, unless `auto` had to fall back there or a layer is
    unverifiable (then o_bits_equal is None)."""
    per_layer, unmatched, unverifiable, tallies, facts_seen = [], [], [], [], []
    equal, total = 0.0, 0
    try:
        shares = _O_SHARES.setdefault(dump, {})
    except TypeError:  # not weak-referenceable (an in-memory stand-in): no reuse
        shares = {}
    for sel in selections:
        facts = facts_at(dump, sel.step, sel.layer)
        facts_seen.append(facts)
        config = lp_config_for(dump, sel.step, sel.layer, recipe)
        preset = preset_at(dump, sel.step, sel.layer, recipe)
        reason = unverifiable_reason(facts)
        if reason is not None:
            unverifiable.append({"step": sel.step, "layer": sel.layer, "preset": preset,
                                 "accumulation": config.accumulation.value, "reason": reason})
            continue
        key = (sel.step, sel.layer, tuple(sel.heads), config, backend)
        if key not in shares:  # the analyses of one report share a dump: replay each layer-step once
            t = load(dump, sel)
            if t.o is None:
                shares[key] = None
            else:
                o = replay_layer(t, config, backward=False, backend=backend).o
                shares[key] = (compare_o(o, t.o), tally(sel.step, sel.layer, sel.heads, o, t.o))
        if shares[key] is None:
            unmatched.append({"step": sel.step, "layer": sel.layer, "preset": preset})
            continue
        (share, _, n), counts = shares[key]
        tallies.append(counts)
        per_layer.append({"step": sel.step, "layer": sel.layer, "preset": preset,
                          "accumulation": config.accumulation.value, "o_bits_equal": share})
        equal, total = equal + share * n, total + n
    if not total and not ((recipe.is_auto and unmatched) or unverifiable):
        return None
    shown = per_layer or unverifiable
    presets = {p["preset"] for p in shown}
    accumulations = {p["accumulation"] for p in shown}
    preset = presets.pop() if len(presets) == 1 else "per layer"
    accumulation = accumulations.pop() if len(accumulations) == 1 else "per layer"
    if not shown:
        preset, accumulation = unmatched[0]["preset"], recipe.accumulation_name
    return {"preset": preset, "accumulation": accumulation, "requested": recipe.preset,
            "o_bits_equal": equal / total if total else None, "per_layer": per_layer, "unmatched": unmatched,
            "unverifiable": unverifiable, "verifiable": not unverifiable,
            "run_precision": _precision_name(facts_seen), "mismatch": sign_test(tallies, alpha)}
