"""The soft-cap of the scores, s = cap·tanh(x / cap) with x = S·α (Gemma 2; FlashAttention-2's `softcap`).

Two forms, as the two kinds of code compute it:
- eager (torch ops, the reference path): each op rounds to the scores' dtype: x/cap, tanh, ·cap;
- the exp2 kernel models (FlashAttention-2): tanh(fp32(S·fp32(α/cap))) in fp32 on the raw scores, and the
  softmax then runs with cap in place of α (the base-2 constant fp32(cap·log2 e)).
tanh is evaluated in float64 and rounded once to fp32 (as every elementary function of the emulator), so the
bits do not depend on the host's vector tanh. `derivative` gives ds/dx = 1 − tanh² for the backward.
"""
from __future__ import annotations

import torch

from fa_forensics.replay.config import Precision
from fa_forensics.replay.emulate.ops import cast


def tanh_fp32(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) rounded once to fp32."""
    return torch.tanh(x.double()).float()


def capped(s: torch.Tensor, cap: float, s_dtype: Precision) -> torch.Tensor:
    """cap·tanh(s / cap) of the scaled scores s (fp32 holding s_dtype values), each op rounded to s_dtype."""
    c = torch.tensor(cap, dtype=torch.float32)
    t = cast(tanh_fp32(cast(s / c, s_dtype)), s_dtype)
    return cast(t * c, s_dtype)


def capped_raw(S: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """tanh(fp32(S · fp32(α / cap))) of the raw scores S: the exp2 kernels' capped scores (α then reads cap)."""
    factor = torch.tensor(float(torch.tensor(scale, dtype=torch.float32)) / cap, dtype=torch.float32)
    return tanh_fp32(S * factor)


def derivative(s_unmasked: torch.Tensor, cap: float) -> torch.Tensor:
    """1 − tanh(x/cap)² from the capped scores s = cap·tanh(x/cap) (before any mask), fp32: the factor the
    gradient of the capped scores takes on its way to the scaled scores x."""
    t = s_unmasked / torch.tensor(cap, dtype=torch.float32)
    return torch.where(torch.isfinite(t), 1.0 - t * t, torch.zeros_like(t))
