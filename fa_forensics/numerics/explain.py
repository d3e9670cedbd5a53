"""One floating-point addition explained bit by bit, as in the paper's worked example (§3.3.2).

The operands are values of the accumulator format `acc` (fp32): the running sum of P̄V and the
next term. Their exact sum is rounded to `acc` (nearest-even), then stored into `into`
(nearest-even), which is where the biased rounding of the paper happens:

  FP32 −2.4071154594421387 + −2.296875 = −4.703990459442139 (exact in fp32)
  → BF16 −4.71875: round bit 1, sticky 1 → rounds up (away from zero), error −0.01475954…

Bits reported (for the rounding into `into`, from the value that is stored: the acc sum, or the
exact sum when into is as wide as acc):
- round: the first bit below the last kept fraction bit of `into` (the paper's "rounding bit");
- sticky: 1 when any bit below the round bit is 1;
- guard: the first bit below fp32's (acc's) last bit in the exact sum, i.e. 1 when the
  accumulator addition itself lost half an ulp or more (0 in the paper's example: the sum fits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from fa_forensics.errors import UserError
from fa_forensics.numerics.bits import bit_string
from fa_forensics.numerics.exact import binary_digits, exact_fraction_bits, floor_log2, round_fraction
from fa_forensics.numerics.formats import FormatLike, get_format


@dataclass(frozen=True)
class AddExplanation:
    """a + b in `acc`, then stored into `into`, bit by bit (see the module docstring)."""

    a: float  # operands as values of acc (the inputs rounded to acc if they were not)
    b: float
    a_bits: str  # acc bit strings: sign exponent fraction, no spaces
    b_bits: str
    operands_exact: bool  # False when an input was not a value of acc and had to be rounded
    exact: float  # the exact sum (a Python float; exact whenever it fits in fp64)
    exact_fits_acc: bool  # the exact sum is a value of acc
    exact_bits: Optional[str]  # acc bit string of the exact sum when it fits, else None
    acc_sum: float  # the sum rounded to acc (what the accumulator holds)
    acc_sum_bits: str
    rounded: float  # the value stored into `into`
    rounded_bits: str
    error: float  # rounded − exact
    guard: int
    round: int
    sticky: int
    direction: str  # "up" (away from zero) | "down" (toward zero) | "exact"
    into: str
    acc: str
    # a paper-style printout: significands aligned to the larger exponent
    exponent: Optional[int]  # exponent of the larger operand (None if both are 0)
    a_aligned: str  # e.g. "-1.00110100000111000101110"
    b_aligned: str
    sum_aligned: str  # before normalization, e.g. "-10.01011010000111000101110"
    shift: int  # normalization: +1 = carry out (shift right), < 0 = cancellation (shift left)
    sum_exponent: Optional[int]
    normalized: str  # the stored-from value normalized, e.g. "-1.00101101000011100010111"
    kept: str  # the significand bits `into` keeps, e.g. "1.0010110"
    round_and_rest: str  # the round bit followed by the sticky bits, e.g. "1000011100010111"
    rounded_significand: str  # e.g. "1.0010111"


def explain_add(a: float, b: float, into: FormatLike = "bf16", acc: FormatLike = "fp32") -> AddExplanation:
    """Explain a + b accumulated in `acc` and stored into `into` (both nearest-even)."""
    into_spec, acc_spec = get_format(into), get_format(acc)
    for name, value in (("A", a), ("B", b)):
        if not math.isfinite(float(value)):
            raise UserError(f"explain_add: operand {name} = {value} is not finite; give two finite numbers")
    a_in, b_in = Fraction(float(a)), Fraction(float(b))
    fa, fb = round_fraction(a_in, acc_spec), round_fraction(b_in, acc_spec)
    if isinstance(fa, float) or isinstance(fb, float):
        raise UserError(f"explain_add: an operand overflows {acc_spec.name}; give values below {acc_spec.max_value:g}")
    exact = fa + fb
    acc_sum = round_fraction(exact, acc_spec)
    source = acc_sum if into_spec.precision < acc_spec.precision else exact
    rounded = round_fraction(Fraction(source) if not isinstance(source, float) else source, into_spec)
    if isinstance(acc_sum, float) or isinstance(rounded, float):
        raise UserError("explain_add: the sum overflows "
                        f"{acc_spec.name if isinstance(acc_sum, float) else into_spec.name}; give smaller operands")

    guard, _, _ = _rounding_bits(exact, acc_spec)
    round_bit, sticky, _ = _rounding_bits(source, into_spec)
    if abs(rounded) > abs(exact):
        direction = "up"
    elif abs(rounded) < abs(exact):
        direction = "down"
    else:
        direction = "exact"

    layout = _layout(fa, fb, exact, source, rounded, acc_spec, into_spec)
    return AddExplanation(
        a=float(fa), b=float(fb),
        a_bits=bit_string(float(fa), acc_spec), b_bits=bit_string(float(fb), acc_spec),
        operands_exact=(fa == a_in and fb == b_in),
        exact=float(exact),
        exact_fits_acc=(acc_sum == exact),
        exact_bits=bit_string(float(exact), acc_spec) if acc_sum == exact else None,
        acc_sum=float(acc_sum), acc_sum_bits=bit_string(float(acc_sum), acc_spec),
        rounded=float(rounded), rounded_bits=bit_string(float(rounded), into_spec),
        error=float(rounded - exact),
        guard=guard, round=round_bit, sticky=sticky, direction=direction,
        into=into_spec.name, acc=acc_spec.name,
        **layout,
    )


def _rounding_bits(x: Fraction, spec) -> tuple[int, int, int]:
    """(round bit, sticky bit, binade exponent) of |x| rounded to spec's precision."""
    if x == 0:
        return 0, 0, spec.emin
    e = max(floor_log2(abs(x)), spec.emin)
    units = abs(x) / Fraction(2) ** (e - spec.man_bits)
    rem = units - (units.numerator // units.denominator)  # in [0, 1): the dropped bits
    round_bit = int(rem >= Fraction(1, 2))
    sticky = int(rem - Fraction(round_bit, 2) != 0)
    return round_bit, sticky, e


def _signed(x: Fraction, digits: str) -> str:
    return ("-" if x < 0 else "") + digits


def _layout(fa, fb, exact, source, rounded, acc_spec, into_spec) -> dict:
    """Aligned significand strings for the printout."""
    nonzero = [abs(v) for v in (fa, fb) if v != 0]
    if not nonzero:
        zero = "0." + "0" * acc_spec.man_bits
        return dict(exponent=None, a_aligned=zero, b_aligned=zero, sum_aligned=zero, shift=0, sum_exponent=None,
                    normalized=zero, kept="0." + "0" * into_spec.man_bits, round_and_rest="",
                    rounded_significand="0." + "0" * into_spec.man_bits)
    E = max(floor_log2(v) for v in nonzero)  # exponent of the larger operand
    width = max(acc_spec.man_bits, max(exact_fraction_bits(v, E) for v in (fa, fb, exact)))
    a_aligned = _signed(fa, binary_digits(fa, E, width))
    b_aligned = _signed(fb, binary_digits(fb, E, width))
    sum_aligned = _signed(exact, binary_digits(exact, E, width))
    if source == 0:
        return dict(exponent=E, a_aligned=a_aligned, b_aligned=b_aligned, sum_aligned=sum_aligned, shift=0,
                    sum_exponent=None,
                    normalized="0." + "0" * acc_spec.man_bits, kept="0." + "0" * into_spec.man_bits, round_and_rest="",
                    rounded_significand="0." + "0" * into_spec.man_bits)
    Es = floor_log2(abs(source))
    Ek = max(Es, into_spec.emin)  # subnormals of `into` keep fewer bits
    nbits = max(acc_spec.man_bits, exact_fraction_bits(source, Ek))
    normalized = binary_digits(source, Ek, nbits)
    keep = into_spec.man_bits + 2  # "1." plus the kept fraction bits
    Er = max(floor_log2(abs(rounded)), into_spec.emin) if rounded != 0 else Ek
    rounded_sig = binary_digits(rounded, Er, into_spec.man_bits)
    return dict(exponent=E, a_aligned=a_aligned, b_aligned=b_aligned, sum_aligned=sum_aligned,
                shift=Es - E, sum_exponent=Es, normalized=_signed(source, normalized),
                kept=normalized[:keep], round_and_rest=normalized[keep:], rounded_significand=rounded_sig)
