"""Per-head spectral norm of W_Q by warm-started power iteration (paper Fig. 3 and Fig. 11).

Where the query weights live (the documented name patterns, relative to an attention module):
  nanoGPT            `<attn>.c_attn.weight`  (3C, C) nn.Linear; W_Q = rows [0, C)
  Hugging Face GPT-2 `<attn>.c_attn.weight`  (C, 3C) Conv1D (x @ W); W_Q = columns [0, C), transposed
  Hugging Face Llama `<attn>.q_proj.weight`  (C, C) nn.Linear
  generic            `<attn>.q_proj.weight`, `<attn>.query.weight`, `<attn>.wq.weight`
Head h of W_Q is the block of rows [h·D, (h+1)·D) of the (C_out, C_in) matrix. A few power
iterations per step, warm-started from the previous step's vector, track σ_max closely because
weights change little between steps.
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


class SpectralTracker:
    """Keeps one right-singular-vector estimate per (layer, head) across steps."""

    def __init__(self, iterations: int = 3, seed: int = 0) -> None:
        self.iterations = iterations
        self._vectors: dict[int, torch.Tensor] = {}
        self._gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def sigma(self, layer: int, w_heads: torch.Tensor, to_cpu: bool = True) -> torch.Tensor:
        """σ_max of each head's block, (H,) fp32, updating the warm-start vectors of `layer`.

        to_cpu=False leaves the result on the weights' device (no synchronization).
        """
        w = w_heads.float()  # (H, D, C)
        v = self._vectors.get(layer)
        if v is None or v.shape != (w.shape[0], w.shape[2]):
            v = torch.randn(w.shape[0], w.shape[2], generator=self._gen).to(w.device)
        v = v.to(w.device)
        for _ in range(self.iterations):
            u = torch.nn.functional.normalize(torch.einsum("hdc,hc->hd", w, v), dim=-1)
            v = torch.nn.functional.normalize(torch.einsum("hdc,hd->hc", w, u), dim=-1)
        self._vectors[layer] = v
        sigma = torch.einsum("hdc,hc->hd", w, v).norm(dim=-1)  # (H,)
        return sigma.cpu() if to_cpu else sigma
