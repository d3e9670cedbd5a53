"""The recorded op sequence of attention written in torch ops, put into the configs that replay it.

A layer captured from attention written as plain tensor ops carries `plain_recipe` in its attrs (capture's
op sequence: docs/dump.md). The presets `eager-reexec` and `eager` replay such a layer; their config is the
preset's with the layer's recipe and the dtypes it recorded (`plain_config`), so that the products, the
softmax and the cast of P are those training ran. `config_at(recipe, t)` is the config a candidate of
`match` replays on a loaded layer-step, `for_layer(config, dump, step, layer)` the one an analysis replays.
"""
from __future__ import annotations

from typing import Optional

from fa_forensics.enums import Precision
from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.plain_recipe import PlainRecipe

_PRECISION = {"float32": Precision.FP32, "bfloat16": Precision.BF16, "float16": Precision.FP16,
              "float64": Precision.FP32}
PLAIN_PRESETS = ("eager-reexec", "eager")


def recorded_recipe(dump, step: int, layer: int) -> Optional[PlainRecipe]:
    """The layer-step's recorded op sequence, or None (not recorded, or malformed: then no plain preset applies)."""
    if dump is None:
        return None
    try:
        fact = dict(dump._layer(step, layer).attrs).get("plain_recipe")
    except Exception:  # a stand-in without zarr groups
        return None
    if fact is None:
        return None
    try:
        return PlainRecipe.from_fact(fact)
    except ConfigError:
        return None


def plain_config(config: ReplayConfig, recipe: PlainRecipe) -> ReplayConfig:
    """`config` (a plain preset's) with `recipe` and the dtypes it recorded: inputs, scores, softmax, P, O."""
    def p(name: str) -> Precision:
        return _PRECISION.get(name, Precision.FP32)

    return config.with_(plain=recipe, input_dtype=p(recipe.input_dtype), s_dtype=p(recipe.score_dtype),
                        exp_dtype=p(recipe.softmax_dtype), p_dtype=p(recipe.p_dtype), o_dtype=p(recipe.o_dtype),
                        pv_dtype=Precision.FP32)


def for_layer(config: ReplayConfig, dump, step: int, layer: int) -> ReplayConfig:
    """A plain preset's config with the layer-step's recorded recipe (itself for any other config, or where the
    layer recorded none: the preset's default, Hugging Face's eager attention)."""
    if config.plain is None:
        return config
    recipe = recorded_recipe(dump, step, layer)
    return config if recipe is None else plain_config(config, recipe)


def config_at(candidate, t) -> ReplayConfig:
    """The config a candidate recipe (preset, accumulation) replays on the loaded layer-step `t`."""
    return for_layer(candidate.config(), getattr(t, "source", None), t.step, t.layer)
