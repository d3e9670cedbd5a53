"""The exact thresholds behind the monitor's P̄ == 1 count, checked over every fp32 value concerned."""
import numpy as np
import pytest
import torch

from fa_forensics.numerics import exp_fp32
from fa_forensics.monitor.p_one import EXP_ONE_MIN, P_ONE_MIN, count_p_one, near_set_within_p_one

DTYPES = [torch.bfloat16, torch.float16]


def _all_fp32(lo: float, hi: float) -> torch.Tensor:
    """Every fp32 value in [lo, hi] (same sign), ascending in magnitude, from the bit patterns."""
    a, b = (int(np.array([v], np.float32).view(np.int32)[0]) for v in (lo, hi))
    return torch.arange(min(a, b), max(a, b) + 1, dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("p_dtype", DTYPES)
def test_cast_to_one_threshold_and_floor_count_over_every_fp32_in_quarter_to_one(p_dtype):
    p = _all_fp32(0.25, 1.0)  # 2 binades, 16.8 M values; below 1/4 neither the cast nor floor(p + u) can give 1
    is_one = p.to(p_dtype) == 1
    assert torch.equal(is_one, p >= P_ONE_MIN[p_dtype])  # the cast gives 1 exactly from P_ONE_MIN up
    assert float(p[is_one].min()) == P_ONE_MIN[p_dtype]
    u = 1.0 - P_ONE_MIN[p_dtype]
    assert torch.equal((p + u).floor() == 1, is_one) and bool(((p + u).floor() <= 1).all())
    rows = p[: 1024 * 16384].view(1024, 16384)  # the counting function, row by row, against the cast
    assert torch.equal(count_p_one(rows, p_dtype), (rows.to(p_dtype) == 1).sum(-1))
    top = p[-40000:].view(1, -1)  # one row holding every value from 1 − u to 1
    assert int(count_p_one(top, p_dtype)) == int(is_one.sum()) == int((top.to(p_dtype) == 1).sum()) > 0


@pytest.mark.slow  # about 3 s of CPU or more
@pytest.mark.parametrize("p_dtype", DTYPES)
def test_exp_one_threshold_is_exact_for_the_correctly_rounded_exp(p_dtype):
    """Every fp32 x in a window of 4 binades around ln(1 − u): dtype(exp_fp32(x)) == 1 ⇔ x ≥ EXP_ONE_MIN.

    torch's own fp32 exp on this machine (both CPU code paths: the vectorized loop on contiguous
    memory, the scalar one on strided) is faithful, not correctly rounded: its threshold lies within
    one output ulp (2⁻²⁴) of EXP_ONE_MIN, far inside the 1 % margin the monitor's shortcut keeps.
    Outside the window the answer is far from the threshold for any faithful exp (checked on a sample).
    """
    lo, hi = (-(2.0**-8), -(2.0**-12)) if p_dtype == torch.bfloat16 else (-(2.0**-11), -(2.0**-15))
    x = _all_fp32(lo, hi)  # 33.5 M values, ascending in magnitude
    assert torch.equal(exp_fp32(x).to(p_dtype) == 1, x >= EXP_ONE_MIN[p_dtype])
    strided = torch.empty(2 * x.numel())
    strided[::2] = x
    for e in (torch.exp(x), torch.exp(strided[::2])):
        is_one = e.to(p_dtype) == 1
        n_one = int(is_one.sum())
        assert torch.equal(is_one[:n_one], torch.ones(n_one, dtype=torch.bool))  # one interval up to 0
        assert abs(float(x[n_one - 1]) - EXP_ONE_MIN[p_dtype]) <= 2.0**-24
    # ln(1 − u), up to the resolution of exp's fp32 output near 1 (2⁻²⁴ per ulp, a few ulps)
    assert np.log1p(-(1.0 - P_ONE_MIN[p_dtype])) == pytest.approx(EXP_ONE_MIN[p_dtype], abs=2.0**-22)
    g = torch.Generator().manual_seed(0)
    near_zero = -torch.rand(1_000_000, generator=g) * abs(hi)  # (hi, 0]: always 1
    far = lo - torch.rand(1_000_000, generator=g) * 50  # below lo: never 1
    assert bool((torch.exp(near_zero).to(p_dtype) == 1).all()) and not bool((torch.exp(far).to(p_dtype) == 1).any())


def test_near_set_shortcut_only_where_every_near_score_has_p_one():
    assert near_set_within_p_one(1e-3, torch.bfloat16)  # the default ε in the paper's bf16 setting
    assert not near_set_within_p_one(2e-3, torch.bfloat16)  # beyond |EXP_ONE_MIN| = 1.955e-3
    assert not near_set_within_p_one(1e-3, torch.float16)  # fp16's P̄ == 1 set is narrower than ε
    assert not near_set_within_p_one(1e-3, torch.float32)
    # what the shortcut relies on: every d in [−ε, 0] has bf16(exp(d)) == 1 (all fp32 of [−ε, −2⁻¹²])
    d = _all_fp32(-float(np.float32(1e-3)), -(2.0**-12))
    assert bool((torch.exp(d).to(torch.bfloat16) == 1).all())
