"""Every ReplayConfig knob has a real effect (or a stated invariant) in the emulator."""
import math

import pytest
import torch

from fa_forensics.errors import ConfigError
from fa_forensics.numerics import round_to
from fa_forensics.replay import Precision, ReplayConfig, replay

BF16 = ReplayConfig.preset("bf16")
FP32 = ReplayConfig.preset("fp32")


def _inputs(B=1, H=2, T=64, D=16, seed=0, q_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(B, H, T, D, generator=g)
    k = 2 * torch.randn(B, H, T, D, generator=g)
    v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(2))
    return q, k, v, do


def _err(out, ref):
    return (out.o.float() - ref.o.float()).abs().max().item()


def test_input_dtype_rounds_the_inputs_once():
    q, k, v, _ = _inputs()
    q64, k64, v64 = (x.double() + 1e-9 for x in (q, k, v))  # values between fp32 numbers
    direct = replay(q64, k64, v64, BF16)
    pre = replay(*(round_to(x, "bf16").float() for x in (q64, k64, v64)), BF16)
    assert torch.equal(direct.o, pre.o)  # fp64 inputs are rounded once to bf16, not via fp32
    fp16 = replay(q, k, v, BF16.with_(input_dtype="fp16"))
    assert not torch.equal(fp16.o, direct.o)


@pytest.mark.parametrize("p_dtype,bound", [("fp32", 1e-6), ("bf16", 2**-7), ("fp16", 2**-9), ("fp8_e4m3", 2**-2)])
def test_p_dtype_error_grows_with_fewer_bits(p_dtype, bound):
    q, k, v, _ = _inputs()
    ref = replay(q, k, v, FP32)
    out = replay(q, k, v, FP32.with_(p_dtype=p_dtype))
    err = _err(out, ref)
    assert err <= bound
    if p_dtype != "fp32":
        assert err > bound / 64  # the cast really rounds


def test_pv_and_o_dtype_set_the_output_dtype_and_rounding():
    q, k, v, _ = _inputs()
    for o_dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
                                 ("fp8_e4m3", torch.float8_e4m3fn)):
        out = replay(q, k, v, FP32.with_(o_dtype=o_dtype))
        assert out.o.dtype == torch_dtype
    ref = replay(q, k, v, FP32)
    pv16 = replay(q, k, v, FP32.with_(pv_dtype="bf16"))
    assert 0 < _err(pv16, ref) <= 2**-7 * v.abs().max()


def test_fp8_p_scale_reduces_underflow_and_error():
    # FP8 paper: a sink takes P̄ = 1 and the other keys sit Δ ≈ 8 below it: P̄ ≈ e^-8 < 2^-9, the
    # smallest E4M3 subnormal, so with S = 1 they are zeroed; S = 256 keeps them
    T, D = 64, 16
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 2, T, D)
    q[..., 0] = 1.0
    k = 0.1 * torch.randn(1, 2, T, D, generator=g)
    k[..., 0] = -8 + 0.5 * torch.randn(1, 2, T, generator=g)
    k[..., 0, 0] = 0.0  # the sink
    v = torch.randn(1, 2, T, D, generator=g)
    kw = dict(causal=False, scale=1.0)
    ref = replay(q, k, v, FP32, **kw)
    s1 = replay(q, k, v, ReplayConfig.preset("fp8-s1"), **kw)
    s256 = replay(q, k, v, ReplayConfig.preset("fp8-s256"), **kw)
    assert int(s1.stats.p_zeroed.sum()) > 10 * int(s256.stats.p_zeroed.sum())
    assert _err(s256, ref) * 4 < _err(s1, ref)
    assert s1.o.dtype == torch.float32  # the preset keeps O in fp32 to isolate the P cast
    # the P̄ == 1 count is in unscaled terms (entries equal to S after the cast): the sink, per row
    assert torch.equal(s1.stats.p_one_count, torch.full((1, 2), T)) and torch.equal(s256.stats.p_one_count,
                                                                                    s1.stats.p_one_count)


def test_p_scale_modes_give_different_bits():
    # exp(s - m + ln S) and exp(s - m)·S differ in the last fp32 bits; an E4M3 cast (3 fraction
    # bits) almost always hides that, so look with P̄ kept in fp32
    q, k, v, _ = _inputs(q_scale=3.0)
    cfg = ReplayConfig.preset("fp8-s448").with_(p_dtype="fp32")
    offset = replay(q, k, v, cfg.with_(p_scale_mode="exponent-offset"))
    mult = replay(q, k, v, cfg.with_(p_scale_mode="multiply"))
    assert not torch.equal(offset.o, mult.o)
    ref = replay(q, k, v, FP32)
    assert max(_err(offset, ref), _err(mult, ref)) < 1e-5


def test_block_m_does_not_change_numerics():
    # rows are independent: the emulator's result does not depend on the query tile size
    q, k, v, do = _inputs()
    a = replay(q, k, v, BF16.with_(block_n=16), do=do)
    b = replay(q, k, v, BF16.with_(block_n=16, block_m=8), do=do)
    assert torch.equal(a.o, b.o) and torch.equal(a.dq, b.dq)


def test_scale_argument_overrides_config_and_defaults_to_inverse_sqrt_d():
    q, k, v, _ = _inputs()
    default = replay(q, k, v, FP32)
    explicit = replay(q, k, v, FP32, scale=1 / math.sqrt(16))
    from_config = replay(q, k, v, FP32.with_(scale=0.5))
    overridden = replay(q, k, v, FP32.with_(scale=0.5), scale=1 / math.sqrt(16))
    assert torch.equal(default.o, explicit.o) and torch.equal(default.o, overridden.o)
    assert not torch.equal(default.o, from_config.o)
    assert torch.equal(replay(q, k, v, FP32.with_(causal=False)).o, replay(q, k, v, FP32, causal=False).o)


def test_stabilized_beta_eps_and_negative_maxima():
    T, D = 16, 4
    q = torch.zeros(1, 1, T, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, T, D)
    k[..., :, 0] = torch.linspace(-4, -1, T)
    k[..., 3, 0] = k[..., 5, 0] = 2.0  # rows >= 5: positive maximum attained twice
    k[..., 7, 0] = 2.0 - 2e-4  # a near-tie: counted with eps = 1e-3, not with eps = 0
    v = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(1))
    kw = dict(causal=True, scale=1.0)
    std = replay(q, k, v, BF16, **kw)
    b2 = replay(q, k, v, BF16.with_(softmax="stabilized", beta=2.0), **kw)
    b8 = replay(q, k, v, BF16.with_(softmax="stabilized", beta=8.0), **kw)
    eps0 = replay(q, k, v, BF16.with_(softmax="stabilized", eps=0.0), **kw)
    assert int(b2.stats.stabilized_rows) == T - 5 and int(b2.stats.p_one_count) == 5
    # standard: row i < 5 one P̄ == 1; rows 5, 6 two (the tie); rows >= 7 three, because the
    # near-tie key 2 - 2e-4 rounds to 2 in bf16 inputs: a third exact maximum
    assert int(std.stats.p_one_count) == 5 + 2 * 2 + 3 * (T - 7)
    assert not torch.equal(b2.o, b8.o)
    assert torch.equal(b2.lse, std.lse) or (b2.lse - std.lse).abs().max() < 1e-5  # same lse, other shift
    # eps = 0 still fires on exact ties; a near-tie alone (fp32 inputs) fires only with eps > 2e-4
    assert int(eps0.stats.stabilized_rows) == T - 5
    k2 = k.clone()
    k2[..., 5, 0] = 2.0 - 2e-4  # now the only "tie" is a near-tie (keys 3 and 5 differ by 2e-4)
    k2[..., 7, 0] = -3.0
    fp32_stab = FP32.with_(softmax="stabilized")  # fp32 inputs: 2 - 2e-4 would round to 2 in bf16
    near = replay(q, k2, v, fp32_stab, **kw)
    exact = replay(q, k2, v, fp32_stab.with_(eps=0.0), **kw)
    assert int(near.stats.stabilized_rows) == T - 5 and int(exact.stats.stabilized_rows) == 0
    # negative repeated maximum: m = 0, so max(S - m) < 0 and no P̄ == 1 on those rows
    kn = torch.zeros(1, 1, T, D)
    kn[..., :, 0] = torch.linspace(-8, -6, T)
    kn[..., 3, 0] = kn[..., 5, 0] = -1.0
    neg = replay(q, kn, v, BF16.with_(softmax="stabilized"), **kw)
    assert int(neg.stats.stabilized_rows) == T - 5 and int(neg.stats.p_one_count) == 5


def test_stabilized_shift_is_per_block_a_tie_split_across_blocks_is_missed():
    # Algorithm 3 counts r_s inside one KV block: a maximum attained once in each of two blocks
    # is not a repeated maximum for it, and P̄ == 1 survives (a real limit of the fix)
    T, D = 16, 4
    q = torch.zeros(1, 1, T, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, T, D)
    k[..., :, 0] = torch.linspace(-4, -3, T)  # distinct background scores
    k[..., 2, 0] = k[..., 10, 0] = 2.0
    v = torch.randn(1, 1, T, D)
    cfg = BF16.with_(softmax="stabilized")
    untiled = replay(q, k, v, cfg, scale=1.0)
    tiled = replay(q, k, v, cfg.with_(block_n=8), scale=1.0)
    assert int(untiled.stats.stabilized_rows) == T - 10
    assert int(tiled.stats.stabilized_rows) == 0 and int(tiled.stats.repeated_max_rows) == T - 10


def test_stochastic_rounding_is_seeded():
    q, k, v, _ = _inputs()
    cfg = ReplayConfig.preset("stochastic")
    a, b = replay(q, k, v, cfg), replay(q, k, v, cfg)
    c = replay(q, k, v, cfg.with_(seed=1))
    assert torch.equal(a.o, b.o) and not torch.equal(a.o, c.o)
    ref = replay(q, k, v, FP32)
    assert _err(a, ref) <= 2**-6 * v.abs().max()


def test_delta_o_lowp_is_rowsum_of_do_times_stored_o_and_ds_dtype_only_touches_dq_dk():
    q, k, v, do = _inputs()
    out = replay(q, k, v, BF16, do=do)
    do_bf = do.to(torch.bfloat16).double()
    assert torch.allclose(out.delta.double(), (do_bf * out.o.double()).sum(-1), rtol=0, atol=1e-5)
    ds16 = replay(q, k, v, BF16.with_(ds_dtype="bf16"), do=do)
    assert torch.equal(ds16.dv, out.dv) and torch.equal(ds16.delta, out.delta)
    assert not torch.equal(ds16.dq, out.dq) and not torch.equal(ds16.dk, out.dk)
    assert (ds16.dq - out.dq).abs().max() <= 2**-7 * out.dq.abs().max()


@pytest.mark.parametrize("source", ["o-lowp", "o-highp", "o-recomputed", "dp-p"])
def test_each_delta_source_gives_correct_gradients_in_fp32(source):
    q, k, v, do = _inputs(T=32)
    exact = replay(q, k, v, FP32, do=do)
    out = replay(q, k, v, FP32.with_(delta=source), do=do)
    assert (out.delta - exact.delta).abs().max() < 1e-5
    assert (out.dq - exact.dq).abs().max() < 1e-5 * exact.dq.abs().max() + 1e-6


def test_accumulation_models_and_gpu():
    q, k, v, do = _inputs()
    hw = ReplayConfig.preset("bf16-hw")  # tensor-core, pv in fp32
    tc = replay(q, k, v, hw, do=do)
    ieee = replay(q, k, v, hw.with_(accumulation="ieee"), do=do)
    assert tc.accumulation == "tensor-core" and ieee.accumulation == "ieee"
    assert not torch.equal(tc.dq, ieee.dq)  # truncating alignment changes the bits
    assert (tc.dq - ieee.dq).abs().max() < 1e-4 * ieee.dq.abs().max()
    a100 = replay(q, k, v, hw.with_(gpu="a100"), do=do)
    assert not torch.equal(a100.dq, tc.dq)  # F = 8, neab = 1 vs F = 16, neab = 2
    # ieee ignores the gpu; all-fp32 inputs fall back to ieee under tensor-core too
    assert torch.equal(replay(q, k, v, hw.with_(accumulation="ieee", gpu="a100")).o, ieee.o)
    assert torch.equal(replay(q, k, v, FP32.with_(accumulation="tensor-core")).o, replay(q, k, v, FP32).o)


def test_every_precision_is_a_dtype_knob_with_its_own_resolution():
    """Every Precision works as every dtype knob, and its error against fp32 follows its significand:
    fp32 exact, then fp16 (11 bits) < bf16 (8) < fp8 e4m3 (4) < e5m2 (3), each within a few of its ulps."""
    q, k, v, _ = _inputs(T=16)
    ref = replay(q, k, v, FP32).o.double()
    bits = {Precision.FP32: 24, Precision.FP16: 11, Precision.BF16: 8, Precision.FP8_E4M3: 4, Precision.FP8_E5M2: 3}
    assert set(bits) == set(Precision)
    err = {}
    for p in Precision:
        out = replay(q, k, v, FP32.with_(input_dtype=p, p_dtype=p, pv_dtype=p, o_dtype=p))
        err[p] = float((out.o.double() - ref).abs().max())
        assert err[p] <= 8 * 2.0 ** -bits[p] * float(ref.abs().max()), p  # a few ulps of |O|max
    ordered = sorted(Precision, key=lambda p: -bits[p])
    assert err[Precision.FP32] == 0 and all(err[a] < err[b] for a, b in zip(ordered, ordered[1:])), err


def test_an_lse_form_needs_a_base2_exp_form():
    """lse_form names how a base-2 kernel writes its lse; with the emulator's exp it would do nothing: refused."""
    with pytest.raises(ConfigError, match="lse_form=scaled-div with exp_form=exp"):
        ReplayConfig.preset("bf16").with_(lse_form="scaled-div")
    plain = ReplayConfig.preset("sdpa-cudnn-sm90").without_kernel_model()
    assert not plain.is_kernel_model and (plain.block_m, plain.block_n) == (128, 128)
