"""The emulator against references: fp64 attention, the plain (untiled) softmax, tiling and order."""
import math

import pytest
import torch

from fa_forensics.numerics import exp_fp32, matmul, round_to
from fa_forensics.replay import ReplayConfig, replay

FP32 = ReplayConfig.preset("fp32")
BF16 = ReplayConfig.preset("bf16")


def _inputs(B=1, H=2, T=64, D=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (2 * torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    v, do = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, do


def _fp64_attention(q, k, v, do, causal, scale):
    """Exact-enough reference: fp64 autograd attention on the same input values."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    o.backward(do.double())
    lse = torch.logsumexp(s, dim=-1)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_n,order", [(None, "forward"), (16, "forward"), (16, "reverse")])
def test_all_fp32_casts_agree_with_fp64_attention(causal, block_n, order):
    q, k, v, do = _inputs(T=64)
    q, k, v, do = (x.float().double() for x in (q, k, v, do))  # values the fp32 replay sees
    cfg = FP32.with_(block_n=block_n, kv_order=order)
    out = replay(q, k, v, cfg, do=do, causal=causal)
    o64, lse64, dq64, dk64, dv64 = _fp64_attention(q, k, v, do, causal, 1 / math.sqrt(16))
    # fp32 accuracy: a few units of 2^-24 times the magnitudes involved (|V| ~ 1, T = 64 terms)
    assert (out.o.double() - o64).abs().max() < 2e-6
    assert ((out.lse.double() - lse64).abs() / lse64.abs().clamp(min=1)).max() < 1e-6
    for got, ref in ((out.dq, dq64), (out.dk, dk64), (out.dv, dv64)):
        assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert out.o.dtype == torch.float32 and out.dq.dtype == torch.float32


def _plain_attention(q, k, v, cfg, scale):
    """Untiled softmax built directly from numerics: s, m = rowmax, P̄ = exp(s - m), O = cast(P̄V)/ℓ."""
    q, k, v = (round_to(x.float(), cfg.input_dtype.value) for x in (q, k, v))
    s = matmul(q, k.transpose(-1, -2), cfg.accumulation.value, in_format=cfg.input_dtype.value) * scale
    T = q.shape[-2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = exp_fp32(s - m)
    ell = p.double().sum(dim=-1, keepdim=True).float()
    p_bar = round_to(p, cfg.p_dtype.value)
    acc = round_to(matmul(p_bar, v, cfg.accumulation.value, in_format=cfg.input_dtype.value), cfg.pv_dtype.value)
    o = round_to(acc / ell, cfg.o_dtype.value)
    return o, (m.squeeze(-1) + torch.log(ell.squeeze(-1)))


@pytest.mark.parametrize("preset", ["bf16", "fp32"])
@pytest.mark.parametrize("accumulation", ["ieee", "tensor-core"])
def test_one_block_equals_the_plain_softmax_bit_for_bit(preset, accumulation):
    q, k, v, _ = _inputs(T=64, dtype=torch.float32)
    cfg = ReplayConfig.preset(preset).with_(accumulation=accumulation)
    o_ref, lse_ref = _plain_attention(q, k, v, cfg, 0.25)
    for block_n in (None, 64):
        out = replay(q, k, v, cfg.with_(block_n=block_n, block_m=block_n))
        assert torch.equal(out.o.float(), o_ref)
        assert torch.equal(out.lse, lse_ref)


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_tiled_differs_from_untiled_only_by_stated_amounts(order):
    # Stated bounds: bf16 config |ΔO| <= 2^-7 max|V| (one extra bf16 rounding per block);
    # fp32 config |ΔO| <= 16 · 2^-24 · max|V| (fp32 re-association of 8 blocks); lse within 2 fp32 ulps.
    q, k, v, _ = _inputs(T=128, dtype=torch.float32)
    vmax = v.abs().max()
    for cfg, bound in ((BF16, 2**-7), (FP32, 16 * 2**-24)):
        untiled = replay(q, k, v, cfg)
        tiled = replay(q, k, v, cfg.with_(block_n=16, kv_order=order))
        diff = (tiled.o.float() - untiled.o.float()).abs()
        assert diff.max() <= bound * vmax
        assert diff.max() > 0  # tiling is not a no-op: the blocks really are re-associated
        assert torch.allclose(tiled.lse, untiled.lse, rtol=2 * 2**-23, atol=0)


def test_reverse_order_changes_the_bits_but_not_the_value():
    q, k, v, _ = _inputs(T=128, dtype=torch.float32)
    fwd = replay(q, k, v, BF16.with_(block_n=32))
    rev = replay(q, k, v, BF16.with_(block_n=32, kv_order="reverse"))
    assert not torch.equal(fwd.o, rev.o)
    assert (fwd.o.float() - rev.o.float()).abs().max() <= 2**-7 * v.abs().max()


def test_causal_mask_first_row_is_the_first_value_and_noncausal_sees_all():
    q, k, v, _ = _inputs(T=32, dtype=torch.float32)
    causal = replay(q, k, v, FP32, causal=True)
    full = replay(q, k, v, FP32, causal=False)
    assert torch.equal(causal.o[..., 0, :], v[..., 0, :])  # row 0 sees only key 0: O = V[0] exactly
    assert not torch.allclose(causal.o[..., 0, :], full.o[..., 0, :])
    assert torch.equal(causal.o[..., -1, :], full.o[..., -1, :])  # the last row sees every key either way
    # a causal replay ignores the future: changing the last key and value leaves earlier rows unchanged
    k2, v2 = k.clone(), v.clone()
    k2[..., -1, :] += 3
    v2[..., -1, :] -= 5
    moved = replay(q, k2, v2, FP32, causal=True)
    assert torch.equal(moved.o[..., :-1, :], causal.o[..., :-1, :])


def test_lse_is_the_logsumexp_of_the_scaled_scores():
    q, k, v, _ = _inputs(T=64, dtype=torch.float64)
    out = replay(q, k, v, FP32, causal=True, scale=0.3)
    _, lse64, *_ = _fp64_attention(q.float().double(), k.float().double(), v.float().double(), v, True, 0.3)
    assert ((out.lse.double() - lse64).abs() / lse64.abs().clamp(min=1)).max() < 1e-6
