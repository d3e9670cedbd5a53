"""The FP8 P-cast study: E4M3 line and dp(S), closed form, kernel, simulation, dump mode."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fa_forensics.analyses.pcast import compute as pc
from fa_forensics.analyses.pcast import e4m3 as e4
from fa_forensics.analyses.pcast import kernel as kern
from fa_forensics.analyses.pcast import sim
from fa_forensics.analyses.pcast import theory as th
from fa_forensics.analyses.stats import paired_ratio, paired_ttest
from fa_forensics.numerics import exp_fp32
from fa_forensics.enums import Precision
from fa_forensics.replay.emulate.ops import cast


# --- E4M3 number line and dp(S) ----------------------------------------------------------------

def test_e4m3_line_has_126_positive_values_from_2_pow_minus_9_to_448():
    v = e4.e4m3_positive_values()
    assert v.numel() == 126
    assert float(v[0]) == 2.0 ** -9 and float(v[-1]) == 448.0
    assert bool((v[1:] > v[:-1]).all())


def test_dp_of_powers_of_two_is_exactly_2_pow_minus_4_and_448_is_14_percent_above():
    for k in range(9):
        assert e4.dp_of_scale(2.0 ** k).dp == 2.0 ** -4
        assert e4.dp_of_scale(2.0 ** k).bit_exact
    p448 = e4.dp_of_scale(448.0)
    assert p448.dp == pytest.approx(32 / 448) and round(p448.dp, 4) == 0.0714
    assert not p448.bit_exact
    assert p448.dp / 2.0 ** -4 == pytest.approx(1.142857, rel=1e-5)


@pytest.mark.parametrize("S, expected", [(3, 0.083), (100, 0.080), (250, 0.064), (300, 0.107), (448, 0.071)])
def test_dp_of_the_papers_non_power_of_two_scales_exceeds_the_envelope(S, expected):
    dp = e4.dp_of_scale(float(S)).dp
    assert dp > 2.0 ** -4
    assert round(dp, 3) == expected


def test_dp_saturates_above_448():
    assert e4.dp_of_scale(512.0).dp == pytest.approx(0.25)  # App. A: k = 9 overflows
    assert all(p.dp > 2.0 ** -4 for p in e4.dp_curve([449.0, 470.0, 600.0, 1024.0]))


def test_dp_sawtooth_lower_envelope_is_attained_only_at_powers_of_two():
    curve = e4.dp_sawtooth(1.0, 440.0, 400)
    at_envelope = {p.S for p in curve if p.dp == 2.0 ** -4}
    assert at_envelope == {2.0 ** k for k in range(9)}
    assert min(p.dp for p in curve) == 2.0 ** -4


def test_the_engines_e4m3_cast_flushes_below_2_pow_minus_10_and_saturates():
    x = torch.tensor([2.0 ** -10 * 0.99, 2.0 ** -10, 2.0 ** -10 * 1.01, 0.3, 500.0, -1e4, float("nan")])
    y = cast(x, Precision.FP8_E4M3)
    assert y[:3].tolist() == [0.0, 0.0, 2.0 ** -9]  # 2^-10 is the tie: rounds to even (0)
    assert y[3].item() == 0.3125  # nearest of 0.28125 / 0.3125
    assert y[4].item() == 448.0 and y[5].item() == -448.0
    assert math.isnan(y[6].item())


def test_the_engines_e4m3_cast_agrees_with_torchs_float8_conversion():
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.randn(20000, generator=g) * 4 - 6)  # P·S spanning subnormals to ~400
    x = x.clamp(max=440.0)
    assert torch.equal(cast(x, Precision.FP8_E4M3), x.to(torch.float8_e4m3fn).float())


# --- closed form ---------------------------------------------------------------------------------

def test_delta_k_is_integrated_not_typed():
    assert th.expected_max_normal(1) == 0.0
    assert th.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)  # E max of 2 = 1/√π
    assert th.expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-9)
    assert th.expected_max_normal(4) == pytest.approx(1.0294, abs=1e-4)  # paper: δ_4 ≈ 1.03
    g = torch.Generator().manual_seed(0)
    mc = torch.randn(400_000, 4, generator=g, dtype=torch.float64).amax(dim=1)
    assert th.expected_max_normal(4) == pytest.approx(mc.mean().item(), abs=0.005)
    assert th.std_max_normal(4) == pytest.approx(mc.std().item(), abs=0.005)


def test_closed_form_is_one_half_at_the_critical_sink_strength():
    for S in (1.0, 256.0):
        delta_c = 10 * math.log(2) + math.log(S) - th.expected_max_normal(4)  # Δ_c = 6.93 + ln S − δ_k
        assert th.closed_form_fraction(delta_c, S, 4) == pytest.approx(0.5, abs=1e-12)
    assert th.closed_form_fraction(7.0, 1.0, 4) == pytest.approx(0.864, abs=1e-3)


def test_spread_averaging_raises_the_fraction_below_the_median_and_lowers_it_above():
    low, high = 4.0, 8.0  # arguments −1.9 and +2.1
    assert th.closed_form_spread(low, 1.0, 4) > th.closed_form_fraction(low, 1.0, 4)
    assert th.closed_form_spread(high, 1.0, 4) < th.closed_form_fraction(high, 1.0, 4)


# --- the kernel ----------------------------------------------------------------------------------

def _algorithm1_loop(z, v, S, order, block, counted):
    """Algorithm 1 of the paper written block by block, as a second implementation: exp rounded
    once to fp32, ℓ's block sum rounded once, P̄V added key by key into the fp32 accumulator
    (exact products, one rounding per addition: the engine's ieee model)."""
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
        alpha = exp_fp32(m - m_safe)
        p = exp_fp32(z_j - m_safe[..., None])
        ell = alpha * ell + p.double().sum(-1).float()
        p8 = (p * torch.tensor(S, dtype=torch.float32)).to(torch.float8_e4m3fn).float()
        n_zeroed += ((p8 == 0) & (p > 0) & counted[..., j0:j0 + block]).sum(-1)
        acc = alpha[..., None] * acc
        for t in range(p8.shape[-1]):
            acc = (acc.double() + p8[..., t, None].double() * v[..., j0 + t, None, :].double()).float()
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
    out = kern.pcast_attention(z, v, kern.pcast_config(S, order, 64), counted=counted)
    o_loop, nz_loop = _algorithm1_loop(z, v, S, order, 64, counted)
    assert torch.equal(out.o, o_loop)
    assert torch.equal(out.n_zeroed, nz_loop)


def test_kernel_normalizes_with_the_pre_cast_sum_and_matches_softmax_without_sinks():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(8, 512, generator=g)
    v = torch.randn(512, 32, generator=g)
    out = kern.pcast_attention(z, v, kern.pcast_config(256.0, "forward", 64))
    o_ref, p_ref = kern.reference_attention(z, v)
    assert int(out.n_zeroed.sum()) == 0
    # only the E4M3 rounding of P̄ (|rel| ≤ 2^-4) remains: error far below the output's size
    assert (out.o.double() - o_ref).abs().max() < 0.05 * o_ref.abs().max()
    assert torch.allclose(out.lse.double(), torch.logsumexp(z.double(), -1), atol=1e-5)
    # constant V: Σ P̄_fp8 / (S ℓ) ≠ 1 exactly because ℓ is pre-cast (normalization from fp32 P̄)
    ones = kern.pcast_attention(z, torch.ones(512, 1), kern.pcast_config(1.0, "forward", 64)).o
    assert not torch.allclose(ones, torch.ones_like(ones), atol=1e-6, rtol=0)


def test_forward_order_collapses_and_reverse_order_does_not():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(32, 1024, generator=g)
    z[:, :4] += 7.0
    v = torch.randn(1024, 16, generator=g)
    counted = torch.arange(1024) >= 4
    fwd = kern.pcast_attention(z, v, kern.pcast_config(1.0, "forward", 64), counted=counted)
    rev = kern.pcast_attention(z, v, kern.pcast_config(1.0, "reverse", 64), counted=counted)
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
    cfg = sim.SimConfig(deltas=(4.0, 5.0, 6.0, 7.0, 9.0), seqs=(1024,), n_queries=16, head_dim=32, n_seeds=6,
                       scales=(1.0, 256.0), orders=("forward", "reverse"))
    return sim.simulate(cfg)


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
        assert r.closed_form == th.closed_form_fraction(d, 1.0, 4)
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
    cfg = sim.SimConfig(deltas=(7.0,), seqs=(256,), n_queries=4, head_dim=8, n_seeds=2, scales=(1.0,),
                        orders=("forward",))
    assert sim.simulate(cfg).rows == sim.simulate(cfg).rows
    from fa_forensics.errors import ConfigError
    with pytest.raises(ConfigError):
        sim.SimConfig(seqs=(4,))
    with pytest.raises(ConfigError):
        sim.SimConfig(scales=(0.0,))
    with pytest.raises(ConfigError):
        sim.SimConfig(orders=("sideways",))


def test_ratio_at_paper_operating_point_is_about_3_4():
    """Δ = 7, N = 4096, paper defaults but 4 seeds: forward S=1 over forward S=256 (paper: ~3.4x)."""
    cfg = sim.SimConfig(deltas=(7.0,), seqs=(4096,), n_seeds=4, scales=(1.0, 256.0), orders=("forward",))
    res = sim.simulate(cfg)
    assert 2.5 < res.ratio.value < 5.0
    assert res.ratio.se < 0.6


# --- the study replays through the engine ---------------------------------------------------------

@pytest.mark.parametrize("S", [1.0, 256.0, 448.0])
def test_pcast_kernel_is_the_fp8_preset_with_s_multiplied_and_gives_a_full_replays_bits(S):
    from fa_forensics.replay.api import replay
    from fa_forensics.enums import PScaleMode
    from fa_forensics.replay.config import ReplayConfig
    from fa_forensics.replay.emulate.forward import scaled_scores

    preset = ReplayConfig.preset(f"fp8-s{S:g}")
    cfg = kern.pcast_config(S, "forward", 64)
    assert cfg == preset.with_(p_scale_mode=PScaleMode.MULTIPLY)  # the same arithmetic but how S is applied
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 1, 150, 16, generator=g) for _ in range(3))
    k[..., :4, :] += 3 * q.mean(dim=-2, keepdim=True)  # a sink: the first keys align with every query
    z = scaled_scores(q, k, cfg, 0.25, True, 0, 0)[:, 0]  # (B, T, T), the engine's scores
    out = kern.pcast_attention(z, v[:, 0], cfg)
    full = replay(q, k, v, cfg, causal=True, scale=0.25)
    assert torch.equal(out.o, full.o[:, 0])  # the study's O is a full replay's, bit for bit
    assert int(out.n_zeroed.sum()) == full.stats.total()["p_zeroed"]
    as_preset = replay(q, k, v, preset, causal=True, scale=0.25).o[:, 0]
    if S == 1.0:  # no scale to apply: the preset itself, and the sink zeroes P̄
        assert torch.equal(out.o, as_preset)
        assert int(out.n_zeroed.sum()) > 0
    else:  # FA3's exponent offset exp(s − m + ln S) differs from P̄·S by ulps of fp32, which the
        # E4M3 cast (3 mantissa bits) absorbs but for rare ties: the same O, up to a few entries
        assert (out.o != as_preset).float().mean() < 0.01
        assert (out.o - as_preset).abs().max() < 0.02 * as_preset.abs().max()


# (S, order) -> (frac_zeroed, mass_zeroed, mse) of step 2, layer 0 of the planted sample, as the study's
# own blocked kernel (torch exp and BLAS products) measured them before it replayed through the engine
PLANTED_PREVIOUS = {
    0: {(1.0, "forward"): (0.9557218144174666, 0.010175154333762038, 6.9706870300665e-05),
        (256.0, "forward"): (0.004940711462450593, 1.0882863233918627e-06, 6.733479217864891e-05),
        (1.0, "reverse"): (0.39858209423426816, 0.004316119776159866, 6.83244038916426e-05),
        (256.0, "reverse"): (0.0021331325679151765, 4.884927233828051e-07, 6.73386347933918e-05)},
    1: {(1.0, "forward"): (0.9456835435096305, 8.424206205770446e-05, 1.2208766492997398e-05),
        (256.0, "forward"): (0.8260869565217391, 4.674357842748833e-05, 1.2208030311327884e-05),
        (1.0, "reverse"): (0.3644676579459188, 3.23926758669657e-05, 1.2208312338091797e-05),
        (256.0, "reverse"): (0.3182288725766987, 1.784955391581633e-05, 1.2208013059449923e-05)},
}


def test_dump_mode_reproduces_the_previous_kernels_numbers_on_the_planted_sample(planted_dump):
    from fa_forensics.layers.selection import LayerSelection
    from fa_forensics.dump import open_dump

    res = pc.run(open_dump(planted_dump), [LayerSelection(step=2, layer=0, heads=[0, 1])], scales=(1.0, 256.0))
    assert [h.head for h in res.heads] == [0, 1]
    for h in res.heads:
        for (S, order), (frac, mass, mse) in PLANTED_PREVIOUS[h.head].items():
            got = h.setting(S, order)
            assert got.frac_zeroed == frac  # the same P̄ zeroed, entry for entry
            assert got.mass_zeroed == pytest.approx(mass, rel=1e-6)
            assert got.mse == pytest.approx(mse, rel=1e-5)  # fp32 sums in another order
    assert [h.needs_fix for h in res.heads] == [True, False]
    assert res.heads[0].recommended_S == 256.0 and res.heads[0].recommended_order == "forward"


# --- the decision on an interval: bands, one-hot and empty heads ---------------------------------

def _sink_qkv(delta: float, seed: int, B: int = 2, T: int = 128, D: int = 32):
    """q, k, v (B, T, D) bf16: scaled scores ≈ N(0, 1), the first 4 keys `delta` higher."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, D, generator=g) for _ in range(3))
    q[..., 0] = math.sqrt(D)
    k[..., 0] = 0.0
    k[:, :4, 0] = delta
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _head(q, k, v, **kw):
    return pc.analyze_head(q, k, v, scale=1 / math.sqrt(q.shape[-1]), causal=True, **kw)


@pytest.fixture(scope="module")
def floor_heads():
    """Heads whose sinks lose about the floor's mass (T = 128: forward S=1 zeroes ~96 % of their non-sink P̄),
    one clearly below it, and one clearly above it on longer sequences (T = 256: more mass at risk)."""
    deltas = (7.9, 7.95, 8.0, 8.05, 9.2)
    heads = {d: _head(*_sink_qkv(d, seed=0), scales=(1.0, 256.0), orders=("forward",)) for d in deltas}
    heads[6.5] = _head(*_sink_qkv(6.5, seed=0, T=256), scales=(1.0, 256.0), orders=("forward",))
    return heads


def test_heads_on_either_side_of_the_floor_get_the_same_borderline_band(floor_heads):
    near = [floor_heads[d] for d in (7.9, 7.95, 8.0, 8.05)]
    above = [h for h in near if h.lost_mass > pc.FIX_MASS_ZEROED]
    below = [h for h in near if h.lost_mass <= pc.FIX_MASS_ZEROED]
    assert above and below  # a hard floor on the point estimate would split these heads
    for h in near:
        assert 0.93 < h.zeroed_share < 0.99
        assert abs(h.lost_mass - pc.FIX_MASS_ZEROED) < 0.001
        assert h.band == "borderline" and not h.needs_fix
        assert h.lost_mass_ci[0] < pc.FIX_MASS_ZEROED < h.lost_mass_ci[1]
        assert "borderline" in h.recommendation and "interval" in h.recommendation
    assert floor_heads[6.5].band == "needs-fix" and floor_heads[6.5].needs_fix
    assert floor_heads[6.5].lost_mass_ci[0] > pc.FIX_MASS_ZEROED
    assert floor_heads[9.2].band == "no-fix" and floor_heads[9.2].lost_mass_ci[1] <= pc.FIX_MASS_ZEROED
    bands = [floor_heads[d].band for d in sorted(floor_heads)]  # a stronger sink never moves a head to a lower band
    order = {"needs-fix": 0, "borderline": 1, "no-fix": 2}
    assert [order[b] for b in bands] == sorted(order[b] for b in bands)


def test_the_head_level_decision_keys_are_the_default_settings_numbers_with_their_intervals(floor_heads):
    for h in floor_heads.values():
        base = h.setting(1.0, "forward")
        assert (h.lost_mass, h.lost_mass_ci) == (base.mass_zeroed, base.mass_zeroed_ci)
        assert (h.zeroed_share, h.zeroed_share_ci) == (base.frac_zeroed, base.frac_zeroed_ci)
        for s in h.settings:
            assert s.mass_zeroed_ci[0] <= s.mass_zeroed <= s.mass_zeroed_ci[1]
            assert s.frac_zeroed_ci[0] <= s.frac_zeroed <= s.frac_zeroed_ci[1]
        T = h.rows // 2
        assert h.unit_rows == 32 and h.units == 2 * T // 32  # runs of 32 rows, never across the 2 batch rows


def test_the_interval_is_a_bootstrap_over_runs_of_rows_of_the_ratio_of_sums():
    from fa_forensics.analyses.pcast import decision as dec

    units = dec.unit_index(2, 10)  # runs of 2 rows (10 // 4), never across batch rows
    assert units.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3, 4, 4], [5, 5, 6, 6, 7, 7, 8, 8, 9, 9]]
    assert dec.unit_rows(256) == 32 and dec.unit_rows(3) == 1
    num, den = np.array([1.0, 3.0, 0.0, 4.0]), np.array([2.0, 2.0, 1.0, 3.0])
    s = dec.bootstrap_share(num, den)
    assert s.value == 8 / 8 and s.lo < s.value < s.hi
    assert dec.bootstrap_share(num, den) == s  # a fixed seed: the same dump, the same interval
    rng = np.random.default_rng(dec.BOOT_SEED)  # the percentile interval of the resampled ratios, by hand
    idx = rng.integers(0, 4, size=(dec.N_BOOT, 4))
    ratios = num[idx].sum(1)[den[idx].sum(1) > 0] / den[idx].sum(1)[den[idx].sum(1) > 0]
    assert (s.lo, s.hi) == tuple(np.quantile(ratios, [0.025, 0.975]))
    same = dec.bootstrap_share(np.full(5, 0.2), np.ones(5))
    assert same.lo == same.value == same.hi == pytest.approx(0.2)  # units that agree: no spread to measure
    assert all(math.isnan(x) for x in (dec.bootstrap_share(np.zeros(3), np.zeros(3)).value,))


def test_mse_ratios_over_a_zero_best_are_defined():
    from fa_forensics.analyses.pcast.decision import mse_ratio, ratio_text

    assert mse_ratio(2.0, 1.0) == 2.0 and mse_ratio(0.0, 0.0) == 1.0 and math.isnan(mse_ratio(1e-9, 0.0))
    assert ratio_text(0.0, 0.0) == "×1.00" and ratio_text(1e-9, 0.0) == "×n/a"


def _one_hot_qkv(B: int = 2, T: int = 64, D: int = 16):
    """Every row's scores: key 0 about 200 above the rest, so the fp32 exp of every other key is 0."""
    q, k, v = _sink_qkv(0.0, seed=3, B=B, T=T, D=D)
    q = q.float()
    k = k.float()
    q[..., 0] = math.sqrt(D)
    k[:, 0, 0] = 200.0
    return q.bfloat16(), k.bfloat16(), v


def test_a_one_hot_head_is_a_result_not_an_exception():
    from fa_forensics.analyses.pcast.table import tables

    h = _head(*_one_hot_qkv())
    assert h.band == "one-hot" and not h.needs_fix
    assert all(s.mse == 0.0 for s in h.settings)  # every setting gives O = V of key 0 exactly: a best MSE of 0
    assert h.lost_mass == 0.0 and h.lost_mass_ci == (0.0, 0.0)
    assert h.recommendation.startswith("one-hot") and "nothing to lose" in h.recommendation
    res = pc.PcastDumpResult(path="x", n_sinks=4, block=64, delta_k=th.expected_max_normal(4),
                             scales=(1.0, 256.0, 448.0), orders=tuple(kern.KVOrder), heads=(h,))
    table = tables(res)[0]
    cells = [str(c) for col in table.columns for c in col._cells]
    assert "0% ×1.00" in cells and "one-hot" in cells
    assert "1 one-hot" in pc.verdict(res) and pc.payload(res)["band_counts"]["one-hot"] == 1


def test_an_empty_head_is_a_result_not_an_exception():
    q, k, v = _sink_qkv(0.0, seed=1, B=1, T=4)  # every key is a sink token: nothing to drop
    h = _head(q, k, v)
    assert h.band == "empty" and not h.needs_fix and h.recommendation.startswith("empty")
    assert h.lost_mass == 0.0 and math.isnan(h.zeroed_share) and math.isnan(h.sink_strength)  # no share of nothing
    none = _head(q[:0], k[:0], v[:0])  # no rows at all
    assert none.band == "empty" and none.settings == () and none.rows == 0
    res = pc.PcastDumpResult(path="x", n_sinks=4, block=64, delta_k=th.expected_max_normal(4), scales=(1.0,),
                             orders=(kern.KVOrder.FORWARD,), heads=(h, none))
    assert "2 empty" in pc.verdict(res) and "no head of 2" in pc.verdict(res)
    from fa_forensics.analyses.pcast.table import finding, tables
    from fa_forensics.analyses.jsonable import to_jsonable

    tables(res)
    assert "one-hot or empty" in finding(to_jsonable(pc.payload(res)))
