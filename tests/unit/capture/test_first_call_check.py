"""The first-call check's bound: what kernels of each precision compute passes it, a wrong mapping does not."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fa_forensics.capture.first_call_check import check_first_call


def _qkv(seed, B=2, H=4, T=96, D=16, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g) * s for s in (spread, spread, 1.0))


def _check(q, k, v, o, dtype, **kw):
    options = dict(scale=None, causal=True, mask=None, softcap=None, dropout_p=0.0)
    options.update(kw)
    return check_first_call(q, k, v, o, kernel_dtype=dtype, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_and_eager_attention_pass_in_their_precision(dtype):
    q, k, v = (t.to(dtype) for t in _qkv(0))
    o_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(16))  # eager: S and P rounded to the dtype
    s = s.masked_fill(torch.ones(96, 96, dtype=torch.bool).triu(1), float("-inf"))
    o_eager = F.softmax(s, -1, dtype=torch.float32).to(dtype) @ v
    for o in (o_sdpa, o_eager):
        result = _check(q, k, v, o, dtype)
        assert result.reproduced and result.skipped is None and 0 < result.error <= result.tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_swap_of_q_and_k_or_a_wrong_scale_or_causal_flag_is_caught(dtype):
    q, k, v = (t.to(dtype) for t in _qkv(1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for wrong in (_check(k, q, v, o, dtype), _check(q, k, v, o, dtype, scale=0.5),
                  _check(q, k, v, o, dtype, causal=False)):
        assert not wrong.reproduced and wrong.ratio > 1 and wrong.error > wrong.tolerance


def test_bias_softcap_and_grouped_heads_are_applied():
    q, k, v = _qkv(2)
    k2, v2 = k[:, :2], v[:, :2]  # two K/V heads for four query heads
    bias = torch.randn(1, 4, 96, 96)
    kk, vv = k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1)
    s = 5.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / 5.0) + bias
    o = torch.softmax(s, -1) @ vv
    assert _check(q, k2, v2, o, torch.float32, scale=0.25, causal=False, mask=bias, softcap=5.0).reproduced
    assert not _check(q, k2, v2, o, torch.float32, scale=0.25, causal=False, mask=bias).reproduced  # cap left out


def test_dropout_and_unmodelled_options_are_not_checked():
    q, k, v = _qkv(3)
    o = torch.zeros_like(q)
    assert _check(q, k, v, o, torch.float32, dropout_p=0.1).skipped.startswith("the call drops P")
    assert "window_size" in _check(q, k, v, o, torch.float32, not_replayed=("window_size",)).skipped
