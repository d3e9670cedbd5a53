"""stable_attention: a drop-in attention with the paper's fix (Algorithm 3), trainable at training speed.

The stabilized softmax shifts a row by β·m (m > 0) or 0 (m < 0) instead of m whenever the
block's maximum is attained more than once (within ε), so no P̄ entry is exactly 1 and the biased
bf16 rounding of P̄V (paper §3.3.2) cannot build up. Mathematically it is the same attention.
The extra shift (β − 1)·m (or −m) is capped so that the largest P̄ stays a normal number of the
input dtype: a large repeated maximum cannot make O collapse (the paper's kernel does past
m ≈ 23, where its 10⁻¹⁰ floor on the row sum takes over).

- CUDA tensors: the FlashAttention-2 Triton kernels of replay/triton/fast_attention.py (autotuned;
  its header comment is the numerics contract; tests run them under TRITON_INTERPRET=1).
- CPU tensors: replay/stable_reference.py, the same contract in torch (slow: tests, small models).
The forward returns O in the input dtype; the backward (FA2, δ = rowsum(dO ∘ O)) returns dq, dk,
dv in the input dtypes. Inputs are (B, H, T, D), as for F.scaled_dot_product_attention.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.optional import require

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_BACKENDS = ("auto", "triton", "torch")


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    use = backend == "triton" or (backend == "auto" and q.is_cuda)
    if use:
        require("triton", "stable_attention's Triton kernels (CUDA tensors or backend='triton')")
    return use


class _StableAttention(torch.autograd.Function):
    """Autograd wrapper: forward saves (q, k, v, o, LSE₂); backward runs the FA2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, beta: float, eps: float, stable: bool, triton: bool):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if triton:
            from fa_forensics.replay.triton import fast_attention as impl
        else:
            from fa_forensics.replay import stable_reference as impl
        o, lse2 = impl.forward(q, k, v, causal=causal, scale=scale, stable=stable, beta=beta, eps=eps)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.causal, ctx.scale, ctx.triton = causal, scale, triton
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse2 = ctx.saved_tensors
        if ctx.triton:
            from fa_forensics.replay.triton import fast_attention as impl
        else:
            from fa_forensics.replay import stable_reference as impl
        dq, dk, dv = impl.backward(q, k, v, o, lse2, do.to(q.dtype).contiguous(), causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None


def _checked(q, k, v, beta: float, eps: float, backend: str) -> None:
    if backend not in _BACKENDS:
        raise ConfigError(f"stable_attention: backend={backend!r}; use one of {', '.join(_BACKENDS)}")
    if q.ndim != 4 or k.shape != v.shape or q.shape != k.shape:
        raise ConfigError(f"stable_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                          "(B, H, T, D), all three the same shape")
    if not (q.dtype == k.dtype == v.dtype):
        raise ConfigError(f"stable_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
                          "cast them to one dtype")
    if q.dtype not in _DTYPES:
        raise ConfigError(f"stable_attention: q has dtype {q.dtype}; use float32, bfloat16 or float16")
    if not beta > 1:
        raise ConfigError(f"stable_attention: beta={beta!r} must be > 1 (the paper uses 2 to 8)")
    if not eps >= 0:
        raise ConfigError(f"stable_attention: eps={eps!r} must be >= 0")


def stable_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, beta: float = 2.0,
                     eps: float = 1e-3, scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """softmax(α·QKᵀ)V with the stabilized softmax of Algorithm 3; (B, H, T, D) → (B, H, T, D).

    A drop-in for F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).
    beta > 1 (the paper uses 2..8), eps ≥ 0: scores within eps of the block max count as ties.
    backend: "auto" (Triton kernels for CUDA tensors, the torch reference for CPU tensors),
    "triton" (also for CPU tensors, under TRITON_INTERPRET=1) or "torch".
    """
    _checked(q, k, v, beta, eps, backend)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _StableAttention.apply(q, k, v, causal, scale, float(beta), float(eps), True, _use_triton(q, backend))


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """The same kernels without the fix (standard softmax): what the fix's cost is measured against."""
    _checked(q, k, v, 2.0, 0.0, backend)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _StableAttention.apply(q, k, v, causal, scale, 2.0, 0.0, False, _use_triton(q, backend))
