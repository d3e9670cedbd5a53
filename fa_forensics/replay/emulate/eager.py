"""The products and the softmax of attention written as plain tensor ops, as re-executed or as modelled.

`product(op, a, b_t, out)` is A·B_tᵀ as the recorded op (matmul, bmm, einsum, baddbmm) forms it: with
`exact` False by torch's own CPU kernel on operands in the recorded dtype (re-execution); with `exact` True as
the emulator models a CPU GEMM: one fp32 accumulator per output element, the products added in the order of
the contracted index with a fused multiply-add each (what MKL's small-matrix kernels do), then rounded to the
output dtype. What the model leaves out is the blocking of larger GEMMs (K split into blocks summed apart) and
oneDNN's bf16 kernels' own order. `softmax(s, dtype)` models torch's vectorized CPU softmax: the row max, exp of
the shifted scores, their sum in 8 vector lanes reduced as a tree, and the product with the sum's reciprocal;
torch's own exp (a polynomial approximation in vector code) differs from a correctly rounded exp in the last
bit of some elements, which the model does not follow. docs/replay.md has the measured shares.
"""
from __future__ import annotations

from typing import Optional

import torch


def _bh(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[-2:])


def product(op: str, a: torch.Tensor, b_t: torch.Tensor, out: torch.dtype, exact: bool, *, alpha: float = 1.0,
            base: Optional[torch.Tensor] = None, values: bool = False) -> torch.Tensor:
    """a (B, H, T, D) · b_t (B, H, S, D)ᵀ -> (B, H, T, S) in `out`; baddbmm: base·1 + alpha·(a·b_tᵀ).
    `values`: the product P·V (b_t is Vᵀ)."""
    B, H, T = a.shape[:3]
    S = b_t.shape[-2]
    if exact:
        r = fma_sum(a, b_t.transpose(-1, -2))
        if alpha != 1.0:
            r = r * alpha
        if base is not None:
            r = r + base.float()
        return r.to(out)
    if op == "einsum":
        r = torch.einsum("...td,...sd->...ts", a, b_t)
    elif op == "bmm":
        r = torch.bmm(_bh(a), _bh(b_t).transpose(1, 2)).view(B, H, T, S)
    elif op == "baddbmm":
        inp = torch.zeros((), dtype=a.dtype) if base is None else base.to(a.dtype)
        inp = _bh(inp.expand(B, H, T, S))
        r = torch.baddbmm(inp, _bh(a), _bh(b_t).transpose(1, 2), beta=0.0 if base is None else 1.0,
                          alpha=alpha).view(B, H, T, S)
    else:
        r = torch.matmul(a, b_t.transpose(-1, -2))
    return r.to(out)


def fma_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (…, T, K) · b (…, K, S) in fp32, each output's products added in K order by fused multiply-adds (the
    product is exact in fp64, and the sum rounded once per step to fp32)."""
    a64, b64 = a.double(), b.double()
    acc = torch.zeros(torch.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1])),
                      dtype=torch.float64)
    for i in range(a.shape[-1]):
        acc = (acc + a64[..., i:i + 1] * b64[..., i:i + 1, :]).float().double()
    return acc.float()


LANES = 8  # fp32 lanes of an AVX2 vector, torch's CPU reductions' width


def lane_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim as a vectorized reduction forms it: LANES partial sums over the chunks, in order
    (zeros pad the last chunk), then the lanes added as a tree (halves, quarters, …)."""
    n = x.shape[-1]
    chunks = torch.nn.functional.pad(x, (0, (-n) % LANES)).reshape(*x.shape[:-1], -1, LANES)
    acc = chunks[..., 0, :]
    for i in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc


def softmax(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The softmax over the last dim in fp32 as torch's CPU kernel forms it (module docstring), returned in
    `dtype` (a row blocked whole gives 0)."""
    x = s.float()
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    total = lane_sum(e)
    p = e * (1.0 / total)
    return torch.nan_to_num(p, nan=0.0).to(dtype)
