"""The fused monitor statistics kernel (monitor_kernel.py) under the interpreter: counts identical to
the torch reference (monitor/stats.py) in fp32 and bf16 score precision, without a T×T matrix.

Inputs are multiples of 1/8 (|q| ≤ spread, |k| ≤ 2): every q·k is then exact in fp32 whatever the summation
order, so both sides form the same scores and any count difference is a logic difference."""
import numpy as np
import pytest
import torch

from grid_inputs import grid_inputs
from fa_forensics.monitor import head_statistics


CASES = [  # (B, H, T, Tk, D, causal, score_dtype, p_dtype, spread)
    (2, 3, 96, 96, 32, True, torch.float32, torch.bfloat16, 1),
    (2, 3, 96, 96, 32, True, torch.bfloat16, torch.bfloat16, 2),
    (1, 2, 70, 70, 16, False, torch.bfloat16, torch.bfloat16, 2),  # not causal, T not a multiple of the tile
    (1, 2, 48, 80, 16, True, torch.float16, torch.float16, 1),  # longer K: bottom-right causal
    (1, 2, 80, 48, 16, True, torch.bfloat16, torch.bfloat16, 1),  # shorter K: fully masked rows (NaN top-1)
]


@pytest.mark.parametrize("B, H, T, Tk, D, causal, score_dtype, p_dtype, spread", CASES)
def test_fused_kernel_counts_equal_the_torch_reference(B, H, T, Tk, D, causal, score_dtype, p_dtype, spread):
    q, k = grid_inputs(T + Tk + D, B, H, T, Tk, D, spread)
    kw = dict(scale=D ** -0.5, causal=causal, eps=1e-3, p_dtype=p_dtype, score_dtype=score_dtype)
    fused = head_statistics(q, k, backend="triton", **kw)
    torch_ = head_statistics(q, k, backend="torch", **kw)
    assert fused.near_max_ties.tolist() == torch_.near_max_ties.tolist()
    assert fused.p_one_extra.tolist() == torch_.p_one_extra.tolist()
    assert torch.equal(fused.max_logit, torch_.max_logit)
    np.testing.assert_allclose(fused.top1_prob.numpy(), torch_.top1_prob.numpy(), rtol=1e-5)  # NaN in both or neither
    assert fused.rows == torch_.rows
    assert int(torch_.near_max_ties[1]) >= B * 10 and int(torch_.p_one_extra.sum()) > 0  # the planted head counts
