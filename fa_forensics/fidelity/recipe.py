"""The low-precision side every analysis replays against fp32: what the user asked for, resolved per layer-step.

A `Recipe` is what the user asked for: a preset name and an accumulation model, or `auto`, the
recipe that reproduces the dump's stored O best (`fidelity.match`, cached beside the dump). The CLI
builds it once per command and resolves `auto` once (`fidelity.auto.resolve`): a resolved Recipe
carries its choices per (step, layer), so every analysis and every work item sent to other
processes replays the same recipe without matching again. `lp_config_for(dump, step, layer,
recipe)` is the only function that turns a Recipe into the `ReplayConfig` replayed for one
(step, layer): every analysis calls it.
The high-precision side is always `hp_config()`: every cast fp32, ieee accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fa_forensics.enums import AUTO, Accumulation, BackwardKernel
from fa_forensics.errors import ConfigError
from fa_forensics.fidelity.candidates import implied
from fa_forensics.fidelity.plain_facts import for_layer
from fa_forensics.fidelity.run_facts import RunFacts, facts_at
from fa_forensics.replay.config import PRESETS, ReplayConfig
from fa_forensics.replay.kernel_recipes import KERNEL_RECIPES

FALLBACK_PRESET = "bf16"  # what `auto` replays where no stored O can be matched
DEFAULT_PRESET = AUTO


class UnknownPreset(ConfigError):
    """A preset name that is not in PRESETS; `.name` is the name given."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"{name!r} is not a replay preset; choose one of: {AUTO}, {', '.join(PRESETS)}")


@dataclass(frozen=True)
class Choice:
    """What `auto` replays at one layer-step: a preset under an accumulation model, and the share of
    the stored O (every head) it reproduces bit for bit (None: nothing to match, the fallback)."""

    preset: str
    accumulation: Accumulation
    o_bits_equal: Optional[float]
    why: Optional[str] = None  # why this recipe was not matched but implied by the recorded settings


def _default_accumulation(preset: str, config: Optional[ReplayConfig]) -> Accumulation:
    """A named preset without --accumulation: the GPU kernels' models keep their tensor-core products (what the
    hardware ran); every other preset replays ieee."""
    if config is None and preset.partition("@")[0] in {r.preset for r in KERNEL_RECIPES}:
        return ReplayConfig.preset(preset).accumulation
    return Accumulation.IEEE


@dataclass(frozen=True)
class Recipe:
    """The low-precision reading an analysis replays: a preset and the accumulation of every product.

    preset `auto`: the best match per layer-step; `accumulation` None there means "the matched
    one", a given accumulation restricts the match to it. For a named preset None means ieee (tensor-core
    for the GPU kernels' models).
    `config` is given only for a reading that is no named preset (a library caller's own config);
    its accumulation is still replaced by `accumulation`, so one option decides it everywhere.
    `choices` ((step, layer) -> Choice) is filled by `resolve` for `auto`.
    """

    preset: str = DEFAULT_PRESET
    accumulation: Optional[Accumulation] = None
    config: Optional[ReplayConfig] = None
    choices: tuple = ()  # ((step, layer), Choice) pairs

    def __post_init__(self) -> None:
        if self.accumulation is not None:
            try:
                object.__setattr__(self, "accumulation", Accumulation(self.accumulation))
            except ValueError:
                choices = ", ".join(a.value for a in Accumulation)
                raise ConfigError(f"accumulation {self.accumulation!r} is not one of: {choices}") from None
        if self.config is None and self.preset.partition("@")[0] not in PRESETS and self.preset != AUTO:
            raise UnknownPreset(self.preset)
        if self.accumulation is None and not self.is_auto:
            object.__setattr__(self, "accumulation", _default_accumulation(self.preset, self.config))
        if self.config is None and "@" in self.preset:
            ReplayConfig.preset(self.preset)  # a tile suffix that names no tiling field is a ConfigError

    @property
    def is_auto(self) -> bool:
        return self.config is None and self.preset == AUTO

    @property
    def accumulation_name(self) -> str:
        """The accumulation as the JSON names it ("auto" when the match decides it)."""
        return AUTO if self.accumulation is None else self.accumulation.value

    @property
    def label(self) -> str:
        """The name tables and verdicts show: the preset, or what `auto` chose ("auto (bf16-autocast-train)")."""
        if not self.is_auto:
            return self.preset
        names = sorted({choice.preset for _, choice in self.choices})
        return f"{AUTO} ({', '.join(names)})" if names else AUTO

    def base_config(self) -> ReplayConfig:
        """The recipe's config independent of the layer (accumulation applied); `auto` has none."""
        if self.is_auto:
            raise ConfigError("preset auto is decided per layer-step: use lp_config_for(dump, step, layer, recipe)")
        base = self.config if self.config is not None else ReplayConfig.preset(self.preset)
        return base.with_(accumulation=self.accumulation)

    def choice_at(self, step: int, layer: int) -> Optional[Choice]:
        for key, choice in self.choices:
            if key == (step, layer):
                return choice
        return None


def implied_choice(facts: RunFacts, recipe: Recipe) -> Choice:
    """What `auto` replays where the stored O cannot be matched (attention dropout, an fp32 run, no stored O, a
    layer built in memory): the recipe the recorded settings imply (`candidates.implied`)."""
    preset, accumulation, why = implied(facts, FALLBACK_PRESET)
    return Choice(preset, recipe.accumulation or accumulation, None, why)


def resolved_choice(dump, step: int, layer: int, recipe: Recipe) -> Choice:
    """What an `auto` recipe replays at (step, layer): its resolved choice there; for a layer built in memory
    (`dump` None: nothing to match) the implied recipe. A ConfigError for a dump's layer-step it was not
    resolved at: `fidelity.auto.resolve` decides `auto` once, before any replay."""
    choice = recipe.choice_at(step, layer)
    if choice is not None:
        return choice
    if dump is None:
        return implied_choice(facts_at(None, step, layer), recipe)
    raise ConfigError(f"preset auto is not resolved at step {step} layer {layer}: resolve the recipe first "
                      f"(fidelity.auto.resolve)")


def preset_at(dump, step: int, layer: int, recipe: Recipe) -> str:
    """The name of the preset replayed at (step, layer) (a named preset, or what `auto` chose there)."""
    if not recipe.is_auto:
        return recipe.preset
    return resolved_choice(dump, step, layer, recipe).preset


def lp_config_for(dump, step: int, layer: int, recipe: Recipe) -> ReplayConfig:
    """The low-precision config replayed at (step, layer) of `dump` (None for in-memory layers). A layer captured
    with an attn_mask replays the emulator's reference backward where the preset names a GPU kernel's backward:
    those models do not model masks (the mask check says so)."""
    if not recipe.is_auto:
        config = recipe.base_config()
    else:
        choice = resolved_choice(dump, step, layer, recipe)
        config = ReplayConfig.preset(choice.preset).with_(accumulation=choice.accumulation)
    if config.backward_kernel is not BackwardKernel.REFERENCE and dump is not None and _has_mask(dump, step, layer):
        config = config.with_reference_backward()
    return for_layer(config, dump, step, layer)


def _has_mask(dump, step: int, layer: int) -> bool:
    return "mask" in (getattr(dump.layer_info(step, layer), "arrays", None) or {})


def hp_config(lp: Optional[ReplayConfig] = None) -> ReplayConfig:
    """The high-precision side: every cast fp32 (preset "fp32"), ieee accumulation; for a low-precision side
    that replays attention written in torch ops, its recorded ops with every cast fp32 (the emulator's model:
    a soft-cap or a mask form the fp32 reference does not have stays in)."""
    if lp is not None and lp.plain is not None:
        return ReplayConfig.preset("fp32").with_(plain=lp.plain)
    return ReplayConfig.preset("fp32")
