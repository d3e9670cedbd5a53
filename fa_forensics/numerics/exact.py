"""Exact rational arithmetic on float formats (Python `Fraction`): the slow, obviously-right
reference that `explain_add` is built on and the vectorized code is tested against."""
from __future__ import annotations

from fractions import Fraction

from fa_forensics.numerics.formats import FormatLike, get_format


def floor_log2(x: Fraction) -> int:
    """floor(log2 x) for x > 0, exactly."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if x < Fraction(2) ** e:
        e -= 1
    elif x >= Fraction(2) ** (e + 1):
        e += 1
    return e


def round_fraction(x: Fraction, fmt: FormatLike, mode: str = "nearest-even") -> Fraction | float:
    """x rounded to `fmt` (nearest-even or toward-zero); ±inf (a float) where IEEE overflows."""
    spec = get_format(fmt)
    if x == 0:
        return Fraction(0)
    sign = -1 if x < 0 else 1
    a = abs(x)
    q = Fraction(2) ** (max(floor_log2(a), spec.emin) - spec.man_bits)
    n, rem = divmod(a, q)  # n integer, rem in [0, q)
    if mode == "nearest-even" and (rem > q / 2 or (rem == q / 2 and n % 2 == 1)):
        n += 1
    elif mode not in ("nearest-even", "toward-zero"):
        raise ValueError(f"round_fraction supports nearest-even and toward-zero, not {mode}")
    y = n * q
    if y > Fraction(spec.max_value):
        if spec.saturates or mode == "toward-zero":
            y = Fraction(spec.max_value)
        else:
            return sign * float("inf")
    return sign * y


def fma_fp32(acc: float, a: float, b: float) -> float:
    """fp32(acc + a·b) with one rounding, computed exactly (Python has no math.fma before 3.13)."""
    y = round_fraction(Fraction(acc) + Fraction(a) * Fraction(b), "fp32")
    return float(y)


def binary_digits(x: Fraction, exponent: int, fraction_bits: int) -> str:
    """|x| written in binary as a multiple of 2^exponent: integer part '.' `fraction_bits` bits (truncated)."""
    a = abs(x)
    units = a / Fraction(2) ** (exponent - fraction_bits)
    n = units.numerator // units.denominator
    digits = format(n, "b").rjust(fraction_bits + 1, "0")
    whole, frac = digits[: len(digits) - fraction_bits], digits[len(digits) - fraction_bits :]
    return f"{whole}.{frac}" if fraction_bits else whole


def exact_fraction_bits(x: Fraction, exponent: int, cap: int = 200) -> int:
    """How many fraction bits (relative to 2^exponent) write x exactly; capped at `cap`."""
    scaled = abs(x) / Fraction(2) ** exponent
    bits = 0
    while scaled.denominator != 1 and bits < cap:
        scaled *= 2
        bits += 1
    return bits
