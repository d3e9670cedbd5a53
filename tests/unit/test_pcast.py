"""The FP8 P-cast study: E4M3 line and dp(S), closed form, kernel, simulation, dump mode."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fa_forensics.analyses import pcast as pc
from fa_forensics.analyses.stats import paired_ratio, paired_ttest


# --- E4M3 number line and dp(S) ----------------------------------------------------------------

def test_e4m3_line_has_126_positive_values_from_2_pow_minus_9_to_448():
    v = pc.e4m3_positive_values()
    assert v.numel() == 126
    assert float(v[0]) == 2.0 ** -9 and float(v[-1]) == 448.0
    assert bool((v[1:] > v[:-1]).all())


def test_dp_of_powers_of_two_is_exactly_2_pow_minus_4_and_448_is_14_percent_above():
    for k in range(9):
        assert pc.dp_of_scale(2.0 ** k).dp == 2.0 ** -4
        assert pc.dp_of_scale(2.0 ** k).bit_exact
    p448 = pc.dp_of_scale(448.0)
    assert p448.dp == pytest.approx(32 / 448) and round(p448.dp, 4) == 0.0714
    assert not p448.bit_exact
    assert p448.dp / 2.0 ** -4 == pytest.approx(1.142857, rel=1e-5)


@pytest.mark.parametrize("S, expected", [(3, 0.083), (100, 0.080), (250, 0.064), (300, 0.107), (448, 0.071)])
def test_dp_of_the_papers_non_power_of_two_scales_exceeds_the_envelope(S, expected):
    dp = pc.dp_of_scale(float(S)).dp
    assert dp > 2.0 ** -4
    assert round(dp, 3) == expected


def test_dp_saturates_above_448():
    assert pc.dp_of_scale(512.0).dp == pytest.approx(0.25)  # App. A: k = 9 overflows
    assert all(p.dp > 2.0 ** -4 for p in pc.dp_curve([449.0, 470.0, 600.0, 1024.0]))


def test_dp_sawtooth_lower_envelope_is_attained_only_at_powers_of_two():
    curve = pc.dp_sawtooth(1.0, 440.0, 400)
    at_envelope = {p.S for p in curve if p.dp == 2.0 ** -4}
    assert at_envelope == {2.0 ** k for k in range(9)}
    assert min(p.dp for p in curve) == 2.0 ** -4


def test_cast_e4m3_flushes_below_2_pow_minus_10_and_saturates():
    x = torch.tensor([2.0 ** -10 * 0.99, 2.0 ** -10, 2.0 ** -10 * 1.01, 0.3, 500.0, -1e4, float("nan")])
    y = pc.cast_e4m3(x)
    assert y[:3].tolist() == [0.0, 0.0, 2.0 ** -9]  # 2^-10 is the tie: rounds to even (0)
    assert y[3].item() == 0.3125  # nearest of 0.28125 / 0.3125
    assert y[4].item() == 448.0 and y[5].item() == -448.0
    assert math.isnan(y[6].item())


def test_cast_e4m3_agrees_with_numerics_round_to():
    numerics = pytest.importorskip("fa_forensics.numerics")
    if not hasattr(numerics, "round_to"):
        pytest.skip("numerics.round_to not available")
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.randn(20000, generator=g) * 4 - 6)  # P·S spanning subnormals to ~400
    x = x.clamp(max=440.0)
    assert torch.equal(pc.cast_e4m3(x), numerics.round_to(x, "fp8_e4m3", "nearest-even"))


# --- closed form ---------------------------------------------------------------------------------

def test_delta_k_is_integrated_not_typed():
    assert pc.expected_max_normal(1) == 0.0
    assert pc.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)  # E max of 2 = 1/√π
    assert pc.expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-9)
    assert pc.expected_max_normal(4) == pytest.approx(1.0294, abs=1e-4)  # paper: δ_4 ≈ 1.03
    g = torch.Generator().manual_seed(0)
    mc = torch.randn(400_000, 4, generator=g, dtype=torch.float64).amax(dim=1)
    assert pc.expected_max_normal(4) == pytest.approx(mc.mean().item(), abs=0.005)
    assert pc.std_max_normal(4) == pytest.approx(mc.std().item(), abs=0.005)


def test_closed_form_is_one_half_at_the_critical_sink_strength():
    for S in (1.0, 256.0):
        delta_c = 10 * math.log(2) + math.log(S) - pc.expected_max_normal(4)  # Δ_c = 6.93 + ln S − δ_k
        assert pc.closed_form_fraction(delta_c, S, 4) == pytest.approx(0.5, abs=1e-12)
    assert pc.closed_form_fraction(7.0, 1.0, 4) == pytest.approx(0.864, abs=1e-3)


def test_spread_averaging_raises_the_fraction_below_the_median_and_lowers_it_above():
    low, high = 4.0, 8.0  # arguments −1.9 and +2.1
    assert pc.closed_form_spread(low, 1.0, 4) > pc.closed_form_fraction(low, 1.0, 4)
    assert pc.closed_form_spread(high, 1.0, 4) < pc.closed_form_fraction(high, 1.0, 4)


# --- the kernel ----------------------------------------------------------------------------------

def _algorithm1_loop(z, v, S, order, block, counted):
    """Algorithm 1 of the paper written block by block, as a second implementation."""
    n = z.shape[-1]
    m = torch.full(z.shape[:-1], -math.inf)
    ell = torch.zeros(z.shape[:-1])
    acc = torch.zeros(*z.shape[:-1], v.shape[-1])
    n_zeroed = torch.zeros(z.shape[:-1], dtype=torch.int64)
    starts = list(range(0, n, block))
    for j0 in (starts[::-1] if order == "reverse" else starts):
        z_j = z[..., j0:j0 + block]
        m_new = torch.maximum(m, z_j.amax(-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - m_safe)
        p = torch.exp(z_j - m_safe[..., None])
        ell = alpha * ell + p.sum(-1)
        p8 = (p * torch.tensor(S, dtype=torch.float32)).to(torch.float8_e4m3fn).float()
        n_zeroed += ((p8 == 0) & (p > 0) & counted[..., j0:j0 + block]).sum(-1)
        acc = alpha[..., None] * acc + p8 @ v[..., j0:j0 + block, :]
        m = m_new
    return acc / (torch.tensor(S, dtype=torch.float32) * ell)[..., None], n_zeroed


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("S", [1.0, 256.0, 448.0])
def test_blocked_kernel_is_bit_identical_to_the_block_loop_of_algorithm_1(order, S):
    g = torch.Generator().manual_seed(1)
    T, D = 200, 16  # a partial last block
    z = torch.randn(2, T, T, generator=g) * 1.5
    z[..., :4] += 8.0
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    z = z.masked_fill(~causal, -math.inf)
    v = torch.randn(2, T, D, generator=g)
    counted = causal.clone()
    counted[:, :4] = False
    out = pc.pcast_attention(z, v, S, order, 64, counted=counted)
    o_loop, nz_loop = _algorithm1_loop(z, v, S, order, 64, counted)
    assert torch.equal(out.o, o_loop)
    assert torch.equal(out.n_zeroed, nz_loop)


def test_kernel_normalizes_with_the_pre_cast_sum_and_matches_softmax_without_sinks():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(8, 512, generator=g)
    v = torch.randn(512, 32, generator=g)
    out = pc.pcast_attention(z, v, 256.0, "forward", 64)
    o_ref, p_ref = pc.reference_attention(z, v)
    assert int(out.n_zeroed.sum()) == 0
    # only the E4M3 rounding of P̄ (|rel| ≤ 2^-4) remains: error far below the output's size
    assert (out.o.double() - o_ref).abs().max() < 0.05 * o_ref.abs().max()
    assert torch.allclose(out.lse.double(), torch.logsumexp(z.double(), -1), atol=1e-5)
    # constant V: Σ P̄_fp8 / (S ℓ) ≠ 1 exactly because ℓ is pre-cast (normalization from fp32 P̄)
    ones = pc.pcast_attention(z, torch.ones(512, 1), 1.0, "forward", 64).o
    assert not torch.allclose(ones, torch.ones_like(ones), atol=1e-6, rtol=0)


def test_forward_order_collapses_and_reverse_order_does_not():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(32, 1024, generator=g)
    z[:, :4] += 7.0
    v = torch.randn(1024, 16, generator=g)
    counted = torch.arange(1024) >= 4
    fwd = pc.pcast_attention(z, v, 1.0, "forward", 64, counted=counted)
    rev = pc.pcast_attention(z, v, 1.0, "reverse", 64, counted=counted)
    frac_f = fwd.n_zeroed.sum().item() / (32 * 1020)
    frac_r = rev.n_zeroed.sum().item() / (32 * 1020)
    assert frac_f > 0.6 and frac_r < 0.1
    assert fwd.mass_zeroed.mean() > 0.1 > rev.mass_zeroed.mean() * 10


# --- statistics ---------------------------------------------------------------------------------

def test_paired_ttest_and_ratio():
    rng = np.random.default_rng(0)
    base = rng.uniform(1.0, 2.0, 50)
    same = paired_ttest(base, base, "a", "b", 7.0, 4096)
    assert same.p_value == 1.0 and same.verdict == "indistinguishable"
    worse = paired_ttest(base * 1.1 + rng.normal(0, 0.01, 50), base, "a", "b", 7.0, 4096)
    assert worse.p_value < 1e-6 and worse.verdict == "b better" and worse.mean_diff > 0
    r = paired_ratio(3 * base, base, "a", "b", 7.0, 4096)
    assert r.value == pytest.approx(3.0) and r.se == pytest.approx(0.0, abs=1e-12)
    noisy = paired_ratio(3 * base + rng.normal(0, 0.3, 50), base, "a", "b", 7.0, 4096)
    assert 0.01 < noisy.se < 0.2 and abs(noisy.value - 3.0) < 4 * noisy.se


# --- the simulation -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_sim():
    cfg = pc.SimConfig(deltas=(4.0, 5.0, 6.0, 7.0, 9.0), seqs=(1024,), n_queries=16, head_dim=32, n_seeds=6,
                       scales=(1.0, 256.0), orders=("forward", "reverse"))
    return pc.simulate(cfg)


def test_simulation_zeroed_fraction_rises_for_s1_and_stays_near_zero_for_s256(small_sim):
    s1 = [small_sim.row(d, 1.0, "forward").frac_zeroed for d in (4.0, 5.0, 6.0, 7.0, 9.0)]
    assert all(b > a for a, b in zip(s1, s1[1:]))
    assert s1[2] > 0.4 and s1[3] > 0.7  # the transition through Δ ≈ 6-7
    for d in (4.0, 5.0, 6.0, 7.0):
        assert small_sim.row(d, 256.0, "forward").frac_zeroed < 0.005
        # reverse + S=256: only the sink block's own non-sink keys (s < Δ+δ_k − 12.48) can be zeroed
        assert small_sim.row(d, 256.0, "reverse").frac_zeroed < 1e-4


def test_simulation_measured_fraction_matches_the_spread_averaged_closed_form(small_sim):
    for d in (5.0, 6.0, 7.0):
        r = small_sim.row(d, 1.0, "forward")
        assert r.closed_form == pc.closed_form_fraction(d, 1.0, 4)
        assert abs(r.frac_zeroed - r.closed_form_spread) < 0.03
    r7 = small_sim.row(7.0, 1.0, "forward")
    assert r7.frac_zeroed < r7.closed_form and "concave" in r7.explanation
    r5 = small_sim.row(5.0, 1.0, "forward")
    assert r5.frac_zeroed > r5.closed_form and "convex" in r5.explanation


def test_simulation_mse_forward_s1_is_worse_and_both_fixes_reach_the_same_floor(small_sim):
    assert small_sim.ratio is not None and small_sim.ratio.delta == 7.0 and small_sim.ratio.seq == 1024
    assert small_sim.ratio.value > 1.0 + 3 * small_sim.ratio.se  # ~1.7 at N = 1024 (paper: 1.3 at 512)
    f256 = small_sim.row(7.0, 256.0, "forward").mse
    r1 = small_sim.row(7.0, 1.0, "reverse").mse
    assert abs(r1 / f256 - 1) < 0.1
    r = small_sim.row(7.0, 1.0, "forward")
    assert r.info_loss == pytest.approx(r.nonsink_mass * r.frac_zeroed)
    assert len(r.mse_per_seed) == 6 and r.mse == pytest.approx(np.mean(r.mse_per_seed))
    assert {t.delta for t in small_sim.ttest} == {4.0, 5.0, 6.0, 7.0, 9.0}


def test_simulation_is_reproducible_and_rejects_bad_configs():
    cfg = pc.SimConfig(deltas=(7.0,), seqs=(256,), n_queries=4, head_dim=8, n_seeds=2, scales=(1.0,), orders=("forward",))
    assert pc.simulate(cfg).rows == pc.simulate(cfg).rows
    from fa_forensics.errors import ConfigError
    with pytest.raises(ConfigError):
        pc.SimConfig(seqs=(4,))
    with pytest.raises(ConfigError):
        pc.SimConfig(scales=(0.0,))
    with pytest.raises(ConfigError):
        pc.SimConfig(orders=("sideways",))


def test_ratio_at_paper_operating_point_is_about_3_4():
    """Δ = 7, N = 4096, paper defaults but 4 seeds: forward S=1 over forward S=256 (paper: ~3.4x)."""
    cfg = pc.SimConfig(deltas=(7.0,), seqs=(4096,), n_seeds=4, scales=(1.0, 256.0), orders=("forward",))
    res = pc.simulate(cfg)
    assert 2.5 < res.ratio.value < 5.0
    assert res.ratio.se < 0.6
