"""FlashAttention-2 backward pass with explicit rounding.

Inputs q, k, v, dO (B, H, T, D) are fp32 tensors holding values of config.input_dtype; lse is
the forward's. The backward is computed untiled: every accumulation below walks its reduction
dimension in order 0..K-1, which is what FA2's block loop does with a chained fp32 accumulator
(for the tensor-core model: as long as block sizes are multiples of the group size F).

 1. s = fp32(α · q kᵀ) (mm, causal mask -inf); P = exp(fp32(s - lse))  fp32, 0 where masked
 2. dP = dO Vᵀ (mm, in_format = input_dtype)
 3. δ per config.delta, a row-wise dot product on CUDA cores (ieee model, order 0..D-1 / 0..T-1):
      o-lowp:        rowsum(dO ∘ O_lp), O_lp the forward's O in o_dtype
      o-highp:       rowsum(dO ∘ O_hp), O_hp from the same forward with p/pv/o casts in fp32
      o-recomputed:  rowsum(dO ∘ O_rec), O_rec = P V in fp32 (P already holds 1/ℓ)
      dp-p:          rowsum(dP ∘ P)
 4. dS = cast(fp32(P · fp32(dP - δ)), ds_dtype)  (nearest-even)
 5. dQ = fp32(α · mm(dS, K)); dK = fp32(α · mm(dSᵀ, Q))
 6. dV = mm(P̄ᵀ, dO) with P̄ = cast(fp32(P · S), p_dtype) (nearest-even, as FA2's p.to(dtype));
    divided by the P scale S when S ≠ 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fa_forensics.numerics import exp_fp32
from fa_forensics.replay.config import Accumulation, DeltaSource, Precision, ReplayConfig
from fa_forensics.replay.emulate.forward import scaled_scores
from fa_forensics.replay.emulate.ops import cast, mm, wider


@dataclass(frozen=True)
class Backward:
    """Gradients and δ of one backward pass, all fp32."""

    delta: torch.Tensor  # (B, H, T)
    dq: torch.Tensor  # (B, H, T, D)
    dk: torch.Tensor  # (B, H, T, D)
    dv: torch.Tensor  # (B, H, T, D)


def row_dot(a: torch.Tensor, b: torch.Tensor, config: ReplayConfig) -> torch.Tensor:
    """Σ_n a[..., n] b[..., n] per row in fp32 (ieee, order 0..N-1); (B, H, T, N) x2 -> (B, H, T)."""
    out = mm(a.unsqueeze(-2), b.unsqueeze(-1), Accumulation.IEEE, config.gpu, Precision.FP32)  # (B, H, T, 1, 1)
    return out[..., 0, 0]


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             config: ReplayConfig, *, causal: bool, scale: float, o_for_delta: torch.Tensor | None) -> Backward:
    """The FA2 backward of the module docstring.

    o_for_delta (B, H, T, D) fp32: the O that δ uses for o-lowp / o-highp (None for the others).
    """
    acc_model, gpu, x_fmt = config.accumulation, config.gpu, config.input_dtype
    alpha = torch.tensor(scale, dtype=torch.float32)
    s = scaled_scores(q, k, config, scale, causal, 0, 0)  # (B, H, T, T)
    P = exp_fp32(s - lse.unsqueeze(-1))  # (B, H, T, T) fp32, normalized
    dP = mm(do, v.transpose(-1, -2), acc_model, gpu, x_fmt)  # (B, H, T, T)

    if config.delta is DeltaSource.DP_P:
        delta = row_dot(dP, P, config)
    elif config.delta is DeltaSource.O_RECOMPUTED:
        o_rec = mm(P, v, acc_model, gpu, Precision.FP32)  # (B, H, T, D) fp32
        delta = row_dot(do, o_rec, config)
    else:
        if o_for_delta is None:
            raise ValueError("o_for_delta is required for delta sources o-lowp and o-highp")
        delta = row_dot(do, o_for_delta, config)

    dS = cast(P * (dP - delta.unsqueeze(-1)), config.ds_dtype)  # (B, H, T, T)
    qk_fmt = wider(config.ds_dtype, x_fmt)
    dq = mm(dS, k, acc_model, gpu, qk_fmt) * alpha
    dk = mm(dS.transpose(-1, -2), q, acc_model, gpu, qk_fmt) * alpha

    S_t = torch.tensor(float(config.p_scale), dtype=torch.float32)
    p_bar = cast(P * S_t if config.p_scale != 1.0 else P, config.p_dtype)
    dv = mm(p_bar.transpose(-1, -2), do, acc_model, gpu, wider(config.p_dtype, x_fmt))
    if config.p_scale != 1.0:
        dv = dv / S_t
    return Backward(delta=delta, dq=dq, dk=dk, dv=dv)
