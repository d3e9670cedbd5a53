"""The bf16-autocast preset against a line-by-line re-implementation of the paper's reference code.

The reference FlashAttention-2 is pure PyTorch run under CUDA BF16 autocast. Its forward is
rewritten below with every cast explicit (CPU autocast's op lists differ from CUDA's, so it is not
used): the two matmuls go through numerics.matmul (ieee) so that both sides share one
accumulation model; everything else is a plain bf16 / fp32 tensor op in the reference's order.
"""
import math

import pytest
import torch

from fa_forensics.numerics import matmul
from fa_forensics.replay import ReplayConfig, replay

BF16 = torch.bfloat16


def _mm_bf16(a, b):
    """An autocast matmul: bf16 operands, fp32 accumulation (ieee), bf16 output."""
    return matmul(a.float(), b.float(), "ieee").to(BF16)


def _reference_forward(q, k, v, *, block=512, stabilized=False, beta=2.0, eps=1e-3):
    """The reference code's causal forward; q, k, v (B, H, T, D) bf16 -> O (B, H, T, D) bf16."""
    B, H, T, D = q.shape
    scale = 1.0 / math.sqrt(D)
    o = torch.empty(B, H, T, D, dtype=BF16)
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        oc = torch.zeros(B, H, i1 - i0, D, dtype=BF16)  # O accumulator, bf16
        m = torch.full((B, H, i1 - i0), float("-inf"), dtype=BF16)  # row max buffer, q.dtype
        ell = torch.zeros(B, H, i1 - i0, dtype=BF16)  # row sum buffer, q.dtype
        for j0 in range(0, i1, block):  # causal: key blocks up to the diagonal
            j1 = min(j0 + block, T)
            S = _mm_bf16(q[..., i0:i1, :], k[..., j0:j1, :].transpose(-1, -2))  # einsum -> bf16
            S = (S.float() * torch.tensor(scale, dtype=torch.float32)).to(BF16)  # * scale -> bf16
            mask = torch.arange(j0, j1)[None, :] > torch.arange(i0, i1)[:, None]
            S = S.masked_fill(mask, float("-inf"))
            r_m = S.amax(dim=-1)  # bf16
            if stabilized:  # Algorithm 3 on bf16 tensors
                r_s = (S >= (r_m - eps).unsqueeze(-1)).sum(dim=-1)  # r_m - 1e-3 rounds to bf16
                r_m = torch.where((r_m > 0) & (r_s > 1), beta * r_m, r_m)
                r_m = torch.where((r_m < 0) & (r_s > 1), torch.zeros_like(r_m), r_m)
            m_new = torch.maximum(m, r_m)  # bf16
            P = torch.exp((S - m_new.unsqueeze(-1)).float())  # bf16 difference, exp in fp32
            factor = torch.exp((m - m_new).float())  # fp32
            ell[:] = factor * ell.float() + P.double().sum(dim=-1).float()  # stored bf16
            pv = _mm_bf16(P.to(BF16), v[..., j0:j1, :])  # einsum -> bf16
            oc.mul_(factor.unsqueeze(-1))  # bf16 buffer times an fp32 factor
            oc.add_(pv)
            m[:] = m_new
        o[..., i0:i1, :] = oc / ell.unsqueeze(-1)  # bf16
    return o


def _inputs(T, D, seed, ties):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(1, 3, T, D, generator=g)).to(BF16)
    k = (2 * torch.randn(1, 3, T, D, generator=g)).to(BF16)
    v = torch.randn(1, 3, T, D, generator=g).to(BF16)
    if ties:  # pairs of identical keys: repeated row maxima, the stabilized rule fires
        k[..., 1::2, :] = k[..., 0::2, :]
        q[..., 1::3, :] = k[..., 0::3, :][..., : q[..., 1::3, :].shape[-2], :] * 2
    return q, k, v


@pytest.mark.parametrize("softmax", ["standard", "stabilized"])
def test_bf16_autocast_preset_equals_the_reference_code_bit_for_bit(softmax):
    T, D = 640, 24  # two blocks of 512 (the second ragged); α = 1/sqrt(24) is not a power of two
    q, k, v = _inputs(T, D, seed=1, ties=softmax == "stabilized")
    cfg = ReplayConfig.preset("bf16-autocast").with_(softmax=softmax)
    got = replay(q, k, v, cfg, causal=True).o
    want = _reference_forward(q, k, v, stabilized=softmax == "stabilized")
    assert got.dtype == BF16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if softmax == "stabilized":  # the test exercised the rule
        assert replay(q, k, v, cfg, causal=True).stats.stabilized_rows.sum() > 100


def test_each_autocast_knob_changes_the_bits_and_the_default_preset_does_not():
    q, k, v = _inputs(640, 24, seed=2, ties=False)
    base = ReplayConfig.preset("bf16").with_(block_n=512)
    o_base = replay(q, k, v, base, causal=True).o
    ref = _reference_forward(q, k, v)
    assert not torch.equal(o_base, ref)  # the hardware reading is not the reference code
    for knob in ("s_dtype", "stats_dtype", "rescale_dtype"):
        o = replay(q, k, v, base.with_(**{knob: "bf16"}), causal=True).o
        assert not torch.equal(o, o_base), knob
    assert ReplayConfig().s_dtype.value == ReplayConfig().stats_dtype.value == "fp32"


def test_bf16_scores_make_near_ties_exact_ties():
    """Key pairs differing in one small coordinate give scores closer than a bf16 ulp of the
    row max: distinct in fp32, mostly equal once S is rounded to bf16 (repeated maxima)."""
    g = torch.Generator().manual_seed(3)
    T, D = 64, 16
    q = (4 * torch.randn(1, 2, T, D, generator=g)).to(BF16)
    k = torch.randn(1, 2, T, D, generator=g).to(BF16)
    k[..., 0::2, 0] = 0.0
    k[..., 1::2, :] = k[..., 0::2, :]
    k[..., 1::2, 0] = 2.0**-10  # the pair's scores differ by α·q_0·2^-10, far below a bf16 ulp of the max
    v = torch.randn(1, 2, T, D, generator=g).to(BF16)
    fp32_s = replay(q, k, v, ReplayConfig.preset("bf16"), causal=False).stats.repeated_max_rows.sum().item()
    bf16_s = replay(q, k, v, ReplayConfig.preset("bf16").with_(s_dtype="bf16"), causal=False).stats.repeated_max_rows.sum().item()
    assert fp32_s < 0.2 * 2 * T and bf16_s > 0.5 * 2 * T, (fp32_s, bf16_s)


def test_backward_runs_with_bf16_scores_and_recomputes_p_from_lse():
    q, k, v = _inputs(96, 16, seed=4, ties=False)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(BF16)
    cfg = ReplayConfig.preset("bf16-autocast").with_(block_m=32, block_n=32)
    out = replay(q, k, v, cfg, do=do)
    ref = replay(q, k, v, ReplayConfig.preset("fp32"), do=do)
    for got, want in ((out.dq, ref.dq), (out.dk, ref.dk), (out.dv, ref.dv)):
        err = (got - want).abs().max() / want.abs().max()
        assert 0 < err < 0.05  # bf16-level differences, nothing broken
