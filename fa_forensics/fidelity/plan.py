"""A layer-step's replay decided once: its recorded facts, the recipe resolved there, the configs it replays.

An analysis run reads each selected layer-step's facts and resolves its recipe at the edge
(`fidelity.planner.plan_for`: the CLI's `AnalysisArgs.open`, or an analysis's `run` for a library caller) into
one frozen `Plan`. Fidelity, replay and the analyses' work items read the plan (`Plan.at`) and never the dump's
attributes again, nor resolve the recipe again. A Plan is plain frozen data: the work items sent to other
processes carry it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from fa_forensics.errors import ConfigError
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.fidelity.run_facts import RunFacts
from fa_forensics.replay.config import ReplayConfig


@dataclass(frozen=True)
class LayerStepPlan:
    """What one layer-step replays: its recorded facts, the preset replayed there, the low-precision config
    (`recipe.lp_config_for`) and the high-precision one (`recipe.hp_config`)."""

    step: int
    layer: int
    facts: RunFacts
    preset: str
    lp: ReplayConfig
    hp: ReplayConfig


@dataclass(frozen=True)
class Plan:
    """The resolved recipe of a run and the LayerStepPlan of every layer-step it replays."""

    recipe: Recipe
    layer_steps: tuple[LayerStepPlan, ...]

    @property
    def label(self) -> str:
        return self.recipe.label

    def find(self, step: int, layer: int) -> Optional[LayerStepPlan]:
        return next((ls for ls in self.layer_steps if (ls.step, ls.layer) == (step, layer)), None)

    def at(self, step: int, layer: int) -> LayerStepPlan:
        """The plan of (step, layer); a ConfigError for a layer-step it was not built over."""
        found = self.find(step, layer)
        if found is None:
            raise ConfigError(f"the replay plan has no step {step} layer {layer}: build it over the selections "
                              f"replayed (fidelity.planner.plan_for)")
        return found

    def covers(self, selections: Sequence) -> bool:
        return all(self.find(sel.step, sel.layer) is not None for sel in selections)
