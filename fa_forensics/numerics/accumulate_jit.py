"""Compiled kernels of the accumulation models (numba): what `accumulate.matmul` runs on fp32 values.

Same contract as the torch kernels in `accumulate_tiles` and the reference steps in `accumulate`
(bit-identical, tested): a (L, M, K) @ b (L, K, N) from a starting accumulator acc (L, M, N),
every operand a finite fp32 number, result fp32.

- ieee: acc = fma(a_k, b_k, acc) for k = 0 .. K−1 in order, with LLVM's `llvm.fma.f32`, which
  is one correctly rounded fused multiply-add by definition (hardware FMA where the CPU has it,
  the C library's fmaf otherwise). That IS the ieee model for any fp32 operands: exact product,
  one nearest-even rounding of the sum, subnormals included. The output goes in register tiles
  (4 rows × 64 columns with AVX-512, × 16 otherwise): each accumulator is a vector register that
  takes the vector fma (`llvm.fma.v16f32`, lane by lane the same fma) of a broadcast a[i, k] and
  a row segment of b for k in order, so every element still sees its products in k order while
  the loads per fma drop to about a quarter; the tile is written in LLVM IR
  (`register_tiles.ieee_tile`) because numba's loop vectorizer keeps accumulators in memory.
  Leftover columns and rows take the scalar loop (k outer, columns inner). Attention's causal
  structure can be passed as a band (zero terms skipped, unwanted outputs 0).
- tensor-core: per group of F consecutive k the F products (exact in fp64: 24 × 24 significant
  bits, exponents far inside fp64's range) and the accumulator are aligned to the largest
  exponent e_max among them, truncated to multiples of 2^q, q = e_max − 23 − neab, summed exactly
  (integers below 2^(25 + neab), at most F + 1 of them: exact in fp64), and the sum is rounded
  toward zero to fp32. The output goes in register tiles (4 rows × 8 columns of fp64 with
  AVX-512, 2 × 4 otherwise: `register_tiles.tensor_core_tile`), the rest per row with columns
  vectorized: one pass over the group finds e_max per column, a second sums the truncated terms.

Why numba rather than a torch C++ extension: numba ships manylinux wheels (llvmlite bundles its
own LLVM), so a fresh machine needs no compiler and no build step at install time; kernels are
compiled on first use for the host CPU (a few seconds, cached on disk next to this file by
`cache=True`) and stay Python that a maintainer can read, with LLVM intrinsics (one fma here,
the register tiles in `register_tiles`) where the exact instruction matters. A C++ extension
would need a compiler and torch headers on every machine, a build of about a minute, and a
rebuild for every torch ABI.

Rows are spread over numba's threads (`prange`); `matmul` sets their number to torch's.
"""
from __future__ import annotations

import contextlib
import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from fa_forensics.numerics.register_tiles import IEEE_COLS, IEEE_ROWS, TC_COLS, TC_ROWS, ieee_tile, tensor_core_tile

_FP32_MAX = float(np.finfo(np.float32).max)
_FP32_TINY = 2.0**-126  # smallest normal fp32
_EXP_MASK = 2047
_JIT = dict(nogil=True, cache=True)


@intrinsic
def _fma32(typingctx, a, b, c):
    """fp32 fma(a, b, c) = round(a·b + c), one rounding: LLVM's llvm.fma.f32."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


_A, _C = types.float32[:, :, :], types.float32[:, :, ::1]  # any strides; C-contiguous


NO_LIMIT = 1 << 62  # a band offset that never limits


@numba.njit(nogil=True, cache=True)
def _is_negative_zero(x):
    return x == 0.0 and math.copysign(1.0, x) < 0.0


@numba.njit(nogil=True, cache=True)
def _ieee_chain(a_row, b, j, c, k_start, k_stop):
    """c after the fmas of the terms k_start .. k_stop − 1 of output column j, in order."""
    for k in range(k_start, k_stop):
        c = _fma32(a_row[k], b[k, j], c)
    return c


@numba.njit(nogil=True, cache=True)
def _row_tile(t, tiles, tile_rows, M, N, n_hi, out, zero):
    """Work item t of a kernel's prange: (l, i0, i1, n), rows [i0, i1) of product l, whose union of
    wanted columns is [0, n); out's rows are cleared past n (and all of it when `zero`)."""
    l = t // tiles
    i0 = (t % tiles) * tile_rows
    i1 = min(i0 + tile_rows, M)
    n = min(max(i1 - 1 + n_hi, 0), N)
    for i in range(i0, i1):
        out[l, i, n:] = 0.0
        if zero:
            out[l, i, :n] = 0.0
    return l, i0, i1, n


@numba.njit(nogil=True, cache=True)
def _tiled_columns(full_tile, n, N, tile_cols):
    """Columns [0, result) of a tile's rows go in register tiles: whole tiles, past n where N allows
    (a row's unwanted outputs are cleared afterwards), none for a tile cut short by M."""
    return min(n + tile_cols - 1, N) // tile_cols * tile_cols if full_tile else 0


@numba.njit(types.void(_A, _C, _C, types.boolean, types.int64, types.int64, types.int64), parallel=True, **_JIT)
def ieee_matmul(a, b, out, zero, k_lo, k_hi, n_hi):
    """out (L, M, N) fp32, holding the starting accumulator (zeros if `zero`: out is then only
    written), += a (L, M, K) @ b (L, K, N) by sequential fp32 fmas in k order (in place).

    Work goes in tiles of IEEE_ROWS rows × IEEE_COLS columns held in registers
    (`register_tiles.ieee_tile`), the rest of the columns (and rows) by the scalar loop; both are
    the same fma chain per element.
    Band (the causal structure of attention's products; ±NO_LIMIT: none): row i needs the terms
    k in [i + k_lo, i + k_hi) only, the caller vouching that a[i, k] is zero outside, and outputs
    j ≥ i + n_hi are not wanted: they are set to 0. A tile runs the union of its rows' ranges.
    A zero term is a no-op of the fma chain (fma(±0, b, c) = c for finite b), except on a zero
    accumulator: −0 + +0 = +0. So a chain that is −0 where skipped terms begin, at the start
    (a caller's accumulator) or at the end (a tiny negative product rounded to −0), takes them
    after all, in their place: rare, and exactly the full product's bits."""
    L, M, K = a.shape
    N = b.shape[2]
    a_l, a_row, a_k = a.strides[0] // 4, a.strides[1] // 4, a.strides[2] // 4
    tiles = (M + IEEE_ROWS - 1) // IEEE_ROWS
    for t in prange(L * tiles):
        l, i0, i1, n = _row_tile(t, tiles, IEEE_ROWS, M, N, n_hi, out, zero)
        k0 = min(max(i0 + k_lo, 0), K)  # the union of the rows' ranges: offsets grow with the row
        k1 = min(max(i1 - 1 + k_hi, k0), K)
        if k0 > 0 and not zero:  # a −0 start takes the skipped leading terms first
            for i in range(i0, i1):
                for j in range(n):
                    if _is_negative_zero(out[l, i, j]):
                        out[l, i, j] = _ieee_chain(a[l, i], b[l], j, out[l, i, j], 0, k0)
        j_tiled = _tiled_columns(i1 - i0 == IEEE_ROWS, n, N, IEEE_COLS)
        a_addr = a.ctypes.data + 4 * (l * a_l + i0 * a_row + k0 * a_k)
        for j0 in range(0, j_tiled, IEEE_COLS):
            ieee_tile(a_addr, a_row, a_k, b.ctypes.data + 4 * ((l * K + k0) * N + j0), N,
                      out.ctypes.data + 4 * ((l * M + i0) * N + j0), N, k1 - k0)
        for i in range(i0, i1):
            row = out[l, i]
            for k in range(k0, k1):
                a_ik = a[l, i, k]
                b_k = b[l, k]
                for j in range(j_tiled, n):
                    row[j] = _fma32(a_ik, b_k[j], row[j])
            n_i = min(max(i + n_hi, 0), N)
            row[n_i:] = 0.0  # this row's unwanted outputs (a tile computes past them)
            if k1 < K:
                for j in range(n_i):  # a chain ending at −0 takes the skipped trailing terms too
                    if _is_negative_zero(row[j]):
                        row[j] = _ieee_chain(a[l, i], b[l], j, row[j], k1, K)


@numba.njit(nogil=True, cache=True, inline="always")
def _lead(x):
    """2^floor(log2|x|) (0 for 0): the exponent a factor brings to a product's alignment."""
    if x == 0.0:
        return 0.0
    _, e = math.frexp(x)
    return math.ldexp(1.0, e - 1)


@numba.njit(nogil=True, cache=True)
def _tensor_core_row(a_row, b, row, F, neab, g0, g1, c0, c1):
    """Columns [c0, c1) of one output row (fp32, holding the accumulator) become the tensor-core
    model over the groups from g0 (a multiple of F) to g1: a_row (K,) @ b (K, N). Columns are
    vectorized: one pass over the group finds e_max per column (from the factors' exponents,
    2^(e_a + e_b), and |acc|), a second sums the truncated terms."""
    K = a_row.shape[0]
    width = max(c1 - c0, 0)
    acc = np.empty(width, np.float64)
    top = np.empty(width, np.float64)  # largest |term| per column
    scale = np.empty(width, np.float64)  # 2^-q per column
    inv_scale = np.empty(width, np.float64)  # 2^q
    total = np.empty(width, np.float64)  # exact sum of the aligned terms
    total_bits = total.view(np.int64)
    top_bits = top.view(np.int64)
    scale_bits = scale.view(np.int64)
    inv_bits = inv_scale.view(np.int64)
    mask = ~((1 << (29 + max(0, -neab))) - 1)  # accumulate_tiles.rz_mask(neab)
    for j in range(width):
        acc[j] = row[c0 + j]
    for k0 in range(g0, g1, F):
        n = min(F, K - k0)
        for j in range(width):
            top[j] = abs(acc[j])
        for f in range(n):
            lead_a = _lead(np.float64(a_row[k0 + f]))
            b_f = b[k0 + f, c0:c1]
            for j in range(width):
                top[j] = max(top[j], lead_a * _lead(abs(np.float64(b_f[j]))))
        for j in range(width):
            e_max = max(((top_bits[j] >> 52) & _EXP_MASK) - 1023, -900)  # floor(log2 top); zeros clamp
            scale_bits[j] = (1023 - (e_max - 23 - neab)) << 52  # 2^-q from its bit pattern
            inv_bits[j] = (2046 << 52) - scale_bits[j]  # 2^q
        for j in range(width):
            total[j] = 0.0  # +0: an all-zero group sums to +0, as an integer sum does
        for f in range(n):
            a_f = np.float64(a_row[k0 + f])
            b_f = b[k0 + f, c0:c1]
            for j in range(width):
                total[j] += np.trunc(a_f * np.float64(b_f[j]) * scale[j])  # exact scaling, truncation toward zero
        for j in range(width):  # the exact sum, scaled back by 2^q (exact: powers of two, normal range)
            x = (total[j] + np.trunc(acc[j] * scale[j])) * inv_scale[j]
            acc[j] = x
            total[j] = x
        for j in range(width):  # round toward zero to fp32 (24 bits, fewer for fp8: accumulate_tiles.rz_mask)
            total_bits[j] &= mask
        for j in range(width):  # outside fp32's normal range: ±max on overflow, the subnormal grid 2^-149
            t = total[j]
            at = abs(t)
            if at > _FP32_MAX:
                acc[j] = _FP32_MAX if t > 0 else -_FP32_MAX
            elif at < _FP32_TINY and at > 0:
                acc[j] = np.trunc(acc[j] * 2.0**149) * 2.0**-149
            else:
                acc[j] = t
    for j in range(width):
        row[c0 + j] = acc[j]


@numba.njit(types.void(_A, _C, _C, types.int64, types.int64, types.boolean, types.int64, types.int64, types.int64),
            parallel=True, **_JIT)
def tensor_core_matmul(a, b, out, F, neab, zero, k_lo, k_hi, n_hi):
    """out (L, M, N) fp32, holding the starting accumulator (zeros if `zero`), becomes the tensor-core model's
    a (L, M, K) @ b (L, K, N): groups of F products aligned to e_max, truncated, summed exactly,
    rounded toward zero to fp32 (in place).

    Work goes in tiles of TC_ROWS rows × TC_COLS columns held in registers
    (`register_tiles.tensor_core_tile`), the rest by `_tensor_core_row`; both do the same
    operations per element. Band as in `ieee_matmul`: a tile runs the groups that meet its rows'
    [i + k_lo, i + k_hi) (groups stay aligned to multiples of F), and outputs j ≥ i + n_hi are set
    to 0. A group of zero products leaves a nonzero accumulator as it is where the sum keeps fp32's
    24 bits (aligned to its own exponent, truncated, summed and rounded, an fp32 value comes back
    unchanged; fp8's 14-bit sums are not given a band with an accumulator: `accumulate.Band`) and
    turns ±0 into +0, which is what the skipped groups do here."""
    L, M, K = a.shape
    N = b.shape[2]
    a_l, a_row, a_k = a.strides[0] // 4, a.strides[1] // 4, a.strides[2] // 4
    tiles = (M + TC_ROWS - 1) // TC_ROWS
    for t in prange(L * tiles):
        l, i0, i1, n = _row_tile(t, tiles, TC_ROWS, M, N, n_hi, out, zero)
        g0 = min(max(i0 + k_lo, 0), K) // F * F  # the union of the rows' ranges, in whole groups
        g1 = min(max(i1 - 1 + k_hi, g0), K)
        g_stop = min(g0 + (g1 - g0 + F - 1) // F * F, K)  # where the last group run ends
        if g0 > 0 and not zero:  # a skipped group of zero products turns −0 into +0 (its sum is +0)
            for i in range(i0, i1):
                for j in range(n):
                    if out[l, i, j] == 0.0:
                        out[l, i, j] = 0.0
        j_tiled = _tiled_columns(i1 - i0 == TC_ROWS, n, N, TC_COLS)
        a_addr = a.ctypes.data + 4 * (l * a_l + i0 * a_row)
        for j0 in range(0, j_tiled, TC_COLS):
            tensor_core_tile(a_addr, a_row, a_k, b.ctypes.data + 4 * (l * K * N + j0), N,
                             out.ctypes.data + 4 * ((l * M + i0) * N + j0), N,
                             g0, (g1 - g0 + F - 1) // F, K, F, neab)
        for i in range(i0, i1):
            row = out[l, i]
            _tensor_core_row(a[l, i], b[l], row, F, neab, g0, g1, j_tiled, n)
            row[min(max(i + n_hi, 0), N):] = 0.0  # this row's unwanted outputs (a tile computes past them)
            if g_stop < K:  # skipped groups after the last: −0 becomes +0 there too
                for j in range(n):
                    if row[j] == 0.0:
                        row[j] = 0.0


_KERNEL_THREADS: list[int] = []  # set by `kernel_threads`: the count the kernels use inside it


def wanted_threads(torch_threads: int) -> int:
    """How many threads a kernel runs on: `kernel_threads`' count inside it, else torch's."""
    return _KERNEL_THREADS[-1] if _KERNEL_THREADS else torch_threads


@contextlib.contextmanager
def threads(n: int):
    """Run numba's parallel loops on n threads (at most as many as it started), then restore."""
    before = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(before)


@contextlib.contextmanager
def kernel_threads(n: int):
    """Inside: the compiled kernels run on n threads whatever torch's setting (a caller that puts
    torch on one thread, so its pool does not compete with numba's, keeps n for the kernels)."""
    _KERNEL_THREADS.append(max(1, n))
    try:
        with threads(n):
            yield
    finally:
        _KERNEL_THREADS.pop()


@numba.njit(types.boolean(types.float32[:]), **_JIT)
def all_finite(x):
    """True when no value of the fp32 vector x is ±inf or NaN (exponent bits all ones), in blocks
    whose integer test vectorizes."""
    bits = x.view(np.int32)
    exponent = np.int32(0x7F800000)
    for start in range(0, bits.shape[0], 4096):
        special = 0
        for i in range(start, min(start + 4096, bits.shape[0])):
            special |= np.int32((bits[i] & exponent) == exponent)
        if special:
            return False
    return True

