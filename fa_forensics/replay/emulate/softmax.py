"""Row-wise shift rules of the online softmax: m_new from m_prev and one block of scores.

- standard:      m = max(m_prev, r_m), r_m = block row max;
- stabilized:    the paper's Algorithm 3 (lines 7-10): r_s = #{t : r_m - s_t <= ε};
                 m' = β·r_m if r_m > 0 and r_s > 1; m'' = 0 if r_m < 0 and r_s > 1, else m';
                 m = max(m_prev, m'') (the ADJUSTED shift enters the running max);
- fixed-offset:  m = max(m_prev, r_m + offset) (App. C's rejected alternative).

All arithmetic in fp32, except the stabilized test when config.s_dtype is below fp32 (the
autocast reference): there it is s ≥ cast(r_m − ε, s_dtype), computed on the bf16 scores as the
reference code does, so near ties within a bf16 ulp of r_m count only when they are exact.
Rows with no visible score in the block (r_m = -inf) keep m_prev.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fa_forensics.replay.config import Precision, ReplayConfig, Softmax
from fa_forensics.replay.emulate.ops import cast


@dataclass(frozen=True)
class Shift:
    """The new running shift and whether the stabilized rule fired, per row."""

    m: torch.Tensor  # (B, H, R) fp32, may be -inf for rows with nothing visible yet
    fired: torch.Tensor  # (B, H, R) bool


def block_shift(m_prev: torch.Tensor, s: torch.Tensor, config: ReplayConfig) -> Shift:
    """m for one KV block; m_prev (B, H, R) fp32, s (B, H, R, N) fp32 scaled scores (-inf = masked)."""
    r_m = s.amax(dim=-1)  # (B, H, R)
    if config.softmax is Softmax.STANDARD:
        return Shift(torch.maximum(m_prev, r_m), torch.zeros_like(r_m, dtype=torch.bool))
    if config.softmax is Softmax.FIXED_OFFSET:
        shifted = r_m + torch.tensor(config.offset, dtype=torch.float32)
        return Shift(torch.maximum(m_prev, shifted), torch.zeros_like(r_m, dtype=torch.bool))
    # Stabilized (Algorithm 3). r_m - s is NaN for fully masked rows (-inf - -inf): not counted.
    eps = torch.tensor(config.eps, dtype=torch.float32)
    if config.s_dtype is Precision.FP32:
        r_s = ((r_m.unsqueeze(-1) - s) <= eps).sum(dim=-1)  # (B, H, R)
    else:  # `s >= rowmax - eps` on low-precision tensors: the threshold is rounded to s_dtype
        r_s = (s >= cast(r_m - eps, config.s_dtype).unsqueeze(-1)).sum(dim=-1)
    repeated = r_s > 1
    beta = torch.tensor(config.beta, dtype=torch.float32)
    m_1 = torch.where((r_m > 0) & repeated, beta * r_m, r_m)  # m'
    m_2 = torch.where((r_m < 0) & repeated, torch.zeros_like(r_m), m_1)  # m''
    fired = repeated & (r_m != 0) & torch.isfinite(r_m)
    return Shift(torch.maximum(m_prev, m_2), fired)
