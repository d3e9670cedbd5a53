"""The shared dump-selection and replay layer of every analysis.

`select` turns the CLI's (--step, --layer, --head) into validated (step, layer, heads) triples;
`load` reads one layer-step with all selected heads batched (one read per tensor, never head by
head); `replay_layer` replays it under a config with the dump's own softmax scale and causal flag;
`lp_hp_pair` gives the comparison every analysis makes: the low-precision replay (the chosen
--preset, default "bf16" = `ReplayConfig()`, with the chosen accumulation model applied) against
the high-precision replay (preset "fp32", ieee) of the same stored inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from fa_forensics.errors import ConfigError, DumpError, UserError
from fa_forensics.replay.config import PRESETS, Accumulation, ReplayConfig

DEFAULT_PRESET = "bf16"

BatchSel = Union[int, slice, None]


@dataclass(frozen=True)
class LayerSelection:
    """One layer of one step and the heads of it to analyse."""

    step: int
    layer: int
    heads: list[int]


@dataclass(frozen=True)
class LayerTensors:
    """One layer-step as stored, selected heads batched in dim 1.

    q, k, v, o, do: (B, h, T, D) in the dtype training used (o / do None when not captured);
    x: (B, T, C) the attention module's input, or None; scale α and the causal flag from the dump.
    """

    step: int
    layer: int
    heads: list[int]
    q: torch.Tensor  # (B, h, T, D)
    k: torch.Tensor  # (B, h, T, D)
    v: torch.Tensor  # (B, h, T, D)
    o: Optional[torch.Tensor]  # (B, h, T, D)
    do: Optional[torch.Tensor]  # (B, h, T, D)
    x: Optional[torch.Tensor]  # (B, T, C)
    scale: float
    causal: bool

    @property
    def where(self) -> str:
        """'step S layer L' for messages."""
        return f"step {self.step} layer {self.layer}"


def select(dump, step: Optional[int] = None, layer: Optional[int] = None, head: Optional[int] = None) -> list[LayerSelection]:
    """Validated selections, sorted by (step, layer); None means every complete step / layer / head.

    Raises DumpError (one line naming what exists) for a step, layer or head the dump lacks.
    """
    if not dump.steps:
        incomplete = list(getattr(dump, "incomplete_steps", []) or [])
        extra = f" (incomplete, cut off: {incomplete})" if incomplete else ""
        raise DumpError(f"{dump.path}: no complete step to analyse{extra}; capture again or pick another dump")
    triples = dump.select(
        steps=None if step is None else [step],
        layers=None if layer is None else [layer],
        heads=None if head is None else [head],
    )
    out = [LayerSelection(int(s), int(l), [int(h) for h in hs]) for s, l, hs in triples]
    if not out:
        raise DumpError(f"{dump.path}: nothing matches --step {step} --layer {layer} --head {head}; run `fa-forensics info` to list what exists")
    return sorted(out, key=lambda s: (s.step, s.layer))


def load(dump, sel: LayerSelection, batch: BatchSel = None) -> LayerTensors:
    """Read q, k, v, o, do (selected heads batched) and x of one layer-step, plus its scale and causal flag."""
    info = dump.layer_info(sel.step, sel.layer)
    for name in ("q", "k", "v"):
        if not dump.has(sel.step, sel.layer, name):
            raise DumpError(f"{dump.path}: step {sel.step} layer {sel.layer} has no '{name}' array; a replay needs q, k and v")

    def read(name: str, heads=sel.heads) -> Optional[torch.Tensor]:
        if not dump.has(sel.step, sel.layer, name):
            return None
        return dump.read(sel.step, sel.layer, name, heads=heads, batch=batch)

    q = read("q")  # (B, h, T, D)
    scale = getattr(info, "scale", None)
    if scale is None or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        scale = 1.0 / math.sqrt(q.shape[-1])
    causal = getattr(info, "causal", None)
    return LayerTensors(
        step=sel.step, layer=sel.layer, heads=list(sel.heads),
        q=q, k=read("k"), v=read("v"), o=read("o"), do=read("do"), x=read("x", heads=None),
        scale=float(scale), causal=True if causal is None else bool(causal),
    )


def replay_layer(t: LayerTensors, config: ReplayConfig, *, backward: bool, backend: str = "emulate"):
    """Replay one layer-step (all selected heads at once) under `config`; the backward only if asked.

    The dump's scale and causal flag override the config's (they describe what training did).
    """
    from fa_forensics.replay import replay  # lazy: the replay engine imports torch-heavy modules

    if backward and t.do is None:
        raise DumpError(f"{t.where}: the dump has no 'do' (upstream gradient) array; this analysis needs a capture with dO")
    return replay(t.q, t.k, t.v, config, t.do if backward else None, backend=backend, causal=t.causal, scale=t.scale)


def lp_config(accumulation: str = "ieee", base: Optional[ReplayConfig] = None, preset: str = DEFAULT_PRESET) -> ReplayConfig:
    """The low-precision side: `base` (default: the named preset) with the chosen accumulation.

    The accumulation always comes from the caller (the CLI's --accumulation), also for a preset
    that names its own (bf16-hw: tensor-core), so that one option decides it for every command.
    """
    return (base or preset_config(preset)).with_(accumulation=Accumulation(accumulation))


def preset_config(name: str) -> ReplayConfig:
    """`ReplayConfig.preset(name)`; an unknown name raises ConfigError listing the presets (CLI exit 2)."""
    try:
        return ReplayConfig.preset(name)
    except ConfigError:
        raise ConfigError(f"--preset {name!r} is not a replay preset; choose one of: {', '.join(PRESETS)}") from None


def check_preset(name: str) -> str:
    """Validate a --preset value early (before any replay)."""
    preset_config(name)
    return name


def hp_config() -> ReplayConfig:
    """The high-precision side: every cast fp32 (preset "fp32"), ieee accumulation."""
    return ReplayConfig.preset("fp32")


def lp_hp_pair(
    t: LayerTensors,
    accumulation: str = "ieee",
    backend: str = "emulate",
    backward: bool = True,
    lp_config: Optional[ReplayConfig] = None,
    preset: str = DEFAULT_PRESET,
):
    """(low-precision replay, high-precision replay) of the same stored inputs.

    The low-precision side is `lp_config` when given, else the named preset; either way with
    `accumulation` applied. The high-precision side is always preset "fp32" (ieee).
    """
    lp = replay_layer(t, _lp(accumulation, lp_config, preset), backward=backward, backend=backend)
    hp = replay_layer(t, hp_config(), backward=backward, backend=backend)
    return lp, hp


def _lp(accumulation: str, base: Optional[ReplayConfig], preset: str = DEFAULT_PRESET) -> ReplayConfig:
    try:
        return lp_config(accumulation, base, preset)
    except ValueError:
        raise UserError(f"--accumulation {accumulation!r} is not one of: ieee, tensor-core") from None


def check_accumulation(accumulation: str) -> str:
    """Validate an --accumulation value early (before any replay)."""
    choices = [a.value for a in Accumulation]
    if accumulation not in choices:
        raise UserError(f"--accumulation {accumulation!r} is not one of: {', '.join(choices)}")
    return accumulation


def check_backend(backend: str) -> str:
    """Validate a --backend value early (before any replay)."""
    if backend not in ("emulate", "triton"):
        raise UserError(f"--backend {backend!r} is not one of: emulate, triton")
    return backend


def as_f64(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Upcast a stored / replayed tensor to float64 for exact analysis arithmetic."""
    return None if x is None else x.to(torch.float64)


def heads_of(selections: Sequence[LayerSelection]) -> int:
    """Total number of (step, layer, head) items in a selection list (for progress bars)."""
    return sum(len(s.heads) for s in selections)
