"""ReplayConfig → kernel constexprs, block sizes and launches (imports triton; import lazily).

`KernelPlan` is everything a launch needs besides the tensors: it is derived once from a config
and the shapes, so the forward, δ and backward launches agree on every dtype and block size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from fa_forensics.enums import KVOrder, Precision
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.ops import promote
from fa_forensics.replay.triton import kernels

TL_DTYPES = {
    Precision.FP32: tl.float32,
    Precision.BF16: tl.bfloat16,
    Precision.FP16: tl.float16,
    Precision.FP8_E4M3: tl.float8e4nv,
    Precision.FP8_E5M2: tl.float8e5,
}
TORCH_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
    Precision.FP8_E4M3: torch.float8_e4m3fn,
    Precision.FP8_E5M2: torch.float8_e5m2,
}
_FP8 = {Precision.FP8_E4M3, Precision.FP8_E5M2}


def dot_dtype(a: Precision, b: Precision) -> Precision:
    """A dtype that holds values of both a and b exactly, for one tl.dot of a by b.

    Equal formats stay (tensor cores take them directly); fp8 fits in bf16 and fp16 (3 or 2
    mantissa bits, exponents in range); anything else (bf16 × fp16, anything × fp32) goes to fp32.
    """
    if a == b:
        return a
    if a in _FP8 and b in (Precision.BF16, Precision.FP16):
        return b
    if b in _FP8 and a in (Precision.BF16, Precision.FP16):
        return a
    return Precision.FP32


def autocast_constexprs(config: ReplayConfig) -> dict:
    """The forward's cast points of the autocast reference as constexpr dtypes (fp32 = no rounding):
    S_DTYPE (scores), STATS_DTYPE (m, ℓ), SUB_DTYPE (s − m: PyTorch's promotion of the two),
    RESCALE_DTYPE (the accumulator after × exp(m_old − m))."""
    return dict(S_DTYPE=TL_DTYPES[config.s_dtype], STATS_DTYPE=TL_DTYPES[config.stats_dtype],
                SUB_DTYPE=TL_DTYPES[promote(config.s_dtype, config.stats_dtype)],
                RESCALE_DTYPE=TL_DTYPES[config.rescale_dtype])


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclass(frozen=True)
class KernelPlan:
    """Block sizes and constexpr dtypes of one replay (shared by all four kernels)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    fp_fusion: bool  # False for replay: every rounding of the emulator stays a separate rounding
    l_sum_dtype: object  # tl.float64 (exact ℓ, as the emulator) or tl.float32 (speed)


def plan_for(config: ReplayConfig, T: int, D: int, *, exact_l: bool = True, fp_fusion: bool = False) -> KernelPlan:
    """Block sizes for a config: block_n None = the whole (padded) sequence in one block.

    Rows are independent, so block_m only sets the work per program (None → 16). The tile is a
    power of two ≥ 16 (tl.dot's minimum); padded keys are masked to −inf and add exact zeros.
    """
    block_n = _pow2(config.block_n) if config.block_n else _pow2(T)
    if config.block_n and block_n != config.block_n:
        from fa_forensics.errors import ConfigError

        raise ConfigError(f"backend triton: block_n={config.block_n} must be a power of two; use 16, 32, 64, 128 or "
                          "None")
    block_m = _pow2(config.block_m) if config.block_m else 16
    block_m, block_n = max(16, min(block_m, 128)), max(16, block_n)
    return KernelPlan(block_m=block_m, block_n=block_n, block_d=max(16, _pow2(D)),
                      num_warps=4 if block_m * block_n <= 64 * 64 else 8, fp_fusion=fp_fusion,
                      l_sum_dtype=tl.float64 if exact_l else tl.float32)


def forward(q, k, v, config: ReplayConfig, plan: KernelPlan, *, causal: bool, scale: float):
    """Launch attn_fwd; returns O (B, H, T, D) in o_dtype, lse (B, H, T) fp32, stats (B, H, T, 4) int32."""
    B, H, T, D = q.shape
    o = torch.empty((B, H, T, D), dtype=TORCH_DTYPES[config.o_dtype], device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    stats = torch.zeros((B, H, T, 4), dtype=torch.int32, device=q.device)
    p_scaled = config.p_scale != 1.0
    grid = (triton.cdiv(T, plan.block_m), B * H)
    kernels.attn_fwd[grid](
        q, k, v, o, lse, stats,
        T, H, float(scale), float(config.beta), float(config.eps), float(config.offset),
        float(config.p_scale), math.log2(config.p_scale),
        D=D, BLOCK_D=plan.block_d, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        CAUSAL=causal, REVERSE=config.kv_order is KVOrder.REVERSE, SOFTMAX=config.softmax.value,
        P_DTYPE=TL_DTYPES[config.p_dtype], DOT_PV_DTYPE=TL_DTYPES[dot_dtype(config.p_dtype, config.input_dtype)],
        PV_FP32=config.pv_dtype is Precision.FP32, PV_DTYPE=TL_DTYPES[config.pv_dtype],
        O_DTYPE=TL_DTYPES[config.o_dtype], P_SCALED=p_scaled, P_SCALE_MODE=config.p_scale_mode.value,
        L_SUM_DTYPE=plan.l_sum_dtype, **autocast_constexprs(config),
        num_warps=plan.num_warps, enable_fp_fusion=plan.fp_fusion,
    )
    return o, lse, stats


def delta(q, k, v, do, o: Optional[torch.Tensor], lse, source: str, plan: KernelPlan, *, causal: bool, scale: float,
          s_dtype: Precision = Precision.FP32):
    """Launch attn_delta; source "o" (δ from the given O), "dp-p" or "o-recomputed" (these two
    recompute s with the forward's s_dtype casts). Returns (B, H, T) fp32."""
    B, H, T, D = q.shape
    out = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    block_m = min(plan.block_m, 64)  # the diagonal trick costs BLOCK_M² per column
    grid = (triton.cdiv(T, block_m), B * H)
    kernels.attn_delta[grid](
        o if o is not None else q, do, q, k, v, lse, out, T, float(scale),
        D=D, BLOCK_D=plan.block_d, BLOCK_M=block_m, BLOCK_N=plan.block_n, CAUSAL=causal, DELTA_SOURCE=source,
        S_DTYPE=TL_DTYPES[s_dtype], num_warps=4, enable_fp_fusion=plan.fp_fusion,
    )
    return out


def backward(q, k, v, do, lse, delta_rows, config: ReplayConfig, plan: KernelPlan, *, causal: bool, scale: float):
    """Launch attn_bwd_dkdv and attn_bwd_dq; returns dq, dk, dv (B, H, T, D) fp32."""
    B, H, T, D = q.shape
    dq = torch.empty((B, H, T, D), dtype=torch.float32, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    # Backward tiles: the dK/dV kernel walks query blocks, the dQ kernel walks KV blocks. The
    # accumulation order (over whole rows / columns, in index order) does not depend on them.
    bm, bn = min(plan.block_m, 64), min(plan.block_n, 64)
    ds_dot = TL_DTYPES[dot_dtype(config.ds_dtype, config.input_dtype)]
    common = dict(D=D, BLOCK_D=plan.block_d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, S_DTYPE=TL_DTYPES[config.s_dtype])
    kernels.attn_bwd_dkdv[(triton.cdiv(T, bn), B * H)](
        q, k, v, do, lse, delta_rows, dk, dv, T, float(scale), float(config.p_scale),
        P_DTYPE=TL_DTYPES[config.p_dtype], DOT_DV_DTYPE=TL_DTYPES[dot_dtype(config.p_dtype, config.input_dtype)],
        P_SCALED=config.p_scale != 1.0, DS_DTYPE=TL_DTYPES[config.ds_dtype], DOT_DS_DTYPE=ds_dot,
        num_warps=plan.num_warps, enable_fp_fusion=plan.fp_fusion, **common,
    )
    kernels.attn_bwd_dq[(triton.cdiv(T, bm), B * H)](
        q, k, v, do, lse, delta_rows, dq, T, float(scale),
        DS_DTYPE=TL_DTYPES[config.ds_dtype], DOT_DS_DTYPE=ds_dot,
        num_warps=plan.num_warps, enable_fp_fusion=plan.fp_fusion, **common,
    )
    return dq, dk, dv
