"""Per-head spectral norm of W_Q (paper Fig. 3 and Fig. 11), exact at every monitored step.

Where the query weights live (the documented name patterns, relative to an attention module):
  nanoGPT            `<attn>.c_attn.weight`  (3C, C) nn.Linear; W_Q = rows [0, C)
  Hugging Face GPT-2 `<attn>.c_attn.weight`  (C, 3C) Conv1D (x @ W); W_Q = columns [0, C), transposed
  Hugging Face Llama `<attn>.q_proj.weight`  (C, C) nn.Linear
  generic            `<attn>.q_proj.weight`, `<attn>.query.weight`, `<attn>.wq.weight`
Head h of W_Q is the block of rows [h·D, (h+1)·D) of the (C_out, C_in) matrix; its σ_max is
computed exactly at every monitored step (see `head_spectral_norms`).
"""
from __future__ import annotations

from typing import Optional

import torch

_QUERY_ATTRS = ("q_proj", "query", "wq", "to_q")


def find_query_weights(attn_module: torch.nn.Module, n_heads: int) -> Optional[torch.Tensor]:
    """W_Q of one attention module as (H, D, C_in), or None when no known layout matches."""
    c_attn = getattr(attn_module, "c_attn", None)
    if c_attn is not None and hasattr(c_attn, "weight"):
        w = c_attn.weight.detach()
        if type(c_attn).__name__ == "Conv1D":  # HF GPT-2: (C, 3C), y = x @ W
            c_in = w.shape[0]
            w_q = w[:, :c_in].t()
        else:  # nanoGPT nn.Linear: (3C, C)
            c_in = w.shape[1]
            w_q = w[:c_in]
    else:
        w_q = None
        for name in _QUERY_ATTRS:
            lin = getattr(attn_module, name, None)
            if lin is not None and hasattr(lin, "weight"):
                w_q = lin.weight.detach()
                break
        if w_q is None:
            return None
    c_out = w_q.shape[0]
    if c_out % n_heads:
        return None
    return w_q.reshape(n_heads, c_out // n_heads, w_q.shape[1])  # (H, D, C_in)


def head_spectral_norms(w_heads: torch.Tensor) -> torch.Tensor:
    """σ_max of each head's block of W_Q, (H,) float64 on the weights' device, exact (no iteration).

    σ_max² is the largest eigenvalue of the Gram matrix of the smaller side (W Wᵀ, (H, D, D), when
    D <= C), formed and decomposed in float64: relative error ~1e-15, at about the cost of three power
    iterations, and without a warm start that lags when the top singular values are close (random-init
    heads) or swap between steps. Any weights give a value, never an exception (see `ScaledGram`).
    """
    return ScaledGram(w_heads).sigma()


class ScaledGram:
    """Each head's Gram matrix, made safe for the eigenvalue solver whatever the weights hold.

    A NaN weight makes LAPACK's solver fail ("failed to converge") and a huge one overflows the Gram
    in float64 (above ~1e154). So each head is divided by a power of two near its largest |w| (exact:
    the eigenvalue scales back by its square), non-finite entries are solved as 0, and the head's σ is
    then NaN when it held a NaN and +inf when it held an infinity: what the weights are, recorded.
    Every step is an elementwise or batched tensor operation, so on a GPU nothing synchronizes until
    `sigma()` (which `to_host` lets run on a pinned host copy).
    """

    def __init__(self, w_heads: torch.Tensor):
        w = w_heads.detach().double()  # (H, D, C)
        finite = torch.isfinite(w)
        self.has_nan = torch.isnan(w).flatten(-2).any(-1)  # (H,)
        self.has_inf = (~finite).flatten(-2).any(-1) & ~self.has_nan  # (H,)
        w = torch.where(finite, w, torch.zeros((), dtype=w.dtype, device=w.device))
        _, exponent = torch.frexp(w.abs().amax(dim=(-2, -1)))  # max|w| = m·2^e, m in [0.5, 1) (0 for all-zero)
        self.scale = torch.ldexp(torch.ones_like(exponent, dtype=w.dtype), exponent)  # (H,) powers of two
        w = w / self.scale[:, None, None]  # |w| <= 1: the Gram cannot overflow
        self.gram = w @ w.transpose(-1, -2) if w.shape[-2] <= w.shape[-1] else w.transpose(-1, -2) @ w

    def to_host(self) -> ScaledGram:
        """Start copying the pieces to pinned host memory without a synchronization (for a CUDA Gram)."""
        for name in ("gram", "scale", "has_nan", "has_inf"):
            t = getattr(self, name)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            setattr(self, name, host)
        return self

    def sigma(self) -> torch.Tensor:
        """(H,) float64: √λ_max · scale; NaN for a head with a NaN weight, +inf for one with an infinite weight."""
        try:
            lam = torch.linalg.eigvalsh(self.gram)[..., -1]
        except RuntimeError:  # torch.linalg.LinAlgError: solve head by head, NaN where one still fails
            lam = torch.stack([_largest_eigenvalue(g) for g in self.gram])
        sigma = lam.clamp_min(0).sqrt() * self.scale
        sigma = sigma.masked_fill(self.has_inf, torch.inf)
        return sigma.masked_fill(self.has_nan, torch.nan)


def _largest_eigenvalue(gram: torch.Tensor) -> torch.Tensor:
    try:
        return torch.linalg.eigvalsh(gram)[-1]
    except RuntimeError:
        return torch.full((), torch.nan, dtype=gram.dtype, device=gram.device)
