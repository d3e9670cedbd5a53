"""Float formats the papers use: fp32, bf16, fp16, fp8 e4m3 (fn) and fp8 e5m2.

A `FloatFormat` is the arithmetic description (sign, exponent and fraction widths, bias,
largest finite value, whether the format has infinities) that rounding, bit views and the
explanation of an addition all share. Every public function of `fa_forensics.numerics`
accepts a format as a `FloatFormat`, its name ("bf16") or a `Precision` enum value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from fa_forensics.errors import ConfigError


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, `exp_bits` exponent bits, `man_bits` fraction bits."""

    name: str
    exp_bits: int
    man_bits: int  # fraction bits (the stored significand without its implicit leading 1)
    bias: int
    max_value: float  # largest finite value
    has_inf: bool  # False for e4m3fn: the all-ones exponent is ordinary numbers (and NaN)
    saturates: bool  # casts clamp overflow to ±max_value instead of ±inf (the fp8 casts we model)
    torch_dtype: torch.dtype

    @property
    def bits(self) -> int:
        """Total width of a bit pattern."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def precision(self) -> int:
        """Significand bits including the implicit one (p)."""
        return self.man_bits + 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number: 2**emin."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest binade holding finite numbers."""
        return int(torch.tensor(self.max_value, dtype=torch.float64).frexp()[1]) - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.man_bits)


FORMATS: dict[str, FloatFormat] = {
    "fp32": FloatFormat("fp32", 8, 23, 127, (2 - 2.0**-23) * 2.0**127, True, False, torch.float32),
    "bf16": FloatFormat("bf16", 8, 7, 127, (2 - 2.0**-7) * 2.0**127, True, False, torch.bfloat16),
    "fp16": FloatFormat("fp16", 5, 10, 15, 65504.0, True, False, torch.float16),
    # e4m3fn: exponent 1111 holds numbers up to 1.75 * 2^8 = 448; S.1111.111 is NaN; no infinities.
    "fp8_e4m3": FloatFormat("fp8_e4m3", 4, 3, 7, 448.0, False, True, torch.float8_e4m3fn),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, 15, 57344.0, True, True, torch.float8_e5m2),
}

_ALIASES = {
    "float32": "fp32", "f32": "fp32", "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "e4m3": "fp8_e4m3", "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8-e4m3": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "fp8-e5m2": "fp8_e5m2",
}

FormatLike = Union[FloatFormat, str]  # a Precision enum is a str subclass, so it fits here too


def get_format(fmt: FormatLike) -> FloatFormat:
    """Resolve a FloatFormat, a name ("bf16", "fp8_e4m3", aliases like "bfloat16") or a Precision."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        for spec in FORMATS.values():
            if spec.torch_dtype == fmt:
                return spec
        raise ConfigError(f"no float format for torch dtype {fmt}; use one of {', '.join(FORMATS)}")
    name = getattr(fmt, "value", fmt)
    if isinstance(name, str):
        key = name.strip().lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ConfigError(f"unknown float format {fmt!r}; use one of {', '.join(FORMATS)}")


def to_torch_dtype(fmt: FormatLike) -> torch.dtype:
    """The torch dtype that stores values of `fmt` (fp8 e4m3 → torch.float8_e4m3fn)."""
    return get_format(fmt).torch_dtype
