"""The autocast presets against the explicit-cast transcription of the paper's reference code
(tests/helpers/paper_reference.py; CPU autocast's op lists differ from CUDA's, so it is not used),
and what each autocast knob does on its own."""
import pytest
import torch

from paper_reference import paper_forward
from fa_forensics.replay import ReplayConfig, replay

BF16 = torch.bfloat16


def _inputs(T, D, seed, ties):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(1, 3, T, D, generator=g)).to(BF16)
    k = (2 * torch.randn(1, 3, T, D, generator=g)).to(BF16)
    v = torch.randn(1, 3, T, D, generator=g).to(BF16)
    if ties:  # pairs of identical keys: repeated row maxima, the stabilized rule fires
        k[..., 1::2, :] = k[..., 0::2, :]
        q[..., 1::3, :] = k[..., 0::3, :][..., : q[..., 1::3, :].shape[-2], :] * 2
    return q, k, v


@pytest.mark.parametrize("preset,stable", [("bf16-autocast", False), ("bf16-autocast-stabilized", True)])
def test_autocast_presets_equal_the_reference_code_bit_for_bit(preset, stable):
    T, D = 640, 24  # two blocks of 512 (the second ragged); α = 1/sqrt(24) is not a power of two
    q, k, v = _inputs(T, D, seed=1, ties=stable)
    out = replay(q, k, v, ReplayConfig.preset(preset), causal=True)
    want, _ = paper_forward(q, k, v, stable=stable)
    assert out.o.dtype == BF16
    assert torch.equal(out.o.view(torch.int16), want.view(torch.int16))
    if stable:  # the test exercised the rule
        assert out.stats.stabilized_rows.sum() > 100


def test_each_autocast_knob_changes_the_bits_and_the_default_preset_does_not():
    q, k, v = _inputs(640, 24, seed=2, ties=False)
    base = ReplayConfig.preset("bf16").with_(block_n=512)
    o_base = replay(q, k, v, base, causal=True).o
    ref, _ = paper_forward(q, k, v)
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
    bf16_s = replay(q, k, v, ReplayConfig.preset("bf16").with_(s_dtype="bf16"),
                    causal=False).stats.repeated_max_rows.sum().item()
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
