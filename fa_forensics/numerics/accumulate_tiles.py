"""Fast tile kernels of the accumulation models (what `accumulate.matmul` runs).

A tile is a block of output rows: at (Lt, K, m) = a's rows transposed (column k contiguous),
b (Lt, K, N), acc (Lt, m, N) the starting fp32 accumulator. Tiles are sized by the caller so
their temporaries stay in cache; every kernel here is bit-identical to the reference steps in
`accumulate` (`ieee_fma_step`, `tensor_core_group`), which the tests check.

Fast tensor-core kernel (`tensor_core_tile_fp32`), valid when the products are exact in fp32
(inputs with at most 12 significant bits) and the tile never meets a nonzero term below
2^-100 (checked per group, see `_TINY_BITS`; otherwise the caller redoes the tile in fp64).
Per group of F products it works in fp32/int32 only:
  e_max from the bit pattern of the largest product of the factors' leading powers of two
  (2^(e_a + e_b), the factors' fraction bits cleared: the operands are normal fp32 numbers here)
  and of |acc|; scale 2^-q, q = e_max − 23 − neab, and 2^q built from bit patterns; products ×
  scale, converted to int32 (truncation toward zero; |aligned| < 2^(25+neab)); exact int64 sum
  (int64); RZ to `result_bits(neab)` (24; 14 for the H100's fp8) by clearing the low 29 (39) fraction bits
  of the (exact) fp64 sum; × 2^q (exact, normal range).
Why the 2^-100 floor is enough: then e_max ≥ −100, so q ≥ −125 − neab ≥ −126 (2^±q are normal
fp32 numbers, results are normal) and a product whose exact value is below 2^-126 (inexact in
fp32) is below 2^q, so it truncates to 0 whatever fp32 did to it.

Fast exact ieee kernel for fp32 operands (`ieee_tile_fp64_exact`): fp32 × fp32 (or × bf16)
products are exact in fp64 (≤ 48 significant bits, exponents far inside fp64's range). Per k:
  s = fl64(acc + a_k·b_k)    one `addcmul` with fp64 output from the fp32 accumulator
  acc = fl32(s)              nearest-even conversion.
Why this is one correct rounding of the exact x = acc + a_k·b_k: fp32's rounding boundaries
(midpoints between neighbouring fp32 numbers, and the overflow threshold) are fp64 numbers, and
rounding to fp64 is monotone, so x and s lie on the same side of every boundary unless s IS a
boundary. So the result can differ only where s is an fp32 midpoint and s ≠ x. Those elements
are flagged (normal range: the low 29 fraction bits of s are 1000…0; fp32 subnormal range:
flagged wholesale when the tile can reach it with an inexact s, see `ieee_exact64_needs_tiny_check`),
and for them only the exact error e = x − s is found by TwoSum and s is rounded to odd (moved one
fp64 ulp toward x when e ≠ 0 and s is even), which with 53 ≥ 24 + 2 bits makes the fp32
conversion the correctly rounded sum. Cost: about 5 passes over the tile per k instead of ~15.
"""
from __future__ import annotations

import torch

_TINY_BITS = (127 - 100) << 23  # fp32 bit pattern of 2^-100: smallest nonzero |term| the fast kernel accepts
_ABS_MASK = 0x7FFFFFFF

def result_bits(neab: int) -> int:
    """Significant bits a tensor-core group's sum is rounded toward zero to: fp32's 24, or 24 + neab where the
    alignment keeps fewer (the H100's fp8 MMA, neab −10: 14 bits; with it every published fp8 output of the
    H100 is reproduced, with 24 bits 71.7 % / 83.2 %)."""
    return 24 + min(0, neab)


def rz_mask(neab: int) -> int:
    """The int64 mask that rounds an fp64 value toward zero to `result_bits(neab)` significant bits (fp64
    keeps 53: clear the low 53 − bits; 29 for fp32's 24)."""
    return ~((1 << (53 - result_bits(neab))) - 1)

_SIGN_EXPONENT_32 = -(1 << 23)  # fp32 sign and exponent bits: x & this = ±2^floor(log2|x|) for normal x


def tensor_core_tile_fp32(at: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, F: int, neab: int, track: bool = True):
    """The tensor-core model on one tile in fp32/int32; returns (out fp32 (Lt, m, N), ok: bool).

    at (Lt, K, m) fp32, b (Lt, K, N) fp32, acc (Lt, m, N) fp32. ok is False when some group met
    a nonzero term below 2^-100: then `out` is not the model's value and the caller must redo
    the tile with the fp64 reference. `track=False` skips that check (3 ops per group) where the
    caller has proved it cannot fail (`no_tiny_terms`).
    """
    Lt, K, m = at.shape
    N = b.shape[-1]
    prods = torch.empty(Lt, F, m, N, dtype=torch.float32)  # (Lt, F, m, N) one group's products
    ints = torch.empty(Lt, F, m, N, dtype=torch.int32)  # the same, aligned and truncated
    smallest = torch.full((Lt, m, N), _ABS_MASK, dtype=torch.int32)  # min over groups of (bits(top) - 1) mod 2^31
    acc = acc.to(torch.float32).clone()
    lead_a = (at.view(torch.int32) & _SIGN_EXPONENT_32).view(torch.float32).abs()  # (Lt, K, m) 2^e_a
    lead_b = (b.view(torch.int32) & _SIGN_EXPONENT_32).view(torch.float32).abs()  # (Lt, K, N) 2^e_b
    leads = torch.empty(Lt, F, m, N, dtype=torch.float32)
    scale_c = 127 + 23 + neab + 127  # bits(2^-q) >> 23 = scale_c − E, E the biased exponent of the top
    mask = rz_mask(neab)
    for k0 in range(0, K, F):
        n = min(F, K - k0)
        P, I, E = prods[:, :n], ints[:, :n], leads[:, :n]
        torch.mul(at[:, k0 : k0 + n, :, None], b[:, k0 : k0 + n, None, :], out=P)  # exact products
        torch.mul(lead_a[:, k0 : k0 + n, :, None], lead_b[:, k0 : k0 + n, None, :], out=E)  # 2^(e_a + e_b)
        top = E.amax(dim=1)  # (Lt, m, N) the largest product exponent, as a power of two
        top = torch.maximum(top, acc.abs(), out=top)  # the accumulator included
        top_bits = top.view(torch.int32)
        # zeros wrap to 2^31 − 1 (harmless); any nonzero top below 2^-100 makes `smallest` small
        if track:
            torch.minimum(smallest, (top_bits - 1).bitwise_and_(_ABS_MASK), out=smallest)
        scale_bits = (scale_c - (top_bits >> 23)).clamp_(max=253).bitwise_left_shift_(23)  # 2^-q (2^126 for zeros)
        scale = scale_bits.view(torch.float32)  # (Lt, m, N)
        I.copy_(P.mul_(scale.unsqueeze(1)))  # float -> int truncates toward zero: no sticky bit
        total = I.sum(dim=1, dtype=torch.int64)  # exact
        total += (acc * scale).to(torch.int64)  # the accumulator, aligned the same way
        t64 = total.to(torch.float64)  # exact: below 2^53
        t64.view(torch.int64).bitwise_and_(mask)  # round toward zero to result_bits(neab) significant bits
        inv_scale = ((254 << 23) - scale_bits).view(torch.float32)  # 2^q
        acc = t64.to(torch.float32).mul_(inv_scale)  # exact: a normal fp32 number
    ok = (not track) or bool(smallest.min() >= _TINY_BITS - 1)
    return acc, ok


def min_nonzero_abs(x: torch.Tensor, dims) -> torch.Tensor:
    """Smallest nonzero |x| over `dims` (fp32; 2^128 → inf where all are zero)."""
    bits = x.to(torch.float32).view(torch.int32)
    m = ((bits - 1) & _ABS_MASK).amin(dim=dims)  # zeros wrap to 2^31 − 1
    return (m + 1).clamp_(max=0x7F800000).view(torch.float32)


def no_tiny_terms(min_a: torch.Tensor, min_b: torch.Tensor, min_acc: torch.Tensor, neab: int) -> torch.Tensor:
    """Per lead entry: True where no group can meet a nonzero term below 2^-100, so the fp32
    kernel needs no check. Nonzero products are ≥ min_a·min_b =: p; a nonzero accumulator is
    either ≥ min_acc, a truncation of an earlier one (same binade), or a multiple of 2^q with
    q = e_max − 23 − neab ≥ floor(log2 p) − 23 − neab. So p ≥ 2^(−77 + neab) and min_acc ≥ 2^-100
    suffice (neab ≤ 3)."""
    return (min_a.double() * min_b.double() >= 2.0 ** (-77 + neab)) & (min_acc >= 2.0**-100)


def ieee_tile_fp32(at: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The ieee model on one tile when every product is exact (and normal) in fp32: one
    rounding per add, FMA or not. at (Lt, K, m), b (Lt, K, N), acc (Lt, m, N) -> fp32 (Lt, m, N)."""
    out = acc.to(torch.float32).clone()
    for k in range(at.shape[1]):
        out.addcmul_(at[:, k, :, None], b[:, k, None, :])
    return out


_LOW29 = (1 << 29) - 1  # fp64 fraction bits below fp32's 23
_MID29 = 1 << 28  # low 29 bits of an fp64 number that is a midpoint of two normal fp32 numbers
_ABS64 = 0x7FFFFFFFFFFFFFFF
_FP32_NORMAL_MIN_BITS64 = (1023 - 126) << 52  # fp64 bit pattern of 2^-126


def ieee_exact64_needs_tiny_check(min_a: torch.Tensor, min_b: torch.Tensor) -> torch.Tensor:
    """Per lead entry: True where an inexact fp64 sum could land in fp32's subnormal range.

    min_a, min_b: smallest nonzero |a|, |b| (fp32, inf where all zero). A sum x = acc + p with
    |x| ≤ 2^-126 is a multiple of min(2^-149, ulp(a)·ulp(b)) (acc is an fp32 number); ulp(y) ≥
    |y|·2^-24 for every nonzero fp32 y, so if min_a·min_b ≥ 2^-131 that grid is ≥ 2^-179 and x has
    at most 53 significant bits: s = x exactly, nothing to check."""
    return (min_a.double() * min_b.double()) < 2.0**-131


def ieee_tile_fp64_exact(at: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, tiny_check: bool = True) -> torch.Tensor:
    """The ieee model on one tile whose operands are fp32 numbers (any fp32, fp32 × fp32 included).

    at (Lt, K, m), b (Lt, K, N): float tensors holding fp32-representable values; acc (Lt, m, N)
    the starting fp32 accumulator. Returns fp32 (Lt, m, N), bit-identical to the fma chain
    (`ieee_fma_step`). tiny_check=False skips the subnormal-range flag where
    `ieee_exact64_needs_tiny_check` proved it unnecessary.
    """
    Lt, K, m = at.shape
    N = b.shape[-1]
    a64 = at.to(torch.float64).contiguous()  # (Lt, K, m): column k of a is contiguous
    b64 = b.to(torch.float64).contiguous()  # (Lt, K, N)
    acc32 = torch.empty(Lt, m, N, dtype=torch.float32)  # (Lt, m, N) the running fp32 accumulator
    acc32.copy_(acc)
    s = torch.empty(Lt, m, N, dtype=torch.float64)  # fl64(acc + a_k b_k)
    s_bits = s.view(torch.int64)
    work = torch.empty(Lt, m, N, dtype=torch.int64)
    flag = torch.empty(Lt, m, N, dtype=torch.bool)
    tiny = torch.empty(Lt, m, N, dtype=torch.bool) if tiny_check else None
    for k in range(K):
        a_k, b_k = a64[:, k, :, None], b64[:, k, None, :]  # (Lt, m, 1), (Lt, 1, N)
        torch.addcmul(acc32, a_k, b_k, out=s)  # fp32 acc promoted exactly; the product is exact
        torch.bitwise_and(s_bits, _LOW29, out=work)
        torch.eq(work, _MID29, out=flag)  # s is a midpoint of two normal fp32 numbers
        if tiny is not None:  # nonzero |s| < 2^-126 (zeros wrap to the top and are not flagged)
            torch.sub(s_bits, 1, out=work).bitwise_and_(_ABS64)
            torch.lt(work, _FP32_NORMAL_MIN_BITS64 - 1, out=tiny)
            flag.logical_or_(tiny)
        idx = flag.view(-1).nonzero().squeeze(1)  # a few per k: e.g. ~1% for fp32 × bf16
        if idx.numel():
            _round_flagged_to_odd(s.view(-1), acc32.view(-1), a_k, b_k, idx, m, N)
        acc32.copy_(s)  # one nearest-even rounding to fp32
    return acc32


def _round_flagged_to_odd(s: torch.Tensor, acc: torch.Tensor, a_k: torch.Tensor, b_k: torch.Tensor,
                          idx: torch.Tensor, m: int, N: int) -> None:
    """For the flat positions idx of a tile (Lt, m, N): replace s by fl64(acc + a·b) rounded to odd."""
    lead, rest = idx.div(m * N, rounding_mode="floor"), idx.remainder(m * N)
    row, col = rest.div(N, rounding_mode="floor"), rest.remainder(N)
    prod = a_k[lead, row, 0] * b_k[lead, 0, col]  # exact in fp64
    s[idx] = sum_round_to_odd(acc[idx].to(torch.float64), prod)


def sum_round_to_odd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y (fp64) rounded to odd: fl64(x + y), moved one ulp toward the exact sum when inexact
    and even. Rounding that to a format with ≤ 51 significant bits is then one correct rounding
    of x + y. Infinite and NaN sums are left as IEEE makes them (inf + finite = inf, inf − inf = NaN)."""
    s = x + y
    bb = s - x
    err = (x - (s - bb)) + (y - bb)  # TwoSum: s + err == x + y exactly
    bits = s.view(torch.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)  # err is NaN where s is not finite
    away = (err > 0) == (s > 0)  # the exact sum lies farther from zero than s
    return torch.where(inexact_even, bits + torch.where(away, 1, -1), bits).view(torch.float64)
