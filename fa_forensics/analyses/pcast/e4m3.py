"""The E4M3 number line and dp(S), the worst-case normalized step of the P-cast (paper 002 §5.2).

An FP8 kernel casts P̄·S to E4M3; dp(S) is the largest E4M3 step met by P̄·S for P̄ ∈ [0, 1],
divided by S: 2^-4 at every power of two, above it elsewhere (the sawtooth of Fig. 1).
Found by exhaustive enumeration of the 256 bit patterns, not by formula.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fa_forensics.errors import InvalidSetting

E4M3_MAX = 448.0
DP_SCALES_LISTED = (3.0, 100.0, 250.0, 300.0, 448.0)  # the non-power-of-two S of App. A


def e4m3_positive_values() -> torch.Tensor:
    """All positive finite E4M3 (e4m3fn) values, sorted, from the 256 bit patterns (126 values)."""
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = bits.view(torch.float8_e4m3fn).to(torch.float64)  # (256,)
    values = values[torch.isfinite(values) & (values > 0)]
    return torch.unique(values)  # sorted


@dataclass(frozen=True)
class DpPoint:
    """dp(S) = (largest E4M3 step met by P̄·S for P̄ ∈ [0, 1]) / S (paper Def. 1, Remark 3)."""

    S: float
    dp: float
    lsb: float  # the largest step (in the scaled domain); for S > 448 the saturation step
    bit_exact: bool  # S is a power of two: ×S and ×1/S are exact in fp32 (Prop. 5)


def dp_of_scale(S: float, values: Optional[torch.Tensor] = None) -> DpPoint:
    """dp(S) by exhaustive enumeration of the E4M3 number line.

    For S ≤ 448 the steps that the scaled range [0, S] meets are the gaps [v_i, v_{i+1}) with
    v_i < S (so S = 2^k itself, the first value of the next binade, adds nothing: dp(2^k) = 2^-4).
    For S > 448 the cast saturates: dp = max(32/S, 2(1 − 448/S)) (Remark 3).
    """
    if not S > 0:
        raise InvalidSetting("scales", f"P scale S must be positive, got {S} (e.g. 1,256,448)")
    v = e4m3_positive_values() if values is None else values
    line = torch.cat([torch.zeros(1, dtype=v.dtype), v])  # (127,) 0 and every positive value
    gaps = line[1:] - line[:-1]  # (126,)
    met = gaps[line[:-1] < min(S, E4M3_MAX)]
    lsb = float(met.max())
    dp = lsb / S
    if S > E4M3_MAX:
        saturation_step = 2.0 * (S - E4M3_MAX)
        lsb = max(lsb, saturation_step)
        dp = max(dp, saturation_step / S)
    k = math.log2(S)
    return DpPoint(S=float(S), dp=dp, lsb=lsb, bit_exact=abs(k - round(k)) < 1e-12)


def dp_curve(scales: Iterable[float]) -> tuple[DpPoint, ...]:
    """dp(S) at every S in `scales` (one enumeration of the number line shared by all)."""
    v = e4m3_positive_values()
    return tuple(dp_of_scale(float(s), v) for s in scales)


def default_dp_scales(user_scales: Sequence[float] = ()) -> tuple[float, ...]:
    """S for the dp table: 2^0..2^9, App. A's non-power-of-two list, and the user's scales."""
    return tuple(sorted(set([2.0 ** k for k in range(10)] + list(DP_SCALES_LISTED) + [float(s) for s in user_scales])))


def dp_sawtooth(s_min: float = 1.0, s_max: float = 600.0, n: int = 1500) -> tuple[DpPoint, ...]:
    """dp(S) on a dense log grid plus every power of two in range (for the Fig. 1 curve)."""
    grid = set(np.geomspace(s_min, s_max, n).tolist())
    k = math.ceil(math.log2(s_min))
    while 2.0 ** k <= s_max:
        grid.add(2.0 ** k)
        k += 1
    grid |= {s for s in DP_SCALES_LISTED if s_min <= s <= s_max}
    return dp_curve(sorted(grid))
