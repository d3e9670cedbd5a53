"""stable_attention on the CPU (emulator path): accuracy, gradients, and the paper's fix at work."""
import math

import pytest
import torch
import torch.nn.functional as F

from fa_forensics import stable_attention
from fa_forensics.errors import ConfigError
from fa_forensics.replay import ReplayConfig, replay

FEATURE = 0


def planted(B=2, H=4, T=64, D=16, gain=24.0, seed=0):
    """Keys come in identical pairs, each query points at one visible pair (its row maximum is
    attained twice, with a large gap to the rest), and V's feature 0 is negative for every token."""
    g = torch.Generator().manual_seed(seed)
    k_dir = torch.randn(B, H, T // 2, D, generator=g)
    k_dir = k_dir / k_dir.norm(dim=-1, keepdim=True)
    k = (k_dir * math.sqrt(D)).repeat_interleave(2, dim=2)  # (B, H, T, D) keys 2j, 2j+1 identical
    n_visible = (torch.arange(T) + 1) // 2
    pick = (torch.rand(B, H, T, generator=g) * n_visible.clamp(min=1)).floor().long()
    jitter = 0.75 + 0.5 * torch.rand(B, H, T, 1, generator=g)
    q = k_dir.gather(2, pick.unsqueeze(-1).expand(B, H, T, D)) * gain * jitter
    v = torch.randn(B, H, T, D, generator=g)
    v[..., FEATURE] = -(2 + 2 * torch.rand(B, H, T, generator=g))
    return tuple(x.to(torch.bfloat16) for x in (q, k, v))


def test_close_to_exact_fp64_attention_with_finite_gradients():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 48, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    o = stable_attention(q, k, v)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    rel = ((o.double() - exact).norm() / exact.norm()).item()
    assert rel < 1e-2, rel
    do = torch.randn(o.shape, generator=g).bfloat16()
    o.backward(do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(do.double())
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_removes_the_planted_bias():
    """BF16 (paper setting) rounds O's planted feature with a negative bias; the fix removes it."""
    from scipy.stats import binomtest

    q, k, v = planted()
    ref = replay(q, k, v, ReplayConfig.preset("fp32")).o.double()[..., FEATURE]  # (B, H, T)
    base_err = (replay(q, k, v, ReplayConfig.preset("bf16")).o.double()[..., FEATURE] - ref).flatten()
    fix_err = (stable_attention(q, k, v).double()[..., FEATURE] - ref).flatten()
    n_neg = int((base_err < 0).sum())
    n_nonzero = int((base_err != 0).sum())
    assert base_err.mean() < 0 and binomtest(n_neg, n_nonzero, 0.5).pvalue < 0.01  # a real negative bias
    assert fix_err.mean().abs() * 5 <= base_err.mean().abs(), (fix_err.mean(), base_err.mean())


def test_fp32_inputs_and_non_causal():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 32, 8, generator=g) for _ in range(3))
    o = stable_attention(q, k, v, causal=False)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), exact, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_one_line_errors():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ConfigError, match="dtype"):
        stable_attention(q.half(), q, q)
    with pytest.raises(ConfigError, match="beta"):
        stable_attention(q, q, q, beta=1.0)


@pytest.mark.parametrize("max_score", [30.0, 50.0, 100.0])
def test_no_collapse_when_a_repeated_maximum_is_large(max_score):
    """The paper's kernel returns |O|/|O_exact| = 0.002 at a repeated maximum of 30 (its 10⁻¹⁰ floor on
    the row sum); stable_attention stays within 1 % of exact fp64 attention, with finite gradients."""
    g = torch.Generator().manual_seed(0)
    T, D = 32, 16
    dirs = torch.randn(1, 2, T // 2, D, generator=g, dtype=torch.float64)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    k = dirs.repeat_interleave(2, dim=2) * math.sqrt(D)  # keys 2j, 2j+1 identical
    pick = torch.div(torch.arange(T) - 1, 2, rounding_mode="floor").clamp(min=0)  # the last fully visible pair
    q = dirs[:, :, pick] * max_score  # row maximum = max_score, attained twice
    v = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        qx, kx, vx = (x.to(dtype).requires_grad_() for x in (q, k, v))
        exact = F.scaled_dot_product_attention(qx.double(), kx.double(), vx.double(), is_causal=True)
        for beta in (2.0, 8.0):
            o = stable_attention(qx, kx, vx, beta=beta)
            assert abs((o.double().norm() / exact.norm()).item() - 1) < 0.01
            assert ((o.double() - exact).norm() / exact.norm()).item() < 0.01
            o.float().sum().backward()
            assert all(torch.isfinite(x.grad.float()).all() for x in (qx, kx, vx))
