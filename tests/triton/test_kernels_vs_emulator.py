"""Interpreter runs of the Triton kernels against the CPU emulator (ieee mode), one test per knob.

Two exponentials: the emulator's exp_fp32(x) and the kernels' exp2(x·log2 e) differ in the last
bit of fp32 for about 60% of inputs. With `aligned` (the emulator's exp := exp2(fp32(x·log2 e)), both
2ˣ rounded once by numerics.exp2_fp32) every output, O, lse, δ, dQ, dK and dV, is compared bit for
bit; without it, stated tolerances apply.
Shapes: B 1, H 2, T 50 (not a multiple of the block: masking of padded rows/keys), D 32.
"""
import pytest
import torch

import interpreter_compat
from kernel_pairs import exact_fraction, triton_and_emulator
from fa_forensics.errors import UserError
from fa_forensics.replay import ReplayConfig, replay

B, H, T, D = 1, 2, 50, 32
FIELDS = ("o", "lse", "delta", "dq", "dk", "dv")


def _inputs(seed=0, planted=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    if planted:  # every row's maximum attained twice: keys 0 and 1 identical, q aligned with them
        k[..., 1, :] = k[..., 0, :]
        q = q * 0.3 + 2.0 * k[..., :1, :]
    return q, k, v, do


# (id, preset, changes). Blocks of 16 unless the knob is the tiling itself.
KNOBS = [
    ("bf16-default", "bf16", {}),
    ("fp32-all", "fp32", {}),
    ("fp16-inputs", "bf16", {"input_dtype": "fp16", "p_dtype": "fp16", "pv_dtype": "fp16", "o_dtype": "fp16"}),
    ("pv-fp32-hw-accumulator", "bf16", {"pv_dtype": "fp32"}),
    ("o-fp32", "bf16", {"o_dtype": "fp32"}),
    ("p-fp32", "bf16", {"p_dtype": "fp32"}),
    ("reverse-kv", "bf16", {"kv_order": "reverse"}),
    ("untiled", "bf16", {"block_n": None, "block_m": None}),
    ("block-m-32", "bf16", {"block_m": 32}),
    ("stabilized", "stabilized", {}),
    ("stabilized-beta8-eps", "stabilized", {"beta": 8.0, "eps": 0.05}),
    ("fixed-offset", "bf16", {"softmax": "fixed-offset", "offset": 3.0}),
    ("fp8-s256-multiply", "fp8-s256", {"p_scale_mode": "multiply"}),
    ("fp8-s448-multiply-e5m2", "fp8-s448", {"p_scale_mode": "multiply", "p_dtype": "fp8_e5m2"}),
    ("delta-o-highp", "bf16", {"delta": "o-highp"}),
    ("delta-o-recomputed", "bf16", {"delta": "o-recomputed"}),
    ("delta-dp-p", "bf16", {"delta": "dp-p"}),
    ("ds-bf16", "bf16", {"ds_dtype": "bf16"}),
]


@pytest.mark.parametrize("name,preset,changes", KNOBS, ids=[k[0] for k in KNOBS])
def test_knob_bit_exact_with_aligned_exp(aligned, name, preset, changes):
    cfg = ReplayConfig.preset(preset).with_(**({"block_m": 16, "block_n": 16} | changes))
    tri, emu = triton_and_emulator(cfg, _inputs(planted="stabilized" in name))
    assert tri.o.dtype == emu.o.dtype and tri.backend == "triton" and tri.accumulation == "ieee"
    for f in FIELDS:  # every output bit for bit, the gradients included
        assert torch.equal(getattr(tri, f).float(), getattr(emu, f).float()), f"{name}: {f} differs"
    assert tri.stats.total() == emu.stats.total()
    if "stabilized" in name:
        assert tri.stats.total()["stabilized_rows"] > 0  # the rule really fired


def test_fp8_exponent_offset_within_ulps(aligned):
    """FA3's exponent offset: the kernel adds log2 S in the exp2 domain, the emulator ln S before
    exp, so P·S may differ by an fp32 ulp before the e4m3 cast: O within 1e-3 relative."""
    cfg = ReplayConfig.preset("fp8-s256").with_(block_m=16, block_n=16)
    tri, emu = triton_and_emulator(cfg, _inputs())
    assert exact_fraction(tri.o, emu.o) >= 0.9
    torch.testing.assert_close(tri.o, emu.o, rtol=1e-3, atol=1e-5)
    assert tri.stats.total()["p_one_count"] == emu.stats.total()["p_one_count"]


def test_non_causal(aligned):
    cfg = ReplayConfig.preset("bf16").with_(block_m=16, block_n=16)
    tri, emu = triton_and_emulator(cfg, _inputs(), causal=False)
    for f in ("o", "lse", "delta", "dv"):
        assert torch.equal(getattr(tri, f).float(), getattr(emu, f).float()), f


def test_real_exponentials_within_stated_ulps():
    """Without alignment (exp_fp32 vs exp2(x·log2 e)): bf16 O differs in < 2% of entries, by
    at most 1 bf16 ulp; lse within 2e-6 relative; fp32 gradients within 1e-4 of max |g|."""
    from fa_forensics.numerics import ulp_distance

    cfg = ReplayConfig.preset("bf16").with_(block_m=16, block_n=16)
    tri, emu = triton_and_emulator(cfg, _inputs(seed=3))
    assert exact_fraction(tri.o, emu.o) >= 0.98
    assert ulp_distance(tri.o.float(), emu.o.float(), "bf16").abs().max() <= 1
    torch.testing.assert_close(tri.lse, emu.lse, rtol=2e-6, atol=0)
    for f in ("dq", "dk", "dv"):
        a, b = getattr(tri, f), getattr(emu, f)
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), f


def test_stochastic_rounding_is_refused_in_one_line():
    q, k, v, _ = _inputs()
    with pytest.raises(UserError, match="stochastic"):
        replay(q, k, v, ReplayConfig.preset("stochastic"), backend="triton")


def test_without_a_dO_there_are_no_gradients():
    q, k, v, _ = _inputs()
    out = replay(q, k, v, ReplayConfig.preset("bf16"), backend="triton")
    assert out.dq is None and out.delta is None and out.o.dtype == torch.bfloat16 and out.lse.shape == (B, H, T)


TENSOR_CORE_KNOBS = [
    ("bf16-hw", "bf16-hw", {}),
    ("ds-bf16", "bf16", {"ds_dtype": "bf16"}),
    ("fp16-ds-fp16", "bf16", {"input_dtype": "fp16", "p_dtype": "fp16", "pv_dtype": "fp16", "o_dtype": "fp16",
                              "ds_dtype": "fp16"}),
    ("fp8-p-multiply", "fp8-s256", {"input_dtype": "bf16", "p_scale_mode": "multiply", "block_m": 32, "block_n": 32}),
]


@pytest.mark.parametrize("name,preset,changes", TENSOR_CORE_KNOBS, ids=[k[0] for k in TENSOR_CORE_KNOBS])
def test_tensor_core_dots_bit_exact_with_aligned_exp(aligned, monkeypatch, name, preset, changes):
    """Dots of bf16 / fp16 / fp8 operands in the tensor-core model (as a GPU's MMA runs them), fp32 dots
    ieee: every output of the kernels equals the emulator's under accumulation=tensor-core, bit for bit
    (fp8's group F is 32 on the H100, so its blocks are 32)."""
    interpreter_compat.use_tensor_cores(monkeypatch, "h100")
    cfg = ReplayConfig.preset(preset).with_(**({"block_m": 16, "block_n": 16, "accumulation": "tensor-core"} | changes))
    inputs = _inputs()
    tri, emu = triton_and_emulator(cfg, inputs)
    for f in FIELDS:
        assert torch.equal(getattr(tri, f).float(), getattr(emu, f).float()), f"{name}: {f} differs"
    ieee = replay(*inputs[:3], cfg.with_(accumulation="ieee"), inputs[3], backend="emulate")
    assert not torch.equal(ieee.dv, tri.dv), "the two accumulation models should differ on these inputs"
