"""Elementary functions with host-independent results.

torch's fp32 `exp` on the CPU is a vectorized approximation whose last bit differs between
instruction sets (AVX2 and AVX-512 builds of the same torch disagree by an ulp near 1), so an
emulator built on it would give different bits on different machines. `exp_fp32` evaluates exp in
float64 and rounds once to fp32: the correctly rounded result, except where the exact value lies
within one float64 ulp of an fp32 rounding midpoint (about 2⁻²⁹ of all arguments), and the same on
every machine whose float64 exp is faithful. `exp2_fp32` is the same for 2ˣ. (torch's fp32 exp2 is
not even position-independent: its vectorized body and scalar tail round some arguments apart.)
"""
from __future__ import annotations

import torch


def exp_fp32(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 (or fp64) x, rounded once to fp32; same shape. exp(−inf) = 0, NaN stays NaN."""
    return torch.exp(x.double()).float()


def exp2_fp32(x: torch.Tensor) -> torch.Tensor:
    """2ˣ for fp32 (or fp64) x, rounded once to fp32 as `exp_fp32`; the same bits wherever x sits in a tensor."""
    return torch.exp2(x.double()).float()
