"""Replay fidelity: which recipe reproduces the O that training stored, bit for bit.

Every analysis compares a low-precision replay with an fp32 one; its findings describe the run
only if the low-precision replay computes what training computed. `match` replays the stored
Q, K, V of each selected layer-step (with the dump's scale and causal flag) under the candidate
recipes, a preset with its own tiling under an accumulation model, and counts the stored-O
elements each reproduces bit for bit. Bits are compared in the stored O's dtype (a replay whose O
is wider is rounded to it, nearest-even, as a kernel's epilogue would). The candidates are those
the layer's recorded facts admit (`fidelity.candidates`); the search screens them on a row sample
and replays every element only for those that may win (`fidelity.search`); with `try_all` every
recipe, whatever the facts, on every element.

`best_recipe` is the cached form behind `--preset auto`: the match of one whole layer-step, kept in
the match cache beside the dump under a fingerprint of the stored arrays (`fidelity.match_cache`;
a changed dump recomputes; the dump is never written), and re-checked against the stored bits each
time it is read back (`fidelity.stored_match`). `fidelity` is every analysis's `replay_fidelity`:
the share reproduced, why it cannot be measured where it cannot, and the sign test of the
mismatching elements (`fidelity.mismatch`).

Only the forward is fingerprinted: O is what the dump stores. Recipes that differ only in their
backward (bf16-autocast and bf16-autocast-train) give the same O; the candidate order puts the
training recipe first, so a dump made by training names it.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from fa_forensics.enums import Accumulation, Backend
from fa_forensics.errors import DumpError
from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.candidates import (  # noqa: F401  (candidate_recipes: the catalogue, for callers)
    Admission, candidate_recipes, catalogue, layer_candidates,
)
from fa_forensics.fidelity.layer_match import (  # noqa: F401  (the result types, for callers)
    Candidate, CandidateRecipe, ExcludedWinner, LayerMatch, MalformedEntry, to_entry,
)
from fa_forensics.fidelity.mismatch import MismatchTest, sign_test, tally
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.run_facts import RunFacts, facts_at
from fa_forensics.fidelity.sample import compare_o, row_sample  # noqa: F401  (compare_o: the bit comparison)
from fa_forensics.fidelity.search import match_layer, screen_only
from fa_forensics.fidelity.stored_match import answer, rechecked
from fa_forensics.layers.fanout import Workers, map_layers
from fa_forensics.layers.selection import LayerSelection, LayerTensors, load, replay_layer


@dataclass(frozen=True)
class MatchResult:
    layers: list[LayerMatch]
    tried_all: bool
    compared_in: str  # dtype of the stored O the bits are compared in
    overridden: dict  # --all: (step, layer) -> {fact: number of recipes it would have excluded}


def match(dump, selections: Sequence[LayerSelection], *, try_all: bool = False, backend: Backend = Backend.EMULATE,
          recipes: Optional[Sequence[CandidateRecipe]] = None, progress: Optional[Callable[..., None]] = None,
          workers=None) -> MatchResult:
    """The match of every selected layer-step (all selected heads at once), each a work item on
    `workers`. A whole layer-step (every stored head) under the default candidates is `best_recipe`'s:
    read from the match cache (re-checked) and kept there, so `match` and `--preset auto` share one result.
    `try_all`: every recipe, whatever the recorded facts, on every element."""
    backend = Backend(backend)
    cached = recipes is None and not try_all and backend is Backend.EMULATE
    parts = map_layers(_match_part, dump, selections, workers or Workers(), progress,
                       args=(None if recipes is None else list(recipes), cached, try_all, backend), whole_layers=True)
    overridden = {(lm.step, lm.layer): over for lm, _, over in parts if over}
    return MatchResult([lm for lm, _, _ in parts], try_all, parts[-1][1] if parts else "", overridden)


def _overridden(admission: Admission) -> dict:
    """{fact: recipes it excludes} of an admission (what `--all` tries against the recorded facts)."""
    out: dict[str, int] = {}
    for _, facts in admission.excluded:
        for fact in facts:
            out[fact] = out.get(fact, 0) + 1
    return out


def _match_part(t: LayerTensors, recipes, cached: bool, try_all: bool,
                backend: Backend) -> tuple[LayerMatch, str, dict]:
    """(the match of one layer-step, the stored O's dtype, the facts `try_all` overrode); without given recipes,
    the candidates the layer's recorded facts admit."""
    if t.o is None:
        raise DumpError(f"{t.where}: the dump has no 'o' array; match compares replays with the stored O")
    dump: Any = t.source  # the Dump the layer-step was read from (LayerTensors.source), or None
    lm = None
    if cached and dump is not None and list(t.heads) == list(dump.heads(t.step, t.layer)):
        lm = best_recipe(dump, t.step, t.layer, backend=backend)
    overridden = {}
    if lm is None:
        facts = facts_at(dump, t.step, t.layer)
        admission = layer_candidates(t, facts)
        if recipes is not None:
            lm = match_layer(t, recipes, try_all=try_all, backend=backend, facts=facts)
        elif try_all:
            overridden = _overridden(admission)
            lm = match_layer(t, catalogue(t, facts), try_all=True, backend=backend, facts=facts)
        else:
            lm = match_layer(t, admission.recipes, backend=backend, facts=facts,
                             excluded=[r for r, _ in admission.excluded], relaxed=admission.relaxed)
    return lm, str(t.o.dtype).replace("torch.", ""), overridden


# ---- the per-layer cache behind `--preset auto` ---------------------------------------------
CACHE_ATTR = match_cache.IN_DUMP_ATTR  # the layer attribute a dump may carry its match in (read, never written)
CACHE_VERSION = 7  # part of the fingerprint: raise it when a recipe's arithmetic or the entry's form changes

# Per opened Dump: (step, layer, accumulation restriction) -> LayerMatch (or None: no stored O).
_BEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(t: LayerTensors, recipes: Sequence[CandidateRecipe]) -> str:
    """sha256 of what a match result depends on: the stored q, k, v, o (and mask) bytes, scale,
    causal flag and the recipes tried (a changed dump or recipe list has another fingerprint)."""
    return match_cache.data_hash(t, (CACHE_VERSION, t.scale, t.causal, [(r.preset, r.accumulation) for r in recipes]))


def _kept(t: LayerTensors, dump, key: str, admission: Admission, facts: RunFacts,
          acc: Optional[str], backend: Backend) -> Optional[LayerMatch]:
    """The match kept for this layer-step (the cache's, else the dump's own), when it is well formed and the
    stored bits agree with it; every other is set aside with one warning."""
    sources = (("the match cache's entry", match_cache.read(key), False),
               (f"the dump's attribute {match_cache.in_dump_name(acc)}",
                match_cache.in_dump(dump, t.step, t.layer, t, acc), True))
    for what, entry, in_dump in sources:
        if entry is None:
            continue
        try:
            lm, missing = answer(entry, t.step, t.layer, admission.recipes, facts, in_dump=in_dump)
        except MalformedEntry as exc:
            match_cache.warn(f"{what} for step {t.step} layer {t.layer} is malformed ({exc}); matched again")
            continue
        if lm is None:
            continue
        lm, why = rechecked(t, lm, backend)
        if why is not None:
            match_cache.warn(f"{what} for step {t.step} layer {t.layer} is contradicted by the stored bits ({why}); "
                             f"discarded, matched again")
            continue
        return _with_missing(t, lm, missing, admission, backend)
    return None


def _with_missing(t: LayerTensors, lm: LayerMatch, missing: Sequence[CandidateRecipe], admission: Admission,
                  backend: Backend) -> Optional[LayerMatch]:
    """A kept match completed with the admitted recipes it did not try (searched now); None when one of those
    reproduces every element (a search now stops there: the kept match does not answer)."""
    if not missing:
        return lm
    before = screen_only(t, missing, backend)
    if any(c.o_bits_equal == 1.0 and not c.sampled for c in before):
        return None
    order = {(r.preset, r.accumulation): i for i, r in enumerate(admission.recipes)}
    tried = sorted([*before, *lm.candidates], key=lambda c: order[c.name])
    return replace(lm, candidates=tried, sample_rows=row_sample(t.q.shape[2]).to_list())


def best_recipe(dump, step: int, layer: int, *, accumulation: Optional[Accumulation] = None,
                backend: Backend = Backend.EMULATE, facts: Optional[RunFacts] = None) -> Optional[LayerMatch]:
    """The match of one whole layer-step (every stored head) over the candidate recipes the dump's
    recorded facts admit (those under `accumulation` only, when given), or None when the layer stores
    no O. Read from the match cache (or the match a dump carries in its attributes) when its fingerprint
    fits and the stored bits agree with it, else computed and kept in the cache (`fidelity.match_cache`);
    the dump is never written. `facts`: the layer-step's facts when already read."""
    try:
        memo = _BEST.setdefault(dump, {})
    except TypeError:  # not weak-referenceable (an in-memory stand-in): no reuse
        memo = {}
    acc = None if accumulation is None else Accumulation(accumulation).value
    backend = Backend(backend)
    if (step, layer, acc) in memo:
        return memo[(step, layer, acc)]
    t = load(dump, LayerSelection(step, layer, dump.heads(step, layer)))
    if t.o is None:
        memo[(step, layer, acc)] = None
        return None
    facts = facts_at(dump, step, layer) if facts is None else facts
    admission = layer_candidates(t, facts, acc)
    key = fingerprint(t, admission.recipes)
    lm = _kept(t, dump, key, admission, facts, acc, backend)
    if lm is None:
        lm = match_layer(t, admission.recipes, backend=backend, facts=facts,
                         excluded=[r for r, _ in admission.excluded], relaxed=admission.relaxed)
        match_cache.write(key, to_entry(lm))
    memo[(step, layer, acc)] = lm
    return lm


# Per opened Dump: (step, layer, heads, config, backend) -> (compare_o of the replayed O, its MismatchTally),
# or None: no stored O.
_O_SHARES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unverifiable_reason(facts: RunFacts) -> Optional[str]:
    """Why stored O cannot tell whether a replay of the analyses' low-precision recipe computes what training
    computed (None: it can): what makes O unreproducible (`RunFacts.unverifiable`), or an fp32 run."""
    if facts.unverifiable() is not None:
        return facts.unverifiable()
    if facts.is_fp32_run:
        return "trained in fp32: stored O is fp32 attention, not the low-precision recipe replayed"
    return None


def _precision_name(facts_list: Sequence[RunFacts]) -> Optional[str]:
    names = {f.precision for f in facts_list}
    return names.pop() if len(names) == 1 else ("mixed" if len(names) > 1 else None)


@dataclass(frozen=True)
class LayerFidelity:
    """The share of one layer-step's stored O elements the preset replayed there reproduces bit for bit."""

    step: int
    layer: int
    preset: str
    accumulation: str
    o_bits_equal: float


@dataclass(frozen=True)
class UnmatchedLayer:
    """A layer-step with no stored O to compare with, and the preset replayed there."""

    step: int
    layer: int
    preset: str


@dataclass(frozen=True)
class UnverifiableLayer:
    """A layer-step whose stored O cannot tell whether the replay computes what training computed, and why."""

    step: int
    layer: int
    preset: str
    accumulation: str
    reason: str


@dataclass(frozen=True)
class ReplayFidelity:
    """Every analysis's `replay_fidelity` (its JSON keys, in this order: docs/json.md).

    `preset` / `accumulation` name the replayed recipe ("per layer" where they differ between layer-steps),
    `requested` the one asked for; `o_bits_equal` the share of stored-O elements reproduced, pooled (None where
    nothing could be compared); `run_precision` the recorded precision (fp32, bf16, ..., "mixed"; None: not
    recorded); `mismatch` the sign test of the elements not reproduced (`fidelity.mismatch.sign_test`; None when
    every element matches)."""

    preset: str
    accumulation: str
    requested: str
    o_bits_equal: Optional[float]
    per_layer: tuple[LayerFidelity, ...]
    unmatched: tuple[UnmatchedLayer, ...]
    unverifiable: tuple[UnverifiableLayer, ...]
    verifiable: bool
    run_precision: Optional[str]
    mismatch: Optional[MismatchTest]


def fidelity(dump, selections: Sequence[LayerSelection], plan: Plan, backend: Backend = Backend.EMULATE, *,
             alpha: float) -> Optional[ReplayFidelity]:
    """The `replay_fidelity` of every analysis JSON: the share of stored-O elements the recipe's
    low-precision config (per layer-step, as the `fidelity.plan.Plan` gives it) reproduces bit for bit, pooled
    over the selected layer-steps and heads, and per layer-step with the preset replayed there;
    `mismatch`: the sign test of the elements it does not reproduce at level `alpha` (`fidelity.mismatch`).
    `unmatched` lists the layer-steps with no stored O to compare with, `unverifiable` those whose stored O
    cannot be compared (attention dropout, an fp32 run) with the reason. None when no layer stores O, unless
    `auto` had to fall back there or a layer is unverifiable (then o_bits_equal is None)."""
    backend = Backend(backend)
    per_layer, unmatched, unverifiable, tallies, facts_seen = [], [], [], [], []
    equal, total = 0.0, 0
    try:
        shares = _O_SHARES.setdefault(dump, {})
    except TypeError:  # not weak-referenceable (an in-memory stand-in): no reuse
        shares = {}
    recipe = plan.recipe
    for sel in selections:
        planned = plan.at(sel.step, sel.layer)
        facts, config, preset = planned.facts, planned.lp, planned.preset
        facts_seen.append(facts)
        reason = unverifiable_reason(facts)
        if reason is not None:
            unverifiable.append(UnverifiableLayer(sel.step, sel.layer, preset, config.accumulation.value, reason))
            continue
        key = (sel.step, sel.layer, tuple(sel.heads), config, backend)
        if key not in shares:  # the analyses of one report share a dump: replay each layer-step once
            t = load(dump, sel)
            if t.o is None:
                shares[key] = None
            else:
                o = replay_layer(t, config, backward=False, backend=Backend(backend)).o
                shares[key] = (compare_o(o, t.o), tally(sel.step, sel.layer, sel.heads, o, t.o))
        if shares[key] is None:
            unmatched.append(UnmatchedLayer(sel.step, sel.layer, preset))
            continue
        (share, _, n), counts = shares[key]
        tallies.append(counts)
        per_layer.append(LayerFidelity(sel.step, sel.layer, preset, config.accumulation.value, share))
        equal, total = equal + share * n, total + n
    if not total and not ((recipe.is_auto and unmatched) or unverifiable):
        return None
    shown = per_layer or unverifiable
    presets = {p.preset for p in shown}
    accumulations = {p.accumulation for p in shown}
    preset = presets.pop() if len(presets) == 1 else "per layer"
    accumulation = accumulations.pop() if len(accumulations) == 1 else "per layer"
    if not shown:
        preset, accumulation = unmatched[0].preset, recipe.accumulation_name
    return ReplayFidelity(preset, accumulation, recipe.preset, equal / total if total else None, tuple(per_layer),
                          tuple(unmatched), tuple(unverifiable), not unverifiable, _precision_name(facts_seen),
                          sign_test(tallies, alpha))
