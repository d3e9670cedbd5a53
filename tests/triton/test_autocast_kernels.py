"""Interpreter runs of the kernels' autocast cast points (s_dtype, stats_dtype, rescale_dtype)
against the CPU emulator (ieee mode).

The paper's reference code rounds S after the dot and after × α, keeps m and ℓ in bf16 buffers
and rescales a bf16 accumulator (ReplayConfig.preset("bf16-autocast")). The kernels implement
these as constexpr casts in the emulator's order, so with the aligned exponential (the
emulator's exp := exp2(fp32(x·log2 e)), as in test_kernels_vs_emulator.py) O, lse, δ, dV
and the P̄ statistics are compared bit for bit; dQ and dK carry the same rare last-bit
differences as every other knob (dots with inexact fp32 products, see that file).
Shapes: B 1, H 2, T 50 (not a multiple of the block), D 32.
"""
import pytest
import torch

from kernel_pairs import exact_fraction, triton_and_emulator
from fa_forensics.errors import UserError
from fa_forensics.numerics import ulp_distance
from fa_forensics.replay import ReplayConfig, replay

B, H, T, D = 1, 2, 50, 32


def _inputs(seed=0, planted=False):
    """Random q, k, v, dO (B, H, T, D); planted: every query aligned with key 0, and key 1 a copy
    of it: exact in head 0 (each row's maximum is attained twice: the stabilized rule fires),
    scaled by 0.9965 in head 1 (a near tie ~0.04 below the maximum ~11: under one bf16 ulp, so
    bf16 scores tie exactly or one ulp apart, which ε = 0.05 counts only through the rounded
    threshold cast(r_m − ε) of the autocast reference)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    if planted:
        k[..., 1, :] = k[..., 0, :]
        k[:, 1, 1, :] = k[:, 1, 0, :] * 0.9965
        q = q * 0.3 + 2.0 * k[..., :1, :]
    return q, k, v, do


def _assert_bit_exact(tri, emu, name):
    """O, lse, δ, dV and the statistics bit for bit; dQ, dK ≥ 95% bit-identical, ≤ 4e-7 of max|g|."""
    assert tri.o.dtype == emu.o.dtype and tri.backend == "triton" and tri.accumulation == "ieee"
    for f in ("o", "lse", "delta", "dv"):
        assert torch.equal(getattr(tri, f).float(), getattr(emu, f).float()), f"{name}: {f} differs"
    for f in ("dq", "dk"):
        a, b = getattr(tri, f), getattr(emu, f)
        assert exact_fraction(a, b) >= 0.95, f"{name}: {f} exact fraction {exact_fraction(a, b)}"
        assert (a - b).abs().max() <= 4e-7 * b.abs().max(), f"{name}: {f}"
    assert tri.stats.total() == emu.stats.total(), name


# (id, preset, changes). Blocks of 16 unless changed; block_m 32 > block_n 16 gives rows that see
# no key of the diagonal KV block (they must keep m, ℓ and the accumulator unrounded).
CASES = [
    ("bf16-autocast", "bf16-autocast", {}),
    # not the fix as run (the loop stops at the diagonal)
    ("bf16-autocast-algorithm3", "bf16-autocast", {"softmax": "stabilized"}),
    ("bf16-autocast-algorithm3-beta4-eps", "bf16-autocast", {"softmax": "stabilized", "beta": 4.0, "eps": 0.05}),
    ("bf16-autocast-block-m-32", "bf16-autocast", {"block_m": 32}),
    ("bf16-autocast-algorithm3-block-m-32", "bf16-autocast", {"softmax": "stabilized", "block_m": 32}),
    ("bf16-autocast-reverse-kv", "bf16-autocast", {"kv_order": "reverse"}),
    ("bf16-autocast-fixed-offset", "bf16-autocast", {"softmax": "fixed-offset", "offset": 3.0}),
    ("s-bf16", "bf16", {"s_dtype": "bf16"}),
    ("stats-bf16", "bf16", {"stats_dtype": "bf16"}),
    ("rescale-bf16", "bf16", {"rescale_dtype": "bf16"}),
    ("rescale-bf16-pv-fp32-block-m-32", "bf16", {"rescale_dtype": "bf16", "pv_dtype": "fp32", "block_m": 32}),
    ("s-bf16-stabilized-eps", "stabilized", {"s_dtype": "bf16", "eps": 0.05}),
    ("s-fp16-stats-fp16", "bf16", {"s_dtype": "fp16", "stats_dtype": "fp16"}),
    ("s-bf16-delta-dp-p", "bf16", {"s_dtype": "bf16", "delta": "dp-p"}),
    ("s-bf16-delta-o-recomputed", "bf16", {"s_dtype": "bf16", "delta": "o-recomputed"}),
    ("bf16-autocast-delta-o-highp", "bf16-autocast", {"delta": "o-highp"}),
]


@pytest.mark.parametrize("name,preset,changes", CASES, ids=[c[0] for c in CASES])
def test_autocast_knob_bit_exact_with_aligned_exp(aligned, name, preset, changes):
    cfg = ReplayConfig.preset(preset).with_(**({"block_m": 16, "block_n": 16} | changes))
    stabilized = cfg.softmax.value == "stabilized"
    inputs = _inputs(planted=stabilized)
    tri, emu = triton_and_emulator(cfg, inputs)
    _assert_bit_exact(tri, emu, name)
    # the knob really acts: the same replay with S, m, ℓ and the rescale in fp32 gives other bits
    fp32_twin = cfg.with_(s_dtype="fp32", stats_dtype="fp32", rescale_dtype="fp32")
    q, k, v, _ = inputs
    o_twin = replay(q, k, v, fp32_twin, backend="triton", causal=True).o
    assert not torch.equal(tri.o, o_twin), f"{name}: the autocast knobs changed nothing"
    if stabilized:
        assert tri.stats.total()["stabilized_rows"] > 0  # the rule really fired


def test_bf16_autocast_preset_blocks_non_causal(aligned):
    """The preset as shipped (block_m 512 → 128 per program, one KV block of 512 ≥ T), no mask."""
    cfg = ReplayConfig.preset("bf16-autocast")
    tri, emu = triton_and_emulator(cfg, _inputs(seed=1), causal=False)
    _assert_bit_exact(tri, emu, "bf16-autocast non-causal")


def test_bf16_scores_tie_in_the_kernel_statistics(aligned):
    """Keys in pairs whose fp32 scores differ by far less than a bf16 ulp of the row max: the
    kernel's repeated-maximum count is small with fp32 scores and covers most rows with bf16 S."""
    g = torch.Generator().manual_seed(3)
    q = 4 * torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H, T, D, generator=g)
    k[..., 0::2, 0] = 0.0
    k[..., 1::2, :] = k[..., 0::2, :]
    k[..., 1::2, 0] = 2.0**-10
    v = torch.randn(B, H, T, D, generator=g)
    base = ReplayConfig.preset("bf16").with_(block_m=16, block_n=16)
    rows = {}
    for s_dtype in ("fp32", "bf16"):
        cfg = base.with_(s_dtype=s_dtype)
        tri = replay(q, k, v, cfg, backend="triton", causal=False)
        emu = replay(q, k, v, cfg, backend="emulate", causal=False)
        assert tri.stats.total() == emu.stats.total()
        rows[s_dtype] = tri.stats.total()["repeated_max_rows"]
    assert rows["fp32"] < 0.2 * H * T and rows["bf16"] > 0.5 * H * T, rows


def test_bf16_autocast_real_exponentials_within_stated_ulps():
    """Without alignment (exp_fp32 vs exp2(x·log2 e)): bf16 O ≥ 98% bit-identical and within
    1 bf16 ulp; lse within 2e-6 relative; fp32 gradients within 1e-4 of max |g|."""
    for softmax in ("standard", "stabilized"):
        cfg = ReplayConfig.preset("bf16-autocast").with_(block_m=16, block_n=16, softmax=softmax)
        tri, emu = triton_and_emulator(cfg, _inputs(seed=3, planted=softmax == "stabilized"))
        assert exact_fraction(tri.o, emu.o) >= 0.98, softmax
        assert ulp_distance(tri.o.float(), emu.o.float(), "bf16").abs().max() <= 1, softmax
        torch.testing.assert_close(tri.lse, emu.lse, rtol=2e-6, atol=0)
        for f in ("dq", "dk", "dv"):
            a, b = getattr(tri, f), getattr(emu, f)
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (softmax, f)
        assert tri.stats.total() == emu.stats.total(), softmax


def test_stochastic_rounding_with_autocast_knobs_is_still_refused_in_one_line():
    q, k, v, _ = _inputs()
    with pytest.raises(UserError, match="stochastic"):
        replay(q, k, v, ReplayConfig.preset("bf16-autocast").with_(rounding="stochastic"), backend="triton")


def test_the_reference_loop_and_backward_are_refused_where_they_change_the_bits(aligned):
    q, k, v, do = _inputs()
    with pytest.raises(UserError, match="fully masked KV blocks"):
        replay(q, k, v, ReplayConfig.preset("bf16-autocast-stabilized"), backend="triton")
    with pytest.raises(UserError, match="reference code's bf16 one"):
        replay(q, k, v, ReplayConfig.preset("bf16-autocast-train"), do, backend="triton")
    # with the standard softmax the loop as run is exact: the training recipe's forward runs
    cfg = ReplayConfig.preset("bf16-autocast-train").with_(block_m=16, block_n=16)
    tri, emu = triton_and_emulator(cfg, (q, k, v, None))
    assert torch.equal(tri.o, emu.o)
