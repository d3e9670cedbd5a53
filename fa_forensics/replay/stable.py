"""stable_attention: a drop-in causal attention with the paper's fix (Algorithm 3), trainable.

The stabilized softmax shifts a row by β·m (m > 0) or 0 (m < 0) instead of m whenever the
block's maximum is attained more than once (within ε), so no P̄ entry is exactly 1 and the biased
bf16 rounding of P̄V (paper §3.3.2) cannot build up. Mathematically it is the same attention.

- CUDA tensors: the Triton kernels (fp32 accumulator, P̄ and O in the input dtype, tiles 64×64,
  FMA contraction on, ℓ summed in fp32: the fast path).
- CPU tensors: the emulator with the same numerics (ReplayConfig preset "stabilized" with
  pv_dtype fp32 and P̄ / O in the input dtype); slow, meant for tests and small models.
The forward returns O in the input dtype; the backward (FA2, δ = rowsum(dO ∘ O)) returns dq, dk,
dv in the input dtypes. Inputs are (B, H, T, D), as for F.scaled_dot_product_attention.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import Precision, ReplayConfig, Softmax

_PRECISION = {torch.float32: Precision.FP32, torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}


def stable_config(dtype: torch.dtype, *, causal: bool, beta: float, eps: float, scale: float,
                  block: Optional[int] = 64) -> ReplayConfig:
    """The ReplayConfig stable_attention runs: stabilized softmax, fp32 accumulator, casts in dtype."""
    if dtype not in _PRECISION:
        raise ConfigError(f"stable_attention: q has dtype {dtype}; use float32, bfloat16 or float16")
    x = _PRECISION[dtype]
    return ReplayConfig(input_dtype=x, p_dtype=x, pv_dtype=Precision.FP32, o_dtype=x, softmax=Softmax.STABILIZED,
                        beta=beta, eps=eps, causal=causal, scale=scale, block_m=block, block_n=block)


class _StableAttention(torch.autograd.Function):
    """Autograd wrapper: forward saves (q, k, v, o, lse); backward runs the FA2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, config: ReplayConfig):
        if q.is_cuda:
            from fa_forensics.replay.triton import launch

            B, H, T, D = q.shape
            plan = launch.plan_for(config, T, D, exact_l=False, fp_fusion=True)
            qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
            o, lse, _ = launch.forward(qc, kc, vc, config, plan, causal=config.causal, scale=config.scale)
            ctx.save_for_backward(qc, kc, vc, o, lse)
            ctx.plan = plan
        else:
            from fa_forensics.replay.api import replay

            out = replay(q, k, v, config, backend="emulate")
            o = out.o.to(q.dtype)
            ctx.save_for_backward(q, k, v, o, out.lse)
        ctx.config = config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        config = ctx.config
        if q.is_cuda:
            from fa_forensics.replay.triton import launch

            doc = do.to(q.dtype).contiguous()
            delta = launch.delta(q, k, v, doc, o, lse, "o", ctx.plan, causal=config.causal, scale=config.scale)
            dq, dk, dv = launch.backward(q, k, v, doc, lse, delta, config, ctx.plan, causal=config.causal, scale=config.scale)
        else:
            from fa_forensics.replay.api import replay

            out = replay(q, k, v, config, do, backend="emulate")  # recomputes the forward, then FA2 backward
            dq, dk, dv = out.dq, out.dk, out.dv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def stable_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, beta: float = 2.0,
                     eps: float = 1e-3, scale: Optional[float] = None) -> torch.Tensor:
    """softmax(α·QKᵀ)V with the stabilized softmax of Algorithm 3; (B, H, T, D) → (B, H, T, D).

    A drop-in for F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).
    beta > 1 (the paper uses 2..8), eps ≥ 0: scores within eps of the block max count as ties.
    """
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ConfigError(f"stable_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be (B, H, T, D) with equal k, v")
    if not (q.dtype == k.dtype == v.dtype):
        raise ConfigError(f"stable_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    config = stable_config(q.dtype, causal=causal, beta=beta, eps=eps, scale=scale)
    return _StableAttention.apply(q, k, v, config)
