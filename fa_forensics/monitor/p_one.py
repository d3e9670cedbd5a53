"""Exact thresholds for "P̄ == 1 after the cast to a 16-bit dtype", so the monitor can count those
entries without a cast and a compare over every score.

Two facts, both checked exhaustively over the fp32 values concerned in tests/unit/monitor/test_monitor_p_one.py:

1. The cast (round to nearest, ties to even). Below 1 the bf16 grid has spacing 2⁻⁸, so the midpoint
   between 1 − 2⁻⁸ and 1 is 1 − 2⁻⁹. A tie goes to the even neighbour: that is 1.0 (mantissa 0), not
   1 − 2⁻⁸ (mantissa 0x7F). For an fp32 p in [0, 1]:
       bf16(p) == 1  ⇔  p ≥ 1 − 2⁻⁹        (fp16: spacing 2⁻¹¹, so p ≥ 1 − 2⁻¹²).
   Write u = 1 − P_ONE_MIN (2⁻⁹ or 2⁻¹²). Then floor(p + u) is 1 exactly when p ≥ 1 − u, and 0
   otherwise. Near 1, p + u is exact or rounds to a value ≥ 1; for p < 1/2, p + u < 1. So the count is
   Σ floor(p + u): two float passes and a sum, which is cheaper on a CPU than a cast followed by a
   boolean compare (`count_p_one`). This does not depend on how exp is computed.

2. The exp. For the correctly rounded fp32 exp (`numerics.exp_fp32`, the emulator's), the fp32
   values x ≤ 0 with bf16(exp(x)) == 1 are exactly the interval [EXP_ONE_MIN[bf16], 0], where
   EXP_ONE_MIN[bf16] = −0.0019550644…  (ln(1 − 2⁻⁹) = −0.00195503…)
   EXP_ONE_MIN[fp16] = −0.00024420022…  (ln(1 − 2⁻¹²) = −0.00024417…).
   torch's own fp32 exp (which the monitor runs on the training device) is faithful, not correctly
   rounded, and its last bit differs between machines: its threshold lies within a few fp32 ulps
   of these. So a score within ε of its row maximum has P̄ == 1 whenever ε ≤ |EXP_ONE_MIN|, which
   holds for the default ε = 10⁻³ in bf16. A row can then only be a near-tie row if it has two
   P̄ == 1 entries.
   The statistics use this to skip the ε comparison on all other rows
   (`near_set_within_p_one`). The margin (5.5·10⁻⁵ for ε = 10⁻³ in bf16) is about 10³ times any
   faithful exp's error, so the shortcut holds on every exp implementation, not only this CPU's.
"""
from __future__ import annotations

import torch

# Smallest fp32 p with dtype(p) == 1 (round to nearest even), per P̄ dtype.
P_ONE_MIN = {torch.bfloat16: 1.0 - 2.0**-9, torch.float16: 1.0 - 2.0**-12}

# Smallest fp32 x ≤ 0 with dtype(exp_fp32(x)) == 1 (fp32 bit patterns 0xBB00208A / 0xB9800800).
EXP_ONE_MIN = {torch.bfloat16: -0.0019550644792616367, torch.float16: -0.0002442002296447754}


def count_p_one(p: torch.Tensor, p_dtype: torch.dtype, *, overwrite: bool = False) -> torch.Tensor:
    """Per row (last dim), how many entries of p (fp32, values in [0, 1]) are 1 after the cast to p_dtype.

    Equal to `(p.to(p_dtype) == 1).sum(-1)` on rows without NaN; a row holding a NaN counts 0. That
    is also the cast's count for the rows of exp(S − m): a NaN or +inf score makes m NaN or +inf, and
    then every entry of the row is NaN or 0. Dtypes without a known threshold use the cast.
    overwrite=True works in place in p (saves one allocation; p is garbage afterwards).
    """
    if p_dtype not in P_ONE_MIN:
        return (p.to(p_dtype) == 1).sum(dim=-1)
    u = 1.0 - P_ONE_MIN[p_dtype]  # 2⁻⁹ or 2⁻¹², exact in fp32
    # a sum of 0/1 values in fp32: exact below 2²⁴ columns
    per_row = (p.add_(u) if overwrite else p + u).floor_().sum(dim=-1)
    return per_row.nan_to_num_(0.0).long()


def near_set_within_p_one(eps: float, p_dtype: torch.dtype) -> bool:
    """True when every score within eps of its row maximum has P̄ == 1 in p_dtype (ε in fp32, as compared)."""
    if p_dtype not in EXP_ONE_MIN:
        return False
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    return eps32 <= -EXP_ONE_MIN[p_dtype] * 0.99  # keep a 1 % margin: any faithful exp, not only this CPU's
