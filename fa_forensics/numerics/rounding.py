"""Rounding of fp32 / fp64 values to any `FloatFormat`: nearest-even, toward zero, stochastic.

How (the bit path, used for every mode and format): with e the binade exponent of |x| read
from its bit pattern (clamped at the format's emin, which is how subnormals fall out), the
quantum of the target format at x is q = 2^(e − man_bits). Adding and subtracting the magic
number c = 2^P · q (P = fraction bits of the working dtype) rounds |x| to a multiple of q with
the working dtype's own round-to-nearest-even, exactly (|x| < c, and c's ulp is q). Toward zero
steps back one q where that went up; stochastic adds q with probability (|x| − RZ(|x|)) / q,
so E[round(x)] = x. The sign is put back last (the sign of zero is kept).

Fast path: fp32 inputs rounded to nearest-even use torch's own cast after clamping to ±max
(torch's fp32 → bf16 / fp16 / fp8 casts are correct RNE; the tests check them against the bit
path exhaustively for fp8 and on every edge case for bf16 / fp16). The clamp makes the fp8
casts saturate whatever torch's version does (torch 2.13's float8_e4m3fn cast saturates, its
float8_e5m2 cast overflows to inf).

Overflow: fp32 / bf16 / fp16 follow IEEE 754 (nearest-even and stochastic → ±inf, toward zero →
±max); fp8 e4m3 and e5m2 saturate at ±max (±448, ±57344), infinities included, as the
saturating (satfinite) casts of FP8 kernels do. NaN stays NaN.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.numerics.formats import FloatFormat, FormatLike, get_format

ROUNDING_MODES = ("nearest-even", "toward-zero", "stochastic")
_MODE_ALIASES = {"rne": "nearest-even", "nearest": "nearest-even", "rn": "nearest-even", "rz": "toward-zero",
                 "trunc": "toward-zero", "sr": "stochastic"}

# working float dtype -> (its bit-pattern int dtype, fraction bits P, exponent bias)
_WORK = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}
USE_TORCH_CAST_FAST_PATH = True  # tests compare both paths; set False to force the bit path


def normalize_mode(mode) -> str:
    """Resolve a rounding mode name (or a `Rounding` enum) to one of ROUNDING_MODES."""
    name = (mode.value if isinstance(mode, enum.Enum) else str(mode)).strip().lower()
    name = _MODE_ALIASES.get(name, name)
    if name not in ROUNDING_MODES:
        raise ConfigError(f"unknown rounding mode {mode!r}; use one of {', '.join(ROUNDING_MODES)}")
    return name


def binade_exponent(x: torch.Tensor, emin: int) -> torch.Tensor:
    """floor(log2|x|) clamped below at `emin` (int64); zeros and non-finite values give emin."""
    _, E = torch.frexp(x)  # x = m · 2^E, 0.5 <= |m| < 1
    e = E.to(torch.int64) - 1
    e = torch.where(torch.isfinite(x) & (x != 0), e, torch.full_like(e, emin))
    return e.clamp(min=emin)


def round_to(
    x: torch.Tensor,
    fmt: FormatLike,
    mode="nearest-even",
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Round every value of `x` to a representable value of `fmt` under `mode`.

    Returns a tensor of x's dtype (fp32 or fp64; any other float dtype gives fp32) whose values
    are exactly representable in `fmt`. `generator` seeds stochastic rounding.
    """
    spec = get_format(fmt)
    mode = normalize_mode(mode)
    x = x.detach()
    if x.dtype not in _WORK:
        x = x.to(torch.float32)
    if x.dtype == torch.float32 and spec.name == "fp32":
        return x.clone()  # every fp32 value is an fp32 value, in every mode
    if x.dtype == torch.float32 and mode == "nearest-even" and USE_TORCH_CAST_FAST_PATH:
        return torch_cast_round(x, spec)
    return round_bits(x, spec, mode, generator)


def torch_cast_round(x: torch.Tensor, spec: FloatFormat) -> torch.Tensor:
    """Nearest-even rounding of fp32 `x` by torch's cast (clamped first for saturating formats)."""
    if spec.saturates:
        x = x.clamp(-spec.max_value, spec.max_value)  # NaN passes through clamp
    return x.to(spec.torch_dtype).to(x.dtype)


def round_bits(x: torch.Tensor, spec: FloatFormat, mode: str,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The bit path of `round_to` (see the module docstring), for fp32 / fp64 `x`."""
    out_dtype = x.dtype
    amax = x.abs().max() if x.numel() else torch.tensor(0.0)
    tame = bool(amax <= spec.max_value)  # False for NaN, inf and overflow
    if x.dtype == torch.float32 and not bool(amax < 2.0**100):
        x = x.to(torch.float64)  # magic numbers for huge values overflow fp32
    int_dtype, P, bias = _WORK[x.dtype]
    bits = x.view(int_dtype)
    e = ((bits >> P) & (2 * bias + 1)) - bias  # binade exponent of |x| (normal x)
    e = e.clamp(spec.emin, spec.emax + 1)  # emin: subnormals share the quantum 2^(emin - man_bits)
    c = ((e - spec.man_bits + P + bias) << P).view(x.dtype)  # 2^P · q
    a = x.abs()
    y = (a + c) - c  # |x| rounded to nearest-even multiple of q
    if mode != "nearest-even":
        q = c * 2.0**-P
        y = torch.where(y > a, y - q, y)  # toward zero
        if mode == "stochastic":
            u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            y = y + torch.where(u * q < a - y, q, torch.zeros_like(q))  # up with probability (|x| - RZ)/q
    y = torch.copysign(y, x)
    if not tame:
        y = _overflow_and_specials(x, y, spec, mode)
    return y.to(out_dtype)


def _overflow_and_specials(x: torch.Tensor, y: torch.Tensor, spec: FloatFormat, mode: str) -> torch.Tensor:
    """Apply the overflow rule of (format, mode) and keep NaN / inf (see the module docstring)."""
    big = torch.copysign(torch.full_like(y, spec.max_value), x)
    inf = torch.copysign(torch.full_like(y, float("inf")), x)
    over = y.abs() > spec.max_value
    if spec.saturates:
        y = torch.where(over | torch.isinf(x), big, y)
    elif mode == "toward-zero":
        y = torch.where(over, big, y)
        y = torch.where(torch.isinf(x), x, y)
    else:
        y = torch.where(over | torch.isinf(x), inf, y)
    return torch.where(torch.isnan(x), x, y)
