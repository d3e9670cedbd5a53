"""The comparison every analysis makes: the recipe's low-precision replay of a layer-step against the
high-precision replay (preset "fp32", ieee) of the same inputs as the recipe sees them (`as_seen_by`).

The plan is built before it gets here (`fidelity.planner.plan_for`): these functions only read the configs it
holds per layer-step.
"""
from __future__ import annotations

from fa_forensics.enums import Backend
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.recipe import hp_config
from fa_forensics.layers.selection import LayerTensors, as_seen_by, replay_layer
from fa_forensics.replay.config import ReplayConfig


def lp_of(t: LayerTensors, plan: Plan) -> ReplayConfig:
    """The plan's low-precision config at this layer-step (see `recipe.lp_config_for`)."""
    return plan.at(t.step, t.layer).lp


def lp_hp_pair(t: LayerTensors, plan: Plan, backend: Backend = Backend.EMULATE, *, backward: bool = True):
    """(low-precision replay, high-precision replay) of identical inputs (`as_seen_by`): the plan's
    config at this layer-step against preset "fp32" (ieee)."""
    planned = plan.at(t.step, t.layer)
    seen = as_seen_by(t, planned.lp)
    lp = replay_layer(seen, planned.lp, backward=backward, backend=backend)
    hp = replay_layer(seen, planned.hp, backward=backward, backend=backend)
    return lp, hp


def input_cast_error(t: LayerTensors, lp: ReplayConfig, backend: Backend = Backend.EMULATE):
    """(O_fp32 of the stored inputs, O_fp32 of the inputs as `lp` sees them), or None when the
    recipe's input cast changes nothing: the error of the input cast alone, kept apart from the kernel's."""
    seen = as_seen_by(t, lp)
    if seen is t:
        return None
    raw = replay_layer(t, hp_config(), backward=False, backend=backend)
    cast = replay_layer(seen, hp_config(), backward=False, backend=backend)
    return raw.o, cast.o
