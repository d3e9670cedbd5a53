"""The fused monitor kernel on sampled rows (monitor_kernel.py, `rows=`) under the interpreter against the torch
path of monitor/sampled.py, and the training-speed forward's row maxima (fast_attention.py, `row_max=True`)
turned into max logit and top-1 (monitor/lse_stats.py) against monitor/stats.py.

Inputs are multiples of 1/8 as in test_monitor_kernel.py: every q·k is exact in fp32 whatever the summation
order, so a count difference is a logic difference."""
import pytest
import torch

from grid_inputs import grid_inputs
from fa_forensics.monitor import head_statistics
from fa_forensics.monitor.lse_stats import head_stats_from_lse
from fa_forensics.monitor.sampled import sample_rows, sampled_rows
from fa_forensics.replay.triton import fast_attention as fast


CASES = [  # (B, H, T, Tk, D, causal, score_dtype, n)
    (2, 3, 96, 96, 32, True, torch.bfloat16, 20),
    (1, 2, 70, 70, 16, False, torch.float32, 33),  # more rows than one interpreter block
    (1, 2, 48, 80, 16, True, torch.float16, 12),  # longer K: bottom-right causal
]


@pytest.mark.parametrize("B, H, T, Tk, D, causal, score_dtype, n", CASES)
def test_sampled_rows_of_the_kernel_equal_the_torch_path(B, H, T, Tk, D, causal, score_dtype, n):
    q, k = grid_inputs(T + Tk + n, B, H, T, Tk, D, 2)
    rows = sample_rows(B, T, n, torch.Generator().manual_seed(n))
    kw = dict(scale=D ** -0.5, causal=causal, eps=1e-3, p_dtype=torch.bfloat16, score_dtype=score_dtype)
    kernel, torch_ = (sampled_rows(q, k, rows, backend=b, **kw) for b in ("triton", "torch"))
    assert torch.equal(kernel.rowmax, torch_.rowmax)
    assert torch.equal(kernel.near.long(), torch_.near.long()) and torch.equal(kernel.ones.long(), torch_.ones.long())
    torch.testing.assert_close(kernel.rowsum, torch_.rowsum, rtol=1e-5, atol=0)
    assert int((torch_.near[:, 1] > 1).sum()) > 0  # the planted head ties in sampled rows


def test_pass_one_alone_gives_every_row_s_maximum_and_row_sum():
    from fa_forensics.replay.triton.monitor_kernel import row_statistics

    q, k = grid_inputs(5, 1, 3, 70, 70, 16, 2)
    kw = dict(scale=0.25, causal=True, eps=1e-3, p_dtype=torch.bfloat16, score_dtype=torch.bfloat16)
    rowmax, near, ones, rowsum = row_statistics(q, k, **kw)
    rowmax1, near1, ones1, rowsum1 = row_statistics(q, k, counts=False, **kw)
    assert near1 is None and ones1 is None and near is not None
    assert torch.equal(rowmax1, rowmax) and torch.equal(rowsum1, rowsum)


@pytest.mark.parametrize("T", [96, 128], ids=["T-inside-a-tile", "T-whole-tiles"])
def test_the_forward_s_row_maxima_give_max_logit_and_top1(T):
    """fp32 inputs, the stabilized kernel on planted repeated maxima (its shift is not the row maximum, so the
    row maximum must be kept apart) and the plain one."""
    q, k = (x.float() for x in grid_inputs(3, 1, 2, T, T, 32, 2))
    v = torch.randn(1, 2, T, 32, generator=torch.Generator().manual_seed(4))
    full = head_statistics(q, k, scale=32 ** -0.5, causal=True, score_dtype=torch.float32)
    for stable in (True, False):
        _, lse2, max2 = fast.forward(q, k, v, causal=True, scale=32 ** -0.5, stable=stable, row_max=True)
        max_logit, top1 = head_stats_from_lse(max2, lse2, log2_units=True)
        torch.testing.assert_close(max_logit, full.max_logit, rtol=1e-6, atol=0)
        torch.testing.assert_close(top1, full.top1_prob, rtol=1e-5, atol=0)
