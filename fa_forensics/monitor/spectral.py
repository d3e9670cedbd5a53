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
    """σ_max of each head's block of W_Q, (H,) fp32 on the weights' device, exact (no iteration).

    σ_max² is the largest eigenvalue of the Gram matrix of the smaller side (W Wᵀ, (H, D, D), when
    D <= C), formed and decomposed in float64: relative error ~1e-15 before the cast to fp32, at about
    the cost of three power iterations, and without a warm start that lags when the top singular
    values are close (random-init heads) or swap between steps.
    """
    w = w_heads.detach().double()  # (H, D, C)
    gram = w @ w.transpose(-1, -2) if w.shape[-2] <= w.shape[-1] else w.transpose(-1, -2) @ w
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt().float()  # (H,)
