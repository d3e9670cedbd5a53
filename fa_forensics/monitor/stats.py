"""Per-head attention statistics from Q and K, computed in row chunks.

The paper's leading indicator (App. E.1, Fig. 13) is the number of score rows whose maximum is
attained more than once: those rows give P̄ = exp(S − m) = 1 several times and feed the biased
rounding of P̄V. We count, per (batch-summed) head:
  max_logit       max over rows of the scaled score S = α q·k (causal positions only)
  near_max_ties   rows whose maximum is attained more than once within ε (r_m − S ≤ ε, count > 1)
  p_one_extra     Σ over rows of max(0, #{P̄ == 1 in the P̄ dtype} − 1): unit entries beyond the first
  top1_prob       mean over rows of the largest softmax probability, 1 / Σ_t exp(S_t − r_m)
Scores are formed in fp32 from the inputs as given (bf16 inputs are exact in fp32), `chunk`
query rows at a time, so memory is O(chunk · T) per head instead of O(T²).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Per-(layer, head) series the monitor appends to a dump's timeline/ group, one row per step.
TIMELINE_METRICS = ("max_logit", "near_max_ties", "p_one_extra", "top1_prob", "wq_sigma")


@dataclass(frozen=True)
class HeadStats:
    """Statistics of one attention call, one value per head (summed/maxed over the batch)."""

    max_logit: torch.Tensor  # (H,) fp32
    near_max_ties: torch.Tensor  # (H,) int64
    p_one_extra: torch.Tensor  # (H,) int64
    top1_prob: torch.Tensor  # (H,) fp32, mean over batch and rows
    rows: int  # rows per head that were looked at (B · T)


@torch.no_grad()
def head_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    eps: float = 1e-3,
    p_dtype: torch.dtype = torch.bfloat16,
    chunk: int = 128,
    to_cpu: bool = True,
) -> HeadStats:
    """Statistics of softmax(α q kᵀ) per head without materializing the T×T matrix.

    q, k: (B, H, T, D) (K may have its own length Tk). `p_dtype` is the dtype P̄ is cast to
    before P̄V (bf16 in the paper's setting), used to decide which entries equal 1.
    to_cpu=False leaves the results on q's device (the monitor copies a whole step at once).
    """
    B, H, T, D = q.shape
    Tk = k.shape[2]
    alpha = scale if scale is not None else D ** -0.5
    kf = k.float()  # (B, H, Tk, D)
    max_logit = torch.full((H,), -torch.inf, device=q.device)
    ties = torch.zeros(H, dtype=torch.int64, device=q.device)
    p_one_extra = torch.zeros(H, dtype=torch.int64, device=q.device)
    top1_sum = torch.zeros(H, dtype=torch.float64, device=q.device)
    cols = torch.arange(Tk, device=q.device)
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        s = torch.matmul(q[:, :, start:stop].float(), kf.transpose(-1, -2)) * alpha  # (B, H, c, Tk)
        if causal:
            rows = torch.arange(start, stop, device=q.device) + (Tk - T)  # bottom-right aligned
            s = s.masked_fill(cols[None, :] > rows[:, None], -torch.inf)
        r_m = s.amax(dim=-1, keepdim=True)  # (B, H, c, 1)
        max_logit = torch.maximum(max_logit, r_m.amax(dim=(0, 2, 3)))
        near = (r_m - s) <= eps  # -inf entries give +inf distance: never near
        ties += (near.sum(dim=-1) > 1).sum(dim=(0, 2))
        p_bar = torch.exp(s - r_m)  # (B, H, c, Tk) fp32, max entry exactly 1
        ones = (p_bar.to(p_dtype) == 1).sum(dim=-1)  # (B, H, c)
        p_one_extra += (ones - 1).clamp(min=0).sum(dim=(0, 2))
        top1_sum += (1.0 / p_bar.sum(dim=-1)).double().sum(dim=(0, 2))
    rows_total = B * T
    move = (lambda t: t.cpu()) if to_cpu else (lambda t: t)
    return HeadStats(
        max_logit=move(max_logit),
        near_max_ties=move(ties),
        p_one_extra=move(p_one_extra),
        top1_prob=move((top1_sum / rows_total).float()),
        rows=rows_total,
    )
