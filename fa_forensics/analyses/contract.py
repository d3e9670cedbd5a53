"""What every analysis's JSON carries besides its own numbers, computed in one place.

Each analysis module exposes `run(dump, selections, recipe, backend, ...) -> Result` (a frozen
dataclass with `warnings` and `replay_fidelity` fields) and `payload(result) -> dict`; its
payload starts from `common_keys(result)`, so the shared keys have one spelling and one source:

  warnings         list of one-line strings (from the layer checks of `selection.load`), [] if none
  replay_fidelity  what share of the stored O the replayed recipe reproduces (`replay_fidelity`, a
                   `fidelity.match.ReplayFidelity`), or null where it is not measured
  preset, accumulation, backend   the recipe and where it ran
  bias             the analysis's claim in one shape (`quantities.BiasClaim`): whether a bias exists by
                   the statistics policy (`significance`: Holm over the selection's family at α, and the
                   effect floor), where, and its sign; the report's verdict and the consistency of the
                   commands rest on it
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Optional

from fa_forensics.enums import Backend
from fa_forensics.fidelity.match import ReplayFidelity, UnmatchedLayer, UnverifiableLayer, fidelity
from fa_forensics.layers.fanout import map_layers
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.planner import plan_for
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.analyses.significance import ALPHA
from fa_forensics.analyses.wording import bit_share


FIDELITY_WARN_BELOW = 0.99  # o_bits_equal under which every analysis warns
MISMATCH_TEST_ABOVE = 0.88  # from this o_bits_equal on, the mismatches' sign test replaces the blanket caveat


def replay_fidelity(dump, selections: Sequence, plan: Plan) -> Optional[ReplayFidelity]:
    """Share of the stored O that the plan's replay reproduces bit for bit over `selections`
    (`fidelity.match.ReplayFidelity`: one forward replay per layer-step), or None for in-memory layers and
    dumps without O. An analysis stores what this returns in its Result's `replay_fidelity` and never computes
    it elsewhere.
    """
    if dump is None:
        return None
    return fidelity(dump, selections, plan, alpha=ALPHA)


def _where(items: Sequence[UnmatchedLayer | UnverifiableLayer]) -> str:
    where = ", ".join(f"step {u.step} layer {u.layer}" for u in items[:4])
    return where + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def precision_line(run_precision: Optional[str], preset: Optional[str]) -> Optional[str]:
    """What the run's recorded precision means for the findings, when it is not a low-precision run."""
    if run_precision != "fp32":
        return None
    if preset == "fp32":
        return "trained in fp32: no low-precision rounding to analyse; preset fp32 replays fp32 on both sides"
    return (f"trained in fp32: no low-precision rounding to analyse; the findings show what {preset} "
            f"would do on these inputs")


def fidelity_warnings(fid: Optional[ReplayFidelity]) -> list[str]:
    """One line each: the run's precision when it is fp32; the layer-steps whose fidelity cannot be
    verified and why; `auto` finding no stored O somewhere; and, under 99 % fidelity, either the
    mismatches' sign test (from 88 %) or that the findings describe the replayed recipe only."""
    if not fid:
        return []
    out = [line for line in (precision_line(fid.run_precision, fid.preset),) if line]
    fp32_run = fid.run_precision == "fp32"  # said once, by precision_line
    reasons = [u.reason for u in fid.unverifiable if not (fp32_run and u.reason.startswith("trained in fp32"))]
    for reason in dict.fromkeys(reasons):
        items = [u for u in fid.unverifiable if u.reason == reason]
        why = "the recipe the recorded settings imply" if fid.requested == "auto" else "as asked"
        out.append(f"replay fidelity unverifiable at {_where(items)}: {reason}; analysed with preset "
                   f"{items[0].preset} / {items[0].accumulation}, {why}")
    if fid.unmatched and fid.requested == "auto":
        out.append(f"preset auto: no stored O to match at {_where(fid.unmatched)}; replayed preset "
                   f"{fid.unmatched[0].preset} there, which may not be the kernel that trained (a named preset "
                   f"replays that recipe instead)")
    share = fid.o_bits_equal
    if share is None or share >= FIDELITY_WARN_BELOW:
        return out
    worst = min(fid.per_layer, key=lambda p: p.o_bits_equal)
    head = (f"replay fidelity: preset {fid.preset} / {fid.accumulation} reproduces {bit_share(share)} of the "
            f"stored O (worst step {worst.step} layer {worst.layer}: {100 * worst.o_bits_equal:.1f} %)")
    mismatch = fid.mismatch
    if share >= MISMATCH_TEST_ABOVE and mismatch:
        return out + [f"{head}; {mismatch.verdict}"]
    return out + [f"{head}: the findings describe that recipe, not the kernel that trained; `fa-forensics match` names "
                  f"the recipe that does"]


class RecipeResult:
    """The names of the recipe a Result replayed (`self.recipe`), for its tables and sentences."""

    @property
    def preset(self) -> str:
        return self.recipe.label

    @property
    def accumulation(self) -> str:
        return self.recipe.accumulation_name


def run_over_items(part: Callable, combine: Callable, dump, selections: Sequence, recipe: Recipe | Plan,
                   backend: Backend, *, workers, progress, args: tuple = ()):
    """The `run` of an analysis made of per-item parts: the plan of the recipe over the selected layer-steps built
    once (`fidelity.planner.plan_for`; a Plan given is used as it is), `part(t, plan, backend, *args)` on each work
    item (step, layer, head group) on `workers`, in item order (the same result for any number of workers),
    `combine(parts, resolved recipe)` into the Result, and the stored O's `replay_fidelity` attached."""
    plan = plan_for(dump, selections, recipe)
    parts = map_layers(part, dump, selections, workers, progress, args=(plan, backend, *args))
    return dataclasses.replace(combine(parts, plan.recipe), replay_fidelity=replay_fidelity(dump, selections, plan))


def recipe_keys(recipe: Recipe, backend: Backend) -> dict:
    """The JSON keys naming the replayed recipe: preset, accumulation, backend."""
    return {"preset": recipe.preset, "accumulation": recipe.accumulation_name, "backend": Backend(backend).value}


def common_keys(result) -> dict:
    """`warnings` and `replay_fidelity` of a Result, as every analysis's JSON carries them."""
    return {"warnings": list(result.warnings) + fidelity_warnings(result.replay_fidelity),
            "replay_fidelity": result.replay_fidelity}


