"""Elementary functions with host-independent results.

torch's fp32 `exp` on the CPU is a vectorized approximation whose last bit differs between
instruction sets (AVX2 and AVX-512 builds of the same torch disagree by an ulp near 1), so an
emulator built on it would give different bits on different machines. `exp_fp32` evaluates exp in
float64 and rounds once to fp32: the correctly rounded result, except where the exact value lies
within one float64 ulp of an fp32 rounding midpoint (about 2⁻²⁹ of all arguments), and the same on
every machine whose float64 exp is faithful.
"""
from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # log2(e) rounded to float64: exp(x) = 2^(x · LOG2E); kernels fold it into their scale


def exp_fp32(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 (or fp64) x, rounded once to fp32; same shape. exp(−inf) = 0, NaN stays NaN."""
    return torch.exp(x.double()).float()


def exp2_fp32(x: torch.Tensor) -> torch.Tensor:
    """2**x for fp32 (or fp64) x, rounded once to fp32 (as `exp_fp32`). A GPU's exp2f is the special
    function unit's approximation (within 2 ulp); the correctly rounded value is the closest model."""
    return torch.exp2(x.double()).float()


def log_fp32(x: torch.Tensor) -> torch.Tensor:
    """log(x) for fp32 (or fp64) x, rounded once to fp32 (as `exp_fp32`). log(0) = −inf."""
    return torch.log(x.double()).float()


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a·b + c for fp32 values with one rounding to fp32, as a GPU's fused multiply-add: the product is
    exact in float64 and the sum rounded there first, so the result is the correctly rounded one except
    where that float64 sum lies on an fp32 rounding midpoint (about 2⁻²⁹ of all arguments)."""
    return (a.double() * b.double() + c.double()).float()
