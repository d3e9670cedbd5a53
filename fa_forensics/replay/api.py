"""The one replay entry point: validate the arguments, resolve causal/scale, pick the backend.

backend "emulate" is the CPU reference (fa_forensics.replay.emulate), computed by the engine chosen
(numerics/engines.py: the torch specification or the compiled kernels, the same bits); backend "triton"
is imported lazily from fa_forensics.replay.triton.backend so that this module never needs Triton.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fa_forensics.enums import BACKENDS
from fa_forensics.errors import BackendUnsupported, ConfigError, InvalidSetting
from fa_forensics.numerics.engines import EngineLike, resolve_engine
from fa_forensics.optional import require
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.out import ReplayOut


class BackendUnavailable(BackendUnsupported):
    """The requested replay backend cannot run here (no Triton, no GPU, a masked layer)."""


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: Optional[torch.Tensor], causal: bool) -> None:
    named = {"q": q, "k": k, "v": v} | ({} if do is None else {"do": do})
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or not x.is_floating_point():
            what = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"replay: {name} must be a floating (B, H, T, D) tensor, got {what}; pass q, k, v, do as "
                              "(batch, heads, tokens, head_dim)")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ConfigError(f"replay: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; k "
                          "and v must equal and share B, H, D with q")
    if do is not None and do.shape != q.shape:
        raise ConfigError(f"replay: do {tuple(do.shape)} must have the shape of q {tuple(q.shape)}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ConfigError(f"replay: causal attention needs as many queries as keys (q has {q.shape[-2]}, k has "
                          f"{k.shape[-2]}); pass causal=False")


def _check_mask(mask: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> None:
    if mask is None:
        return
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ConfigError(f"replay: mask must be a bool or float tensor, got {what}")
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(tuple(mask.shape), target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ConfigError(f"replay: mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, Tk) = {target}")


def resolve_causal_scale(config: ReplayConfig, head_dim: int, causal: Optional[bool],
                         scale: Optional[float]) -> tuple[bool, float]:
    """Explicit arguments override the config; defaults: causal, α = 1/sqrt(D)."""
    causal = causal if causal is not None else (config.causal if config.causal is not None else True)
    scale = scale if scale is not None else (config.scale if config.scale is not None else 1.0 / math.sqrt(head_dim))
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"replay: scale={scale!r} must be a positive finite number")
    return bool(causal), float(scale)


def replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig, do: Optional[torch.Tensor] = None,
           *, backend: str = "emulate", causal: Optional[bool] = None, scale: Optional[float] = None,
           mask: Optional[torch.Tensor] = None, engine: EngineLike = None) -> ReplayOut:
    """Replay attention forward (and, with dO, backward) under `config` on `backend`.

    q, k, v, do: (B, H, T, D) in any float dtype; their values are first rounded to
    config.input_dtype. mask: SDPA's attn_mask as captured (bool, True = may attend, or an additive
    float bias), broadcastable to (B, H, T, Tk); applied on top of `causal`. A row with no allowed
    key gives O = 0 and zero gradients, as SDPA does. Returns ReplayOut (O in o_dtype, lse, P̄
    stats, δ/dQ/dK/dV with dO). engine: which implementation the emulator computes with (`Engine.SPEC`,
    `Engine.COMPILED`; None: the current one, `numerics.engines.use_engine`); it never changes a bit.
    """
    if not isinstance(config, ReplayConfig):
        raise ConfigError(f"replay: config must be a ReplayConfig, got {type(config).__name__}; use "
                          "ReplayConfig.preset(name)")
    if backend not in BACKENDS:
        raise ConfigError(f"replay: unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    causal, scale = resolve_causal_scale(config, q.shape[-1], causal, scale)
    _check_inputs(q, k, v, do, causal)
    _check_mask(mask, q, k)
    if backend == "emulate":
        from fa_forensics.replay.emulate import emulate_replay

        engine = resolve_engine(engine)
        return emulate_replay(q, k, v, config, do, causal=causal, scale=scale, mask=mask, engine=engine)
    if engine is not None:
        raise InvalidSetting("engine", "chooses how the emulator computes; backend triton runs its own kernels "
                                       "(leave engine unset)")
    if mask is not None:
        raise BackendUnavailable("triton", "does not apply attention masks (this layer has one)")
    if config.softcap is not None:
        raise BackendUnavailable("triton", "does not apply a soft-cap (this layer has one)")
    require("triton", "the replay backend triton")
    try:
        from fa_forensics.replay.triton.backend import replay_triton
    except ImportError as exc:
        raise BackendUnavailable("triton", f"is not available here ({exc})") from None
    return replay_triton(q, k, v, config, do, causal=causal, scale=scale)
