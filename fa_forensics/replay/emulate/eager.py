"""The products and the softmax of attention written as plain tensor ops, as re-executed or as modelled.

`product(op, a, b_t, out)` is A·B_tᵀ as the recorded op (matmul, bmm, einsum, baddbmm) forms it: with
`exact` False by torch's own CPU kernel on operands in the recorded dtype (re-execution), with `exact` True as
the emulator models a GEMM with an fp32 accumulator: the sum of the exact products rounded once to fp32, then
to the output dtype (bf16 inputs multiply exactly in fp32, and an fp32 GEMM's per-element error is below its
rounding of the sum in the common case). What the model leaves out is the BLAS's blocking of the sum: MKL and
oneDNN split K into blocks and sum each in a vector register, so a few elements per thousand differ in their
last bit from the once-rounded sum (docs/replay.md has the measured shares). `softmax(s, dtype)` is the exact
softmax rounded once to `dtype`; torch's CPU softmax (exp in vector code, sum in fp32) differs in the last bit
of some elements.
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
        r = a.double() @ b_t.double().transpose(-1, -2)
        if alpha != 1.0:
            r = r * alpha
        if base is not None:
            r = r + base.double()
        return r.float().to(out)
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


def softmax(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The softmax over the last dim computed in fp64 and rounded once to `dtype` (a row blocked whole gives 0)."""
    p = torch.softmax(s.double(), dim=-1)
    return torch.nan_to_num(p, nan=0.0).float().to(dtype)
