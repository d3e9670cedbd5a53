"""The tensor primitives several analyses compute, each defined once: δ and its error, the high-precision
attention rows PK, and the scores as the replay forms them.

An analysis folder imports these (and the other shared modules of `analyses`), never another analysis folder,
so that each analysis can be read, changed and tested on its own. All arithmetic is float64 on exactly upcast
tensors, except `scores_fp32`, which is the replay's own fp32 (or s_dtype) arithmetic.
"""
from __future__ import annotations

from typing import Optional

import torch

from fa_forensics.layers.selection import as_f64
from fa_forensics.replay.config import ReplayConfig


def delta_of(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """δ = rowsum(dO ∘ O) in float64.  (B, h, T, D) x2 -> (B, h, T)"""
    return (as_f64(do) * as_f64(o)).sum(-1)


def delta_error(do: torch.Tensor, o_lp: torch.Tensor, o_hp: torch.Tensor) -> torch.Tensor:
    """(δ_lp − δ_hp)[T] = Σ_i dO[T,i]·(O_lp − O_hp)[T,i] in float64.  -> (B, h, T)"""
    return (as_f64(do) * (as_f64(o_lp) - as_f64(o_hp))).sum(-1)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                    mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """P = softmax(α Q Kᵀ) in float64 (causal: key t' > query t masked; `mask`, the recorded attn_mask
    broadcastable to (B, h, T, T), applied as SDPA does: bool False removes a key, additive is added;
    a row that sees no key has P = 0, as SDPA's O).  (B, h, T, D) -> (B, h, T, T)"""
    s = scale * (as_f64(q) @ as_f64(k).transpose(-1, -2))  # (B, h, T, T)
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + as_f64(mask)
    p = torch.softmax(s, dim=-1)
    return p.nan_to_num(0.0) if mask is not None else p


def pk_rows(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PK, one batch element at a time to bound memory.  (B, h, T, D) -> (B, h, T, D) float64"""
    def mask_b(b: int) -> Optional[torch.Tensor]:
        return None if mask is None else mask[b : b + 1] if mask.shape[0] > 1 else mask

    return torch.cat([attention_probs(q[b : b + 1], k[b : b + 1], scale, causal, mask_b(b)) @ as_f64(k[b : b + 1])
                      for b in range(q.shape[0])])


def scores_fp32(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, s_dtype: str = "fp32",
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S = α·q·kᵀ (B, h, T, T) held in fp32, formed as the replay forms them
    (`replay.emulate.forward.scaled_scores`, ieee accumulation, one block); causal positions −inf,
    and the recorded attn_mask `mask` (broadcastable to (B, h, T, T)) applied as the replay applies it.
    Exact ties (identical keys) stay exact ties.

    With s_dtype below fp32 (bf16-autocast: "bf16") the scores are read as that preset computes
    them: S = round(q·kᵀ), s = round(S·α), nearest-even (values exact in s_dtype).
    """
    from fa_forensics.replay.emulate.forward import scaled_scores

    config = ReplayConfig(s_dtype=s_dtype)
    return scaled_scores(q.to(torch.float32), k.to(torch.float32), config, scale, causal, 0, 0, mask=mask)
