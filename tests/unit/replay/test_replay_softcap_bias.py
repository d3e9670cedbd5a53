"""The soft-cap knob (ReplayConfig.softcap) and an additive bias in the exp2 kernel models, against float64
attention: forward O and lse, and the backward's dQ, dK, dV against autograd."""
from __future__ import annotations

import math

import pytest
import torch

from fa_forensics.errors import ConfigError
from fa_forensics.replay import ReplayConfig, replay

CAP = 5.0


def _inputs(seed=0, B=1, H=2, T=24, D=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) * s for s in (2.0, 2.0, 1.0, 1.0))
    return q, k, v, do


def _alibi(H, T):
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]).view(1, H, 1, 1)
    pos = torch.arange(T)
    return slopes * (pos.view(1, -1) - pos.view(-1, 1)).clamp(max=0).float()


def _reference(q, k, v, do, *, scale, causal, cap=None, bias=None):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    x = q64 @ k64.transpose(-1, -2) * scale
    s = cap * torch.tanh(x / cap) if cap else x
    if bias is not None:
        s = s + bias.double()
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o = torch.softmax(s, -1) @ v64
    o.backward(do.double())
    return o.detach(), torch.logsumexp(s, -1).detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("preset", ["fp32", "flash-attn-2", "sdpa-flash"])
def test_softcap_forward_and_backward_follow_float64(preset):
    q, k, v, do = _inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    config = ReplayConfig.preset(preset).with_(input_dtype="fp32", p_dtype="fp32", o_dtype="fp32", softcap=CAP)
    if preset != "fp32":
        config = config.with_(backward_kernel="reference")
    out = replay(q, k, v, config, do, causal=True, scale=scale)
    o, lse, dq, dk, dv = _reference(q, k, v, do, scale=scale, causal=True, cap=CAP)
    plain = replay(q, k, v, config.with_(softcap=None), causal=True, scale=scale)
    assert (plain.o.double() - o).abs().max() > 1e-2  # the cap matters on these scores
    assert torch.allclose(out.o.double(), o, atol=1e-5)
    assert torch.allclose(out.lse.double(), lse, atol=1e-5)
    for got, want in ((out.dq, dq), (out.dk, dk), (out.dv, dv)):
        assert torch.allclose(got.double(), want, atol=1e-4), (got.double() - want).abs().max()


@pytest.mark.parametrize("preset", ["flash-attn-2", "sdpa-flash", "sdpa-cudnn-sm90", "sdpa-efficient"])
def test_an_additive_bias_replays_in_every_kernel_model(preset):
    q, k, v, _ = _inputs(1)
    bias = _alibi(q.shape[1], q.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1])
    config = ReplayConfig.preset(preset).with_(input_dtype="fp32", p_dtype="fp32", o_dtype="fp32")
    out = replay(q, k, v, config, causal=True, scale=scale, mask=bias)
    o, lse, *_ = _reference(q, k, v, torch.zeros_like(q), scale=scale, causal=True, bias=bias)
    assert torch.allclose(out.o.double(), o, atol=1e-5)
    bf16 = ReplayConfig.preset(preset)  # the recorded precision: bf16 inputs and P̄
    low = replay(q, k, v, bf16, causal=True, scale=scale, mask=bias)
    assert (low.o.double() - o).abs().max() < 0.05


def test_softcap_must_be_positive():
    with pytest.raises(ConfigError, match="softcap"):
        ReplayConfig(softcap=0.0)
    with pytest.raises(ConfigError, match="soft-cap"):
        q, k, v, do = _inputs()
        replay(q, k, v, ReplayConfig.preset("flash-attn-2").with_(softcap=CAP), do, causal=True)


def test_each_kernel_model_adds_the_bias_where_its_kernel_does():
    from fa_forensics.replay.emulate.forward import exp2_scale, raw_scores

    q, k, _, _ = _inputs(4, T=8)
    bias = _alibi(q.shape[1], 8)
    flash, efficient = ReplayConfig.preset("flash-attn-2"), ReplayConfig.preset("sdpa-efficient")
    assert exp2_scale(flash, 0.25, bias) == 0.25 and exp2_scale(efficient, 0.25, bias) == 1.0
    assert exp2_scale(efficient, 0.25, bias > -1) == 0.25 and exp2_scale(flash.with_(softcap=CAP), 0.25, bias) == CAP
    plain = raw_scores(q, k, efficient.with_(accumulation="ieee"), False, 0, 0)
    scaled = raw_scores(q, k, efficient.with_(accumulation="ieee"), False, 0, 0, bias, scale=0.25)
    assert torch.equal(scaled, plain * torch.tensor(0.25) + bias)  # fp32(fp32(S·α) + bias)
    folded = raw_scores(q, k, flash.with_(accumulation="ieee"), False, 0, 0, bias, scale=0.25)
    assert torch.equal(folded, plain + bias / torch.tensor(0.25))  # FlashAttention-2's ALiBi: S + fp32(bias / α)
