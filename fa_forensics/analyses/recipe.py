"""The low-precision side every analysis replays against fp32, resolved in one place.

A `Recipe` is what the user asked for (a preset name and an accumulation model); the CLI builds it
once per command. `lp_config_for(dump, step, layer, recipe)` is the only function that turns it
into the `ReplayConfig` replayed for one (step, layer): every analysis calls it, so a recipe that
differs per layer (e.g. the best match per layer) is added here and nowhere else.
The high-precision side is always `hp_config()`: every cast fp32, ieee accumulation.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import PRESETS, Accumulation, ReplayConfig

DEFAULT_PRESET = "bf16"


class Backend(str, enum.Enum):
    """Where a replay runs."""

    EMULATE = "emulate"  # the CPU reference emulator
    TRITON = "triton"  # the GPU kernels


class UnknownPreset(ConfigError):
    """A preset name that is not in PRESETS; `.name` is the name given."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"{name!r} is not a replay preset; choose one of: {', '.join(PRESETS)}")


@dataclass(frozen=True)
class Recipe:
    """The low-precision reading an analysis replays: a preset and the accumulation of every product.

    `config` is given only for a reading that is no named preset (a library caller's own config);
    its accumulation is still replaced by `accumulation`, so one option decides it everywhere.
    """

    preset: str = DEFAULT_PRESET
    accumulation: Accumulation = Accumulation.IEEE
    config: Optional[ReplayConfig] = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "accumulation", Accumulation(self.accumulation))
        except ValueError:
            choices = ", ".join(a.value for a in Accumulation)
            raise ConfigError(f"accumulation {self.accumulation!r} is not one of: {choices}") from None
        if self.config is None and self.preset not in PRESETS:
            raise UnknownPreset(self.preset)

    def base_config(self) -> ReplayConfig:
        """The recipe's config independent of the layer (accumulation applied)."""
        base = self.config if self.config is not None else ReplayConfig.preset(self.preset)
        return base.with_(accumulation=self.accumulation)


def lp_config_for(dump, step: int, layer: int, recipe: Recipe) -> ReplayConfig:
    """The low-precision config replayed at (step, layer) of `dump` (None for in-memory layers)."""
    return recipe.base_config()


def hp_config() -> ReplayConfig:
    """The high-precision side: every cast fp32 (preset "fp32"), ieee accumulation."""
    return ReplayConfig.preset("fp32")
