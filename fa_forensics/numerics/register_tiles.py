"""Register tiles of the two accumulation models, written in LLVM IR (numba intrinsics).

A register tile computes a few rows × one or more vector registers of columns of a product,
holding its accumulators in vector registers across the whole reduction: LLVM promotes the
allocas below to registers. numba's own loop vectorizer keeps such accumulators in memory (one
load and one store per term), which is what these replace. Each lane performs exactly the
scalar operations of the kernels in `accumulate_jit` on its own column, in the same order, so the
bits are the scalar loop's (tested against the torch kernels).

Shapes follow the host: AVX-512 gives 16 fp32 / 8 fp64 lanes per register, otherwise (AVX2) 8 / 4
and smaller tiles so that the accumulators fit in the 16 registers. numba keys its on-disk cache
on the CPU, so a cached kernel is never run on another instruction set.

All addresses are integers (`array.ctypes.data` plus an element offset × 4) and all strides are
in elements; the caller keeps every access inside its arrays.
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# FA_FORENSICS_AVX2_TILES=1 takes the AVX2 shapes on an AVX-512 host (how the tests cover them;
# give such a process its own NUMBA_CACHE_DIR, or it loads kernels cached with the other shapes)
AVX512 = "+avx512f" in llvm.get_host_cpu_features().flatten() and os.environ.get("FA_FORENSICS_AVX2_TILES") != "1"

FP32_LANES = 16 if AVX512 else 8
IEEE_ROWS, IEEE_VECTORS = 4, (4 if AVX512 else 2)  # ieee tile: 4 rows × 4 (2) fp32 vectors
IEEE_COLS = IEEE_VECTORS * FP32_LANES

FP64_LANES = 8 if AVX512 else 4
TC_ROWS = 4 if AVX512 else 2  # tensor-core tile: 4 (2) rows × one fp64 vector, 4 registers per accumulator
TC_COLS = FP64_LANES

_FP32_MAX = float(np.finfo(np.float32).max)
_I64 = ir.IntType(64)


def _splat(builder, x, vector_type):
    """x broadcast to every lane of vector_type."""
    lanes = vector_type.count
    v = builder.insert_element(ir.Constant(vector_type, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _vector_at(builder, base, offset, vector_type):
    """Pointer to the vector at element `offset` of the fp32 pointer `base`."""
    return builder.bitcast(builder.gep(base, [offset]), vector_type.as_pointer())


def _const(value, vector_type):
    return ir.Constant(vector_type, [value] * vector_type.count)


def _offset(builder, stride, count):
    """stride × count (count a Python int), an i64."""
    return builder.mul(stride, ir.Constant(_I64, count))


@intrinsic
def ieee_tile(typingctx, a_addr, a_row, a_k, b_addr, b_k, c_addr, c_row, n_k):
    """C (IEEE_ROWS × IEEE_COLS fp32 at c_addr, rows c_row apart) += A @ B with A (IEEE_ROWS × n_k at
    a_addr, strides a_row, a_k) and B (n_k × IEEE_COLS at b_addr, rows b_k apart). Each accumulator
    is a vector register that takes `llvm.fma.v*f32` of the broadcast a[r, k] and the row k of B
    for k = 0 .. n_k − 1 in order: per element the ieee model's sequential fma chain."""
    sig = types.void(*([types.intp] * 8))

    def codegen(context, builder, signature, args):
        a_addr, a_row, a_k, b_addr, b_k, c_addr, c_row, n_k = args
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, FP32_LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                             f"llvm.fma.v{FP32_LANES}f32")
        a, b, c = (builder.inttoptr(x, f32.as_pointer()) for x in (a_addr, b_addr, c_addr))
        slots, homes = [], []
        for r in range(IEEE_ROWS):
            for v in range(IEEE_VECTORS):
                home = _vector_at(builder, c, builder.add(_offset(builder, c_row, r), ir.Constant(_I64,
                                                                                                  v * FP32_LANES)), vec)
                slot = cgutils.alloca_once(builder, vec)
                builder.store(builder.load(home, align=4), slot)
                slots.append(slot)
                homes.append(home)
        with cgutils.for_range(builder, n_k) as loop:
            b_row = builder.gep(b, [builder.mul(loop.index, b_k)])
            b_vectors = [builder.load(_vector_at(builder, b_row, ir.Constant(_I64, v * FP32_LANES), vec), align=4)
                         for v in range(IEEE_VECTORS)]
            a_col = builder.gep(a, [builder.mul(loop.index, a_k)])
            for r in range(IEEE_ROWS):
                a_rk = _splat(builder, builder.load(builder.gep(a_col, [_offset(builder, a_row, r)])), vec)
                for v in range(IEEE_VECTORS):
                    slot = slots[r * IEEE_VECTORS + v]
                    builder.store(builder.call(fma, [a_rk, b_vectors[v], builder.load(slot)]), slot)
        for slot, home in zip(slots, homes):
            builder.store(builder.load(slot), home, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tensor_core_tile(typingctx, a_addr, a_row, a_k, b_addr, b_k, c_addr, c_row, k_start, n_groups, k_end, F, neab):
    """C (TC_ROWS × TC_COLS fp32 at c_addr, rows c_row apart) becomes the tensor-core model of
    C + A @ B over the groups of F terms starting at k_start (n_groups of them, the last one cut at
    k_end); A at a_addr (strides a_row, a_k; column k at a_addr + k·a_k), B at b_addr (rows b_k
    apart, row k at b_addr + k·b_k). Per lane and group, as `accumulate_jit.tensor_core_matmul`:
    e_max of the products' factor exponents (2^(e_a + e_b)) and the accumulator (in fp64), 2^-q
    from its bit pattern, the truncated
    scaled terms summed exactly, scaled back, rounded toward zero to fp32 (±max on overflow, the
    subnormal grid below)."""
    sig = types.void(*([types.intp] * 12))

    def codegen(context, builder, signature, args):
        a_addr, a_row, a_k, b_addr, b_k, c_addr, c_row, k_start, n_groups, k_end, F, neab = args
        f32, f64 = ir.FloatType(), ir.DoubleType()
        v32, v64, vi = (ir.VectorType(t, FP64_LANES) for t in (f32, f64, _I64))

        def fn(name, n_args):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64, [v64] * n_args),
                                                  f"llvm.{name}.v{FP64_LANES}f64")

        fabs, vmax, vtrunc, copysign = fn("fabs", 1), fn("maxnum", 2), fn("trunc", 1), fn("copysign", 2)
        a, b, c = (builder.inttoptr(x, f32.as_pointer()) for x in (a_addr, b_addr, c_addr))
        homes = [_vector_at(builder, c, _offset(builder, c_row, r), v32) for r in range(TC_ROWS)]
        accs, tops, totals, scales = ([cgutils.alloca_once(builder, v64) for _ in range(TC_ROWS)] for _ in range(4))
        for home, acc in zip(homes, accs):
            builder.store(builder.fpext(builder.load(home, align=4), v64), acc)

        def b_vector(k):
            return builder.fpext(builder.load(_vector_at(builder, b, builder.mul(k, b_k), v32), align=4), v64)

        def lead(x):  # ±2^floor(log2|x|): the fp64 sign and exponent bits (fp32 values are normal in fp64)
            return builder.bitcast(builder.and_(builder.bitcast(x, vi), _const(-(1 << 52), vi)), v64)

        def a_splat(r, k):
            a_rk = builder.load(builder.gep(a, [builder.add(_offset(builder, a_row, r), builder.mul(a_k, k))]))
            return _splat(builder, builder.fpext(a_rk, f64), v64)

        # accumulate_tiles.rz_mask(neab): −2^(29 + max(0, −neab)) clears the bits below the kept significand
        cleared = builder.select(builder.icmp_signed("<", neab, ir.Constant(_I64, 0)),
                                 builder.sub(ir.Constant(_I64, 29), neab), ir.Constant(_I64, 29))
        rz_mask = _splat(builder, builder.neg(builder.shl(ir.Constant(_I64, 1), cleared)), vi)
        with cgutils.for_range(builder, n_groups) as group:
            k0 = builder.add(k_start, builder.mul(group.index, F))
            left = builder.sub(k_end, k0)
            n = builder.select(builder.icmp_signed("<", left, F), left, F)
            for r in range(TC_ROWS):
                builder.store(builder.call(fabs, [builder.load(accs[r])]), tops[r])
                builder.store(_const(0.0, v64), totals[r])  # +0: an all-zero group sums to +0
            with cgutils.for_range(builder, n) as term:  # e_max: the largest 2^(e_a + e_b) per lane
                k = builder.add(k0, term.index)
                b_k_lead = lead(b_vector(k))
                for r in range(TC_ROWS):
                    product = builder.fmul(lead(a_splat(r, k)), b_k_lead)
                    builder.store(builder.call(vmax, [builder.load(tops[r]), builder.call(fabs, [product])]), tops[r])
            for r in range(TC_ROWS):  # 2^-q, q = e_max − 23 − neab (e_max clamped at −900 for zeros)
                exponent = builder.and_(builder.lshr(builder.bitcast(builder.load(tops[r]), vi), _const(52, vi)),
                                        _const(2047, vi))
                exponent = builder.sub(exponent, _const(1023, vi))
                exponent = builder.select(builder.icmp_signed(">", exponent, _const(-900, vi)), exponent,
                                          _const(-900, vi))
                q = builder.sub(builder.sub(exponent, _const(23, vi)), _splat(builder, neab, vi))
                builder.store(builder.bitcast(builder.shl(builder.sub(_const(1023, vi), q), _const(52, vi)), v64),
                              scales[r])
            with cgutils.for_range(builder, n) as term:  # the truncated, scaled terms, summed exactly
                k = builder.add(k0, term.index)
                b_k_vector = b_vector(k)
                for r in range(TC_ROWS):
                    scaled = builder.fmul(builder.fmul(a_splat(r, k), b_k_vector), builder.load(scales[r]))
                    builder.store(builder.fadd(builder.load(totals[r]), builder.call(vtrunc, [scaled])), totals[r])
            for r in range(TC_ROWS):  # scale back, round toward zero to fp32, clamp
                scale = builder.load(scales[r])
                inv_scale = builder.bitcast(builder.sub(_const(2046 << 52, vi), builder.bitcast(scale, vi)), v64)
                acc = builder.load(accs[r])
                x = builder.fmul(builder.fadd(builder.load(totals[r]), builder.call(vtrunc,
                                                                                    [builder.fmul(acc, scale)])),
                                 inv_scale)
                t = builder.bitcast(builder.and_(builder.bitcast(x, vi), rz_mask), v64)
                magnitude = builder.call(fabs, [t])
                overflow = builder.fcmp_ordered(">", magnitude, _const(_FP32_MAX, v64))
                subnormal = builder.and_(builder.fcmp_ordered("<", magnitude, _const(2.0**-126, v64)),
                                         builder.fcmp_ordered(">", magnitude, _const(0.0, v64)))
                saturated = builder.call(copysign, [_const(_FP32_MAX, v64), t])
                on_grid = builder.fmul(builder.call(vtrunc, [builder.fmul(x, _const(2.0**149, v64))]),
                                       _const(2.0**-149, v64))
                builder.store(builder.select(overflow, saturated, builder.select(subnormal, on_grid, t)), accs[r])
        for home, acc in zip(homes, accs):
            builder.store(builder.fptrunc(builder.load(acc), v32), home, align=4)
        return context.get_dummy_value()

    return sig, codegen
