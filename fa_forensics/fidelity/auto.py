"""Preset `auto` decided per layer-step: the recipe that reproduces the stored O best.

`resolve(dump, selections, recipe)` returns the Recipe with a `Choice` for every selected layer-step
(itself for a named preset); the CLI calls it once per command (commands/common.py) and hands the
resolved Recipe down, and a library caller's `run` resolves what it was given (a no-op when resolved).
A layer-step is matched whole (every stored head) by `match.best_recipe`: the first time a dump is
matched its result is kept in the match cache beside it (`fidelity.match_cache`; the dump itself is
never written), afterwards it is read back. Where nothing can be matched (attention dropout, an fp32
run, no stored O, a layer built in memory) `auto` replays the recipe the recorded settings imply
(`recipe.implied_choice`; FALLBACK_PRESET when nothing points elsewhere) and says so in the
analysis's warnings.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Optional

from fa_forensics.enums import Accumulation
from fa_forensics.fidelity.match import best_recipe
from fa_forensics.fidelity.recipe import Choice, Recipe, implied_choice
from fa_forensics.fidelity.run_facts import RunFacts, facts_at


def choose(dump, step: int, layer: int, recipe: Recipe, facts: Optional[RunFacts] = None) -> Choice:
    """The Choice of `auto` at (step, layer): resolved, else matched (cached beside the dump), else the
    recipe the recorded settings imply (`recipe.implied_choice`): where the stored O cannot be matched
    (attention dropout or another option no replay applies, an fp32 run, no stored O, arrays that do not fit
    their layout, a layer built in memory). `facts`: the layer-step's facts when already read."""
    known = recipe.choice_at(step, layer)
    if known is not None:
        return known
    facts = facts_at(dump, step, layer) if facts is None else facts
    fallback = implied_choice(facts, recipe)
    if dump is None or facts.unverifiable() is not None or facts.is_fp32_run:
        return fallback
    lm = best_recipe(dump, step, layer, accumulation=recipe.accumulation, facts=facts)
    if lm is None:
        return fallback
    if lm.unverifiable is not None:
        return replace(fallback, why=lm.unverifiable)
    return Choice(lm.best.preset, Accumulation(lm.best.accumulation), lm.best.o_bits_equal)


def resolve(dump, selections: Sequence, recipe: Recipe,
            facts: Optional[Mapping[tuple[int, int], RunFacts]] = None) -> Recipe:
    """`recipe` with `auto` decided for every selected layer-step (itself for a named preset); `facts`: the
    layer-steps' facts already read ((step, layer) -> RunFacts)."""
    if not recipe.is_auto:
        return recipe
    choices = dict(recipe.choices)
    for sel in selections:
        key = (sel.step, sel.layer)
        if key not in choices:
            choices[key] = choose(dump, sel.step, sel.layer, recipe, None if facts is None else facts.get(key))
    return replace(recipe, choices=tuple(choices.items()))
