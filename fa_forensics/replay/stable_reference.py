"""The numerics contract of the training-speed kernels (replay/triton/fast_attention.py) in torch.

`stable_attention` runs this on CPU tensors, and the interpreter tests compare the Triton kernels
with it. The forward walks KV blocks of 64 keys exactly as the contract in fast_attention.py says
(log2-unit scores, the stabilized shift with its cap, fp32 ℓ and accumulator, P̄ in the input
dtype). Dots are torch's fp32 matmuls of the exact (upcast) inputs, so they round in a different
order than a GPU's tensor cores or the interpreter's sequential dot: agreement is to the last
bits of fp32, not bit for bit. The backward forms whole (T, T) score matrices per head: it is
meant for tests and small models (memory O(B·H·T²)).
"""
from __future__ import annotations

import math

import torch

from fa_forensics.numerics.elementary import LOG2E

STABLE_BLOCK_N = 64  # the KV block the stabilized rule looks at: part of the numerics contract


def max_extra_shift(dtype: torch.dtype) -> float:
    """The cap on the stabilized extra shift (natural units) for P̄ in dtype: ¾ of ln(1/tiny).

    bf16 / fp32: 65.5 (exp(−65.5) ≈ 3·10⁻²⁹, normal); fp16: 7.3 (exp(−7.3) ≈ 7·10⁻⁴, normal).
    """
    return 0.75 * -math.log(torch.finfo(dtype).tiny)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # a Python float passed to a kernel arrives as fp32


def _causal_mask(rows: int, cols: torch.Tensor, device) -> torch.Tensor:
    """(rows, len(cols)) True where key > query."""
    return cols[None, :] > torch.arange(rows, device=device)[:, None]


@torch.no_grad()
def forward(q, k, v, *, causal: bool, scale: float, stable: bool, beta: float = 2.0, eps: float = 1e-3,
            block_n: int = STABLE_BLOCK_N) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, H, T, D) in q's dtype and LSE₂ (B, H, T) fp32 in log2 units, as fast_attn_fwd computes them."""
    B, H, T, D = q.shape
    dtype = q.dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    qk_scale, eps_raw, beta_m1 = _f32(scale * LOG2E), _f32(eps / scale), _f32(beta - 1.0)
    max_extra2 = _f32(max_extra_shift(dtype) * LOG2E)
    m = torch.full((B, H, T), -torch.inf, device=q.device)
    ell = torch.zeros(B, H, T, device=q.device)
    acc = torch.zeros(B, H, T, D, device=q.device)
    for start in range(0, T, block_n):
        cols = torch.arange(start, min(start + block_n, T), device=q.device)
        qk = torch.matmul(qf, kf[:, :, start:start + len(cols)].transpose(-1, -2))  # (B, H, T, n) unscaled
        if causal:
            qk = qk.masked_fill(_causal_mask(T, cols, q.device), -torch.inf)
        r_raw = qk.amax(dim=-1)
        r = r_raw * qk_scale
        s = qk * qk_scale
        if stable:
            n_near = (qk >= (r_raw - eps_raw)[..., None]).sum(dim=-1)
            extra = torch.minimum(torch.where(r > 0, beta_m1 * r, -r), max_extra2)
            m_blk = torch.where((n_near > 1) & (r > -torch.inf), r + extra, r)
        else:
            m_blk = r
        m_new = torch.maximum(m, m_blk)
        m_sub = torch.where(m_new == -torch.inf, torch.zeros(()), m_new)
        a = torch.exp2(m - m_sub)
        p = torch.exp2(s - m_sub[..., None])
        ell = ell * a + p.sum(dim=-1)
        acc = acc * a[..., None] + torch.matmul(p.to(dtype).float(), vf[:, :, start:start + len(cols)])
        m = m_new
    ell_safe = torch.where(ell > 0, ell, torch.ones(()))
    return (acc / ell_safe[..., None]).to(dtype), m + torch.log2(ell_safe)


@torch.no_grad()
def backward(q, k, v, o, lse2, do, *, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv in q's dtype, as fast_attn_bwd computes them (δ = rowsum(dO ∘ O) in fp32)."""
    dtype = q.dtype
    T = q.shape[2]
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * _f32(scale * LOG2E)  # (B, H, T, T)
    p = torch.exp2(s - lse2[..., None])
    if causal:
        p = p.masked_fill(_causal_mask(T, torch.arange(T, device=q.device), q.device), 0.0)
    delta = (o.float() * dof).sum(dim=-1)
    dv = torch.matmul(p.to(dtype).float().transpose(-1, -2), dof)
    ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta[..., None])
    ds_x = ds.to(dtype).float()
    dq = torch.matmul(ds_x, kf) * _f32(scale)
    dk = torch.matmul(ds_x.transpose(-1, -2), qf) * _f32(scale)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
