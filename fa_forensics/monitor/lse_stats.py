"""Per-head max logit and top-1 probability from what an attention forward produces anyway.

A forward that keeps each row's maximum score m and its log-sum-exp lse gives the row's largest softmax
probability as exp(m − lse), with no pass over K of its own: top-1 = e^m / Σ_t e^{s_t}. The monitor's
`max_logit` (the largest score of a head) and `top1_prob` (the mean of top-1 over the B·T rows) then cost a
reduction over (B, H, T). The training-speed kernels return both in log2 units
(`fast_attention.forward(..., row_max=True)`: the row maximum of s₂ = α·log2 e·q·k and LSE₂); kernels of the
FlashAttention family return lse in natural units.

These are statistics of the scores the kernel forms (fp32 dots), not of scores rounded to a 16-bit score
dtype, which is what monitor/stats.py counts repeated maxima in; a bf16 score rounding moves a max logit by
at most half a bf16 ulp and top-1 by as much. The repeated-maximum counts still need the scores themselves
(monitor/sampled.py).
"""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def head_stats_from_lse(row_max: torch.Tensor, lse: torch.Tensor, *, log2_units: bool) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """(max_logit (H,), top1_prob (H,)) fp32 on the inputs' device, from row maxima and lse (B, H, T).

    log2_units: both in log2 units (the training-speed kernels), else natural. A row with no visible key
    (m = −inf) has an undefined top-1: NaN, as in monitor/stats.py.
    """
    B, _, T = row_max.shape
    diff = row_max.float() - lse.float()
    top1 = torch.exp2(diff) if log2_units else torch.exp(diff)  # NaN where m = lse = −inf
    top1 = torch.where(row_max == -torch.inf, torch.nan, top1)
    max_logit = row_max.float().amax(dim=(0, 2))
    if log2_units:
        max_logit = max_logit * math.log(2.0)  # s = s₂ · ln 2
    return max_logit, (top1.double().sum(dim=(0, 2)) / (B * T)).float()
