"""Fast tile kernels of the accumulation models (what `accumulate.matmul` runs).

A tile is a block of output rows: at (Lt, K, m) = a's rows transposed (column k contiguous),
b (Lt, K, N), acc (Lt, m, N) the starting fp32 accumulator. Tiles are sized by the caller so
their temporaries stay in cache; every kernel here is bit-identical to the reference steps in
`accumulate` (`ieee_fma_step`, `tensor_core_group`), which the tests check.

Fast tensor-core kernel (`tensor_core_tile_fp32`), valid when the products are exact in fp32
(inputs with at most 12 significant bits) and the tile never meets a nonzero term below
2^-100 (checked per group, see `_TINY_BITS`; otherwise the caller redoes the tile in fp64).
Per group of F products it works in fp32/int32 only:
  e_max from the bit pattern of the largest |term|; scale 2^-q, q = e_max − 23 − neab, and
  2^q built from bit patterns; products × scale, converted to int32 (truncation toward zero);
  exact int32 sum (|aligned| < 2^(24+neab), so F + 1 of them fit); RZ to 24 bits by clearing
  the low 29 fraction bits of the (exact) fp64 sum; × 2^q (exact, normal range).
Why the 2^-100 floor is enough: then e_max ≥ −100, so q ≥ −125 − neab ≥ −126 (2^±q are normal
fp32 numbers, results are normal) and a product whose exact value is below 2^-126 (inexact in
fp32) is below 2^q, so it truncates to 0 whatever fp32 did to it.
"""
from __future__ import annotations

import torch

_TINY_BITS = (127 - 100) << 23  # fp32 bit pattern of 2^-100: smallest nonzero |term| the fast kernel accepts
_ABS_MASK = 0x7FFFFFFF
_RZ24_MASK = ~((1 << 29) - 1)  # fp64 keeps 52 fraction bits, fp32 23: clearing the low 29 truncates to fp32


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
    scale_c = 127 + 23 + neab + 127  # bits(2^-q) >> 23 = scale_c − E, E the biased exponent of the top
    for k0 in range(0, K, F):
        n = min(F, K - k0)
        P, I = prods[:, :n], ints[:, :n]
        torch.mul(at[:, k0 : k0 + n, :, None], b[:, k0 : k0 + n, None, :], out=P)  # exact products
        top = torch.maximum(P.amax(dim=1), P.amin(dim=1).neg_())  # (Lt, m, N) largest |product|
        top = torch.maximum(top, acc.abs(), out=top)  # largest |term|, accumulator included
        top_bits = top.view(torch.int32)
        # zeros wrap to 2^31 − 1 (harmless); any nonzero top below 2^-100 makes `smallest` small
        if track:
            torch.minimum(smallest, (top_bits - 1).bitwise_and_(_ABS_MASK), out=smallest)
        scale_bits = (scale_c - (top_bits >> 23)).clamp_(max=253).bitwise_left_shift_(23)  # 2^-q (2^126 for zeros)
        scale = scale_bits.view(torch.float32)  # (Lt, m, N)
        I.copy_(P.mul_(scale.unsqueeze(1)))  # float -> int truncates toward zero: no sticky bit
        total = I.sum(dim=1, dtype=torch.int32)  # exact: (F + 1) · 2^(24 + neab) < 2^31
        total += (acc * scale).to(torch.int32)  # the accumulator, aligned the same way
        t64 = total.to(torch.float64)  # exact
        t64.view(torch.int64).bitwise_and_(_RZ24_MASK)  # round toward zero to 24 significant bits
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
