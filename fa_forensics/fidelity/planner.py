"""The replay plan built at the edge of a run: each selected layer-step's facts read once, `auto` resolved once,
the configs decided once (`fidelity.plan.Plan`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from fa_forensics.fidelity.auto import resolve
from fa_forensics.fidelity.plan import LayerStepPlan, Plan
from fa_forensics.fidelity.recipe import Recipe, hp_config, lp_config_for, preset_at
from fa_forensics.fidelity.run_facts import RunFacts, facts_at


def _keys(selections: Sequence) -> list[tuple[int, int]]:
    return list(dict.fromkeys((sel.step, sel.layer) for sel in selections))


def plan_for(dump, selections: Sequence, recipe: Union[Recipe, Plan], *, known: Optional[Plan] = None,
             advance: Optional[Callable[..., None]] = None) -> Plan:
    """The Plan of `recipe` over the selected layer-steps of `dump` (None: layers built in memory). Each
    layer-step's facts are read once (taken from `known`, another plan of the same dump, where it has them) and
    `auto` is resolved once; a Plan that already covers the selections is returned as it is. `advance(text)` is
    called after each layer-step is resolved (a progress line)."""
    if isinstance(recipe, Plan):
        if recipe.covers(selections):
            return recipe
        known, recipe = known or recipe, recipe.recipe
    facts: dict[tuple[int, int], RunFacts] = {}
    for step, layer in _keys(selections):
        kept = None if known is None else known.find(step, layer)
        facts[(step, layer)] = kept.facts if kept is not None else facts_at(dump, step, layer)
        if dump is not None:  # layers built in memory replay what their (unknown) facts imply: nothing to match
            recipe = resolve(dump, [_Key(step, layer)], recipe, facts=facts)
        if advance is not None:
            advance(f"step {step} layer {layer}")
    return Plan(recipe, tuple(_layer_step(dump, step, layer, fact, recipe) for (step, layer), fact in facts.items()))


def plan_for_layers(layers: Sequence, recipe: Union[Recipe, Plan]) -> Plan:
    """`plan_for` over layer-steps already loaded (`LayerTensors`): of the dump they were read from when they
    share one, else of layers built in memory (no dump)."""
    sources = {id(t.source): t.source for t in layers}
    return plan_for(next(iter(sources.values())) if len(sources) == 1 else None, layers, recipe)


@dataclass(frozen=True)
class _Key:
    step: int
    layer: int


def _layer_step(dump, step: int, layer: int, facts: RunFacts, recipe: Recipe) -> LayerStepPlan:
    lp = lp_config_for(dump, step, layer, recipe)
    return LayerStepPlan(step, layer, facts, preset_at(dump, step, layer, recipe), lp, hp_config(lp))
