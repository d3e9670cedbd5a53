"""Scalar numerics for compiled kernels (numba): the nearest-even cast and exp_fp32, one value at a time.

`round_ne(x, fmt)` gives the bits of `round_to(x, fmt)` (nearest-even) for fp32 x, and `exp32(x)`
those of `exp_fp32(x)`; both are tested against the torch versions over many values (every
fp8 value and its neighbours, random bit patterns, ties, overflow, subnormals, NaN and ±inf).
A format is passed as the `FormatCode` tuple (fraction bits, emin, largest finite value,
saturates): kernels take it as plain numbers.

- round_ne: |x| is rounded to a multiple of the quantum q = 2^(e − man_bits) (e the binade
  exponent of |x| clamped at emin, so subnormals fall out; read from the float64 bit pattern,
  which keeps the loop free of library calls so that it vectorizes) by adding and subtracting
  c = 2^52 · q in float64, where |x| < c and c's ulp is q: float64's own nearest-even does the
  rounding, exactly. Saturating formats clamp |x| to their largest value first (as the torch
  path's clamp before its cast); the others overflow to ±inf. NaN stays NaN, the sign of zero is kept.
- exp32: exp in float64 (argument reduction and a polynomial, no library call), rounded once to
  fp32: the bits of `exp_fp32` for every fp32 argument (checked exhaustively).

Kernels elsewhere inline these and numba caches them keyed on their own file only: after an
edit here, delete the `__pycache__/*.nbi` / `*.nbc` files (an installed copy is always fresh).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from fa_forensics.numerics.elementary import LOG2E
from fa_forensics.numerics.formats import FormatLike, get_format

_JIT = dict(nogil=True, cache=True, inline="always")


class FormatCode(NamedTuple):
    """A float format as plain numbers for a compiled kernel."""

    man_bits: int  # 23 = fp32: no rounding
    emin: int
    max_value: float
    saturates: bool


def format_code(fmt: FormatLike) -> FormatCode:
    """The FormatCode of a format (a name, a FloatFormat or a Precision)."""
    spec = get_format(fmt)
    return FormatCode(spec.man_bits, spec.emin, spec.max_value, spec.saturates)


@intrinsic
def _bits64(typingctx, x):
    """The bit pattern of a float64 as an int64 (a bit cast, no conversion)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _from_bits64(typingctx, n):
    """The float64 whose bit pattern is the int64 n."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@numba.njit(**_JIT)
def round_ne(x, man_bits, emin, max_value, saturates):
    """fp32 x rounded to nearest-even in the format (man_bits, emin, max_value, saturates); fp32."""
    if man_bits >= 23 or x != x:
        return np.float32(x)
    a = abs(np.float64(x))
    if a > max_value:
        if saturates:
            a = max_value
        elif a == math.inf:
            return np.float32(x)
    if a == 0.0:
        return np.float32(x)
    e = ((_bits64(a) >> 52) & 2047) - 1023  # floor(log2 |x|): a, an fp32 value, is a normal float64
    if e < emin:
        e = emin
    c = _from_bits64((e - man_bits + 52 + 1023) << 52)  # 2^(e − man_bits + 52), a normal float64
    y = (a + c) - c
    if y > max_value:
        y = math.inf
    return np.float32(math.copysign(y, x))


_LN2_HI = 6.93147180369123816490e-01  # ln 2 with its low 21 bits zero: k · _LN2_HI is exact for |k| < 2^21
_LN2_LO = 1.90821492927058770002e-10  # ln 2 − _LN2_HI
_INV_LN2 = LOG2E  # 1/ln 2
_ROUND = 6755399441055744.0  # 1.5 · 2^52: adding and subtracting it rounds a float64 to an integer
_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(14))


@numba.njit(**_JIT)
def exp32(x):
    """exp(x) for fp32 x: float64 exp rounded once to fp32 (exp(−inf) = 0, NaN stays NaN).

    exp(x) = 2^k · exp(r), k = round(x / ln 2), r = x − k ln 2 (|r| ≤ 0.35, Cody-Waite split),
    exp(r) − 1 by Horner in float64 (Taylor to degree 13, truncation below 2^-57), 2^k from its
    bit pattern: no library call, so the loops that use it vectorize. The range checks give 0
    below −110 and inf above 89, where fp32 exp is 0 and inf. The same bits as `exp_fp32` for
    every fp32 argument (checked exhaustively: docs/scale.md)."""
    d = np.float64(x)
    if d != d:
        return np.float32(d)
    if d < -110.0:
        return np.float32(0.0)
    if d > 89.0:
        return np.float32(math.inf)
    k = (d * _INV_LN2 + _ROUND) - _ROUND
    r = (d - k * _LN2_HI) - k * _LN2_LO
    c = _TAYLOR
    p = c[13]
    p = p * r + c[12]
    p = p * r + c[11]
    p = p * r + c[10]
    p = p * r + c[9]
    p = p * r + c[8]
    p = p * r + c[7]
    p = p * r + c[6]
    p = p * r + c[5]
    p = p * r + c[4]
    p = p * r + c[3]
    p = p * r + c[2]
    p = p * r * r + r  # exp(r) − 1
    return np.float32((1.0 + p) * _from_bits64((np.int64(k) + 1023) << 52))
