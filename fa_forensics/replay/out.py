"""What one replay returns: the output, the log-sum-exp, P̄ statistics and (with dO) gradients.

Every backend (the CPU emulator, the Triton kernels) returns exactly these types, so analyses
never depend on which one ran. Shapes: B batch, H heads, T sequence, D head dimension.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.replay.config import ReplayConfig


@dataclass(frozen=True)
class PBarStats:
    """Counts of the P̄ events the papers care about, per (batch, head); each a (B, H) int64 tensor.

    - repeated_max_rows: rows whose fp32 row maximum of the scaled scores is attained more than
      once (the paper's precondition for P̄ == 1 at two places, App. E.1 / Fig. 13);
    - p_one_count: P̄ entries exactly 1 after the P̄ cast (for an fp8 P scale S: entries equal to S,
      i.e. an unscaled 1);
    - stabilized_rows: rows where the stabilized shift of Algorithm 3 fired in at least one block;
    - p_zeroed: P̄ entries > 0 before the cast and 0 after it (underflow of the cast);
    - rows: number of query rows (T), the denominator of rates.
    """

    repeated_max_rows: torch.Tensor  # (B, H) int64
    p_one_count: torch.Tensor  # (B, H) int64
    stabilized_rows: torch.Tensor  # (B, H) int64
    p_zeroed: torch.Tensor  # (B, H) int64
    rows: torch.Tensor  # (B, H) int64

    def total(self) -> dict[str, int]:
        """The counts summed over batch and heads, as plain ints (for tables and JSON)."""
        return {
            "repeated_max_rows": int(self.repeated_max_rows.sum()),
            "p_one_count": int(self.p_one_count.sum()),
            "stabilized_rows": int(self.stabilized_rows.sum()),
            "p_zeroed": int(self.p_zeroed.sum()),
            "rows": int(self.rows.sum()),
        }


@dataclass(frozen=True)
class ReplayOut:
    """The result of one replay under one ReplayConfig.

    o is in the torch dtype of config.o_dtype; lse = m + log ℓ (natural log, unshifted domain) is
    what the backward pass uses to recompute P; the gradients are None when no dO was given.
    """

    o: torch.Tensor  # (B, H, T, D) torch dtype of config.o_dtype
    lse: torch.Tensor  # (B, H, T) fp32
    stats: PBarStats
    delta: Optional[torch.Tensor]  # (B, H, T) fp32
    dq: Optional[torch.Tensor]  # (B, H, T, D) fp32
    dk: Optional[torch.Tensor]  # (B, H, T, D) fp32
    dv: Optional[torch.Tensor]  # (B, H, T, D) fp32
    config: ReplayConfig
    backend: str  # "emulate" | "triton"
    accumulation: str  # "ieee" | "tensor-core"

    @property
    def has_backward(self) -> bool:
        return self.dq is not None
