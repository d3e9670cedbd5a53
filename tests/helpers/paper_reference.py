"""The paper's reference FlashAttention-2 (pure PyTorch, run under CUDA BF16 autocast), transcribed
with every cast explicit: the oracle the `bf16-autocast*` recipes are tested against.

Written from the structure of the public reference code (ucker/why-low-precision-training-fails,
attention.py: a query-block loop around a key-block loop that visits EVERY key block, masks with
-finfo(bf16).max, the STABLE=1 shift rule, block row sums clamped at 1e-10, bf16 buffers for O, m,
ℓ and for dQ, dK, dV) and PyTorch's CUDA autocast op lists: `einsum` returns bf16 (fp32
accumulation), `exp`, `log` and `sum` run in fp32; every other op keeps its operands' dtype, and a
bf16 op computes in fp32 and rounds once. Here every bf16 value is held as an fp32 tensor and
every rounding is written as `_bf(x)`. Two things CUDA leaves unspecified are fixed the way the
emulator fixes them: the accumulation order of a matmul (numerics.matmul, ieee: in index order)
and of `sum` (ℓ: exactly, then one rounding; δ's sum over D: in index order).

Autocast is assumed active in the backward too (the reference's einsum of an fp32 P with a bf16
dO only runs under it).
"""
from __future__ import annotations

import math

import torch

from fa_forensics.numerics import exp_fp32, matmul

BF16 = torch.bfloat16
NEG_MAX = -torch.finfo(BF16).max  # the reference code's mask value and initial row max
ROW_SUM_FLOOR = torch.tensor(1e-10, dtype=torch.float32)


def _bf(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to bf16 (nearest-even), kept as fp32."""
    return x.to(BF16).float()


def _einsum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An autocast einsum a @ b: operands rounded to bf16, fp32 accumulation, bf16 result."""
    return _bf(matmul(_bf(a), _bf(b), "ieee"))


def _exp(x: torch.Tensor) -> torch.Tensor:
    """The fp32 exp autocast runs: exp rounded once to fp32 (the emulator's, host-independent)."""
    return exp_fp32(x)


def _causal_hidden(i0: int, rows: int, j0: int, cols: int) -> torch.Tensor:
    """(rows, cols) True where key j0 + c lies after query i0 + r."""
    return (torch.arange(j0, j0 + cols)[None, :] > torch.arange(i0, i0 + rows)[:, None])


def paper_forward(q, k, v, *, block: int = 512, stable: bool = False):
    """Causal forward; q, k, v (B, H, T, D) bf16 -> (O bf16, lse fp32 (B, H, T))."""
    q, k, v = q.float(), k.float(), v.float()
    B, H, T, D = q.shape
    scale = torch.tensor(D ** -0.5, dtype=torch.float32)  # a Python float, used as fp32 by bf16 ops
    o = torch.zeros(B, H, T, D)
    lse = torch.zeros(B, H, T)
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        oc = torch.zeros(B, H, i1 - i0, D)  # bf16 buffer
        row_max = torch.full((B, H, i1 - i0), NEG_MAX)  # bf16 buffer
        row_sum = torch.zeros(B, H, i1 - i0)  # bf16 buffer
        for j0 in range(0, T, block):  # every key block, also those the mask hides entirely
            j1 = min(j0 + block, T)
            s = _bf(_einsum(q[..., i0:i1, :], k[..., j0:j1, :].transpose(-1, -2)) * scale)  # bf16
            if i0 < j0 + block - 1:
                s = s.masked_fill(_causal_hidden(i0, i1 - i0, j0, j1 - j0), NEG_MAX)
            block_max = s.amax(dim=-1)  # bf16
            if stable:
                threshold = _bf(block_max - torch.tensor(1e-3, dtype=torch.float32))  # bf16 − Python float
                repeated = (s >= threshold.unsqueeze(-1)).sum(dim=-1) > 1
                block_max = torch.where(repeated & (block_max > 0), _bf(2.0 * block_max), block_max)
                block_max = torch.where(repeated & (block_max < 0), torch.zeros_like(block_max), block_max)
            new_max = torch.maximum(block_max, row_max)  # bf16
            p = _exp(_bf(s - new_max.unsqueeze(-1)))  # bf16 difference, exp in fp32
            block_sum = torch.maximum(p.double().sum(dim=-1).float(), ROW_SUM_FLOOR)  # fp32 sum, clamped
            pv = _einsum(p, v[..., j0:j1, :])  # P rounded to bf16 by autocast; bf16 result
            factor = _exp(_bf(row_max - new_max))  # fp32
            new_sum = factor * row_sum + block_sum  # fp32 (bf16 promoted)
            oc = _bf(_bf(oc * factor.unsqueeze(-1)) + pv)  # oc.mul_(factor).add_(pv) on a bf16 buffer
            row_max = new_max
            row_sum = _bf(new_sum)
        o[..., i0:i1, :] = _bf(oc / row_sum.unsqueeze(-1))
        lse[..., i0:i1] = torch.log(row_sum) + row_max  # fp32 log + bf16 -> fp32
    return o.to(BF16), lse


def _row_sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim in fp32, in index order."""
    acc = torch.zeros(x.shape[:-1])
    for d in range(x.shape[-1]):
        acc = acc + x[..., d]
    return acc


def paper_backward(q, k, v, o, do, lse, *, block: int = 512):
    """Causal backward; q, k, v, o, do (B, H, T, D) bf16, lse fp32 -> dq, dk, dv bf16."""
    q, k, v, o, do = (x.float() for x in (q, k, v, o, do))
    B, H, T, D = q.shape
    scale = torch.tensor(D ** -0.5, dtype=torch.float32)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)  # bf16 buffers
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        qc, oc, doc = q[..., i0:i1, :], o[..., i0:i1, :], do[..., i0:i1, :]
        for j0 in range(0, T, block):
            j1 = min(j0 + block, T)
            kc, vc = k[..., j0:j1, :], v[..., j0:j1, :]
            s = _bf(_einsum(qc, kc.transpose(-1, -2)) * scale)
            if i0 < j0 + block - 1:
                s = s.masked_fill(_causal_hidden(i0, i1 - i0, j0, j1 - j0), float("-inf"))
            p = _exp(s - lse[..., i0:i1].unsqueeze(-1))  # bf16 − fp32 -> fp32
            dv_chunk = _einsum(p.transpose(-1, -2), doc)
            dp = _einsum(doc, vc.transpose(-1, -2))  # bf16
            delta = _row_sum_in_order(_bf(doc * oc))  # bf16 product, fp32 sum
            ds = (p * scale) * (dp - delta.unsqueeze(-1))  # fp32
            dq[..., i0:i1, :] = _bf(dq[..., i0:i1, :] + _einsum(ds, kc))
            dk[..., j0:j1, :] = _bf(dk[..., j0:j1, :] + _einsum(ds.transpose(-1, -2), qc))
            dv[..., j0:j1, :] = _bf(dv[..., j0:j1, :] + dv_chunk)
    return dq.to(BF16), dk.to(BF16), dv.to(BF16)


def negative_max_inputs(T: int, D: int, seed: int, H: int = 2):
    """bf16 q, k, v, dO (1, H, T, D): pairs of identical keys (repeated maxima) and a third of the
    queries pointing away from every key (rows whose maximum score is negative)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, H, T, D, generator=g)
    k[..., 0] = 3.0 + 0.5 * torch.rand(1, H, T, generator=g)  # every key has a large positive first coordinate
    k[..., 1::2, :] = k[..., 0::2, :]  # pairs of identical keys
    q = 2 * torch.randn(1, H, T, D, generator=g)
    q[..., 0::3, 0] = -4.0  # these queries score negatively against every key
    q[..., 0::3, 1:] *= 0.1
    q[..., 1::3, :] = 2 * k[..., 1::3, :]  # these hit their own pair: an exact repeated maximum
    v = torch.randn(1, H, T, D, generator=g)
    do = torch.randn(1, H, T, D, generator=g)
    return tuple(x.to(BF16) for x in (q, k, v, do))


def scale_of(D: int) -> float:
    return 1.0 / math.sqrt(D)
