"""Bit views of float formats: bit patterns, bit strings, ulp and ulp distance.

Bit patterns are returned as non-negative int64 tensors (0 .. 2^bits − 1) so every format
shares one integer dtype; the sign bit is the top bit of the format's width.
"""
from __future__ import annotations

import torch

from fa_forensics.numerics.formats import FormatLike, get_format
from fa_forensics.numerics.rounding import binade_exponent, round_to

_UINT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def bits_of(x: torch.Tensor, fmt: FormatLike) -> torch.Tensor:
    """Bit patterns (int64, unsigned) of the values of x in `fmt`.

    A tensor already of fmt's torch dtype is viewed as is; any other float tensor is first
    rounded to fmt (nearest-even, with fmt's saturation) so the pattern is of a value of fmt.
    """
    spec = get_format(fmt)
    if x.dtype != spec.torch_dtype:
        x = round_to(x.to(torch.float64) if x.dtype != torch.float32 else x, spec).to(spec.torch_dtype)
    raw = x.contiguous().view(_UINT_VIEW[spec.bits]).to(torch.int64)
    return raw & ((1 << spec.bits) - 1)


def from_bits(bits: torch.Tensor, fmt: FormatLike) -> torch.Tensor:
    """Values (fp32) of the bit patterns `bits` (any integer tensor, unsigned or two's complement) of `fmt`."""
    spec = get_format(fmt)
    b = bits.to(torch.int64) & ((1 << spec.bits) - 1)
    if spec.bits > 8:  # to the signed view of the same width
        b = torch.where(b >= (1 << (spec.bits - 1)), b - (1 << spec.bits), b)
    return b.to(_UINT_VIEW[spec.bits]).view(spec.torch_dtype).to(torch.float32)


def bit_string(value: float, fmt: FormatLike = "fp32") -> str:
    """The bit pattern of `value` in `fmt` as "sign exponent fraction" without spaces (value rounded to fmt first)."""
    spec = get_format(fmt)
    pattern = int(bits_of(torch.tensor([float(value)], dtype=torch.float64), spec)[0])
    return format(pattern, f"0{spec.bits}b")


def split_bit_string(bits: str, fmt: FormatLike) -> tuple[str, str, str]:
    """(sign, exponent, fraction) fields of a bit string of `fmt`."""
    spec = get_format(fmt)
    return bits[0], bits[1 : 1 + spec.exp_bits], bits[1 + spec.exp_bits :]


def ulp(x: torch.Tensor, fmt: FormatLike) -> torch.Tensor:
    """Unit in the last place of fmt at each |x|: 2^(e − man_bits), e = the binade exponent of |x|
    (clamped at emin, so zero and subnormals get the subnormal spacing). Same float dtype as x (fp64 for others).
    """
    spec = get_format(fmt)
    xd = x.to(torch.float64)
    u = torch.ldexp(torch.ones_like(xd), binade_exponent(xd, spec.emin) - spec.man_bits)
    return u.to(x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float64)


def ordered_bits(x: torch.Tensor, fmt: FormatLike) -> torch.Tensor:
    """Bit patterns mapped to a signed integer line on which adjacent values of fmt differ by 1 (+0 and −0 are
    both 0)."""
    spec = get_format(fmt)
    b = bits_of(x, spec)
    sign = b >> (spec.bits - 1)
    magnitude = b & ((1 << (spec.bits - 1)) - 1)
    return torch.where(sign == 1, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor, fmt: FormatLike) -> torch.Tensor:
    """Signed number of fmt values from b up to a (int64): positive when a > b, like a − b in ulps.

    Counts representable values between them, so it is exact across binades and zero.
    """
    return ordered_bits(a, fmt) - ordered_bits(b, fmt)
