"""--preset: the low-precision side of every analysis, and the repairs / variants derived from it."""
import math

import pytest
import torch

from fa_forensics.analyses.fix_check.compute import fix_variants
from fa_forensics.analyses.primitives import scores_fp32
from fa_forensics.analyses.isolate.compute import isolate_layers, variants
from fa_forensics.analyses.pv_trace.compute import p_bar_row, repeated_max_rows, trace_pv
from fa_forensics.dump import open_dump
from fa_forensics.fidelity.recipe import Choice, Recipe, UnknownPreset, lp_config_for
from fa_forensics.fidelity.pair import lp_hp_pair
from fa_forensics.fidelity.planner import plan_for_layers
from fa_forensics.errors import ConfigError
from fa_forensics.numerics import matmul
from fa_forensics.enums import Accumulation, Precision, Softmax
from fa_forensics.replay.config import PRESETS, ReplayConfig
from fa_forensics.enums import Backend
from fa_forensics.report.run import ANALYSES, command_line
from test_analyses_delta_bias import planted_layer

BF16, FP32 = Precision.BF16, Precision.FP32


def test_lp_config_is_the_preset_with_the_chosen_accumulation():
    cfg = Recipe("bf16-hw", "ieee").base_config()
    assert cfg == ReplayConfig.preset("bf16-hw").with_(accumulation=Accumulation.IEEE)
    assert Recipe("bf16-autocast", "tensor-core").base_config().s_dtype is BF16
    assert Recipe("bf16").base_config() == ReplayConfig()  # ReplayConfig() is preset bf16
    assert Recipe().is_auto and Recipe().accumulation_name == "auto"  # the default: what reproduces the stored O
    with pytest.raises(ConfigError):
        Recipe().base_config()  # auto is decided per layer-step
    assert lp_config_for(None, 0, 0, Recipe()) == ReplayConfig()  # nothing to match in memory: the fallback, bf16


def test_auto_is_resolved_once_before_a_dump_is_replayed(planted_dump):
    """A dump's layer-step is never matched behind the caller's back: `auto` there needs `resolve` first."""
    dump = open_dump(planted_dump)
    with pytest.raises(ConfigError, match="preset auto is not resolved at step"):
        lp_config_for(dump, dump.steps[0], 0, Recipe())
    chosen = Recipe(choices=(((dump.steps[0], 0), Choice("bf16-hw", Accumulation.IEEE, None)),))
    assert lp_config_for(dump, dump.steps[0], 0, chosen) == ReplayConfig.preset("bf16-hw").with_(
        accumulation=Accumulation.IEEE)


def test_unknown_preset_is_one_line_listing_the_presets():
    with pytest.raises(UnknownPreset) as e:
        Recipe("bf17")
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and e.value.name == "bf17"
    assert "\n" not in msg and "'bf17'" in msg and all(p in msg for p in PRESETS)


def test_lp_hp_pair_replays_the_chosen_preset():
    t = planted_layer(T=64)
    lp_a, hp_a = lp_hp_pair(t, plan_for_layers([t], Recipe("bf16-autocast")), backward=False)
    lp_b, hp_b = lp_hp_pair(t, plan_for_layers([t], Recipe("bf16")), backward=False)
    lp_c, _ = lp_hp_pair(t, plan_for_layers([t], Recipe("fp32")), backward=False)
    assert lp_a.config.s_dtype is BF16 and lp_b.config.s_dtype is FP32
    assert torch.equal(hp_a.o, hp_b.o)  # the fp32 side does not depend on the preset
    assert not torch.equal(lp_a.o, lp_b.o)  # bf16 scores and m, ℓ give other bits
    assert torch.equal(lp_c.o, hp_a.o)  # fp32 against fp32: no error at all


@pytest.mark.parametrize("preset", ["bf16", "bf16-autocast", "bf16-hw", "fp8-s256"])
def test_isolate_repairs_are_single_changes_of_the_preset(preset):
    vs = {v.name: v for v in variants(1024, Recipe(preset).base_config(), preset)}
    base = vs["baseline"].config
    own = ReplayConfig.preset(preset)
    assert (base.s_dtype, base.stats_dtype, base.p_dtype, base.input_dtype) == (own.s_dtype, own.stats_dtype,
                                                                                own.p_dtype, own.input_dtype)
    assert (base.block_m, base.block_n) == (own.block_m, own.block_n)  # the preset's tiles, as every analysis replays
    for name, v in vs.items():
        if name != "no-tiling":
            assert (v.config.block_m, v.config.block_n) == (base.block_m, base.block_n), name
    assert vs["pv-fp32"].config.pv_dtype is FP32 and vs["pv-fp32"].config.rescale_dtype is FP32
    assert vs["pv-fp32"].config.o_dtype is base.o_dtype
    assert {vs["o-fp32"].config.pv_dtype, vs["o-fp32"].config.rescale_dtype, vs["o-fp32"].config.o_dtype} == {FP32}
    assert vs["stabilized"].config.softmax is Softmax.STABILIZED and vs["stabilized"].config.s_dtype is base.s_dtype
    same = {n for n, v in vs.items() if "(= baseline under this preset)" in v.description}
    expected = {"bf16": {"no-tiling"}, "bf16-autocast": set(), "bf16-hw": {"pv-fp32"},
                "fp8-s256": {"pv-fp32", "o-fp32"}}[preset]
    assert same == expected


@pytest.mark.slow  # about 3 s of CPU or more
def test_isolate_under_autocast_reports_the_preset_and_finds_the_planted_bias():
    r = isolate_layers([planted_layer(step=0, seed=0, T=128)], Recipe("bf16-autocast"))
    by = {v.name: v for v in r.variants}
    assert r.preset == "bf16-autocast" and r.baseline_tiles == (512, 512)
    assert r.n_biased_heads >= 1 and r.heads[0].head == 0 and by["baseline"].delta_err_sum > 0
    # the O path and δ repairs remove most of it; the rest is the bf16 row sum ℓ (2 + ε rounds to 2
    # in every tied row), which they keep: measured 80%, so no single repair is a culprit here
    for name in ("o-fp32", "delta-o-recomputed", "delta-dp-p"):
        assert 0.6 < by[name].reduction < 0.9, (name, by[name].reduction)
    assert {"stats-fp32", "scores-fp32"} <= set(by)  # repairs of the autocast-only bf16 intermediates
    assert "stats-fp32" not in {v.name for v in variants(128)}


def test_bf16_row_sum_is_the_rest_of_the_autocast_delta_bias():
    from fa_forensics.analyses.primitives import delta_of
    from fa_forensics.fidelity.recipe import hp_config
    from fa_forensics.layers.selection import replay_layer

    t = planted_layer(step=0, seed=0, T=128)
    delta_hp = delta_of(t.do, replay_layer(t, hp_config(), backward=False).o)  # (B, h, T)
    base = Recipe("bf16-autocast").base_config().with_(delta="dp-p")  # δ without O
    with_bf16_stats = replay_layer(t, base, backward=True).delta.double() - delta_hp
    with_fp32_stats = replay_layer(t, base.with_(stats_dtype="fp32"), backward=True).delta.double() - delta_hp
    assert float(with_bf16_stats[:, 0].sum()) > 0.05  # the planted head's Σδ error stays positive
    assert abs(float(with_fp32_stats[:, 0].sum())) < 1e-3


def test_fix_variants_derive_from_the_preset():
    vs = {v.name: v for v in fix_variants(Recipe("bf16-autocast").base_config(), "bf16-autocast")}
    assert vs["baseline"].config == ReplayConfig.preset("bf16-autocast").with_(accumulation=Accumulation.IEEE)
    assert vs["fp32-pv"].config.rescale_dtype is FP32 and vs["fp32-pv"].config.pv_dtype is FP32
    assert vs["stabilized"].config.block_n == 512 and vs["stabilized"].config.stats_dtype is BF16
    assert fix_variants()[0].config == ReplayConfig()  # default unchanged


def _autocast_row(q, k, row, stabilized, beta=2.0, eps=1e-3):
    """P̄ of one row as the paper's reference code computes it (bf16 ops, one block, causal)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    S = matmul(q[row : row + 1].float(), k[: row + 1].float().T.contiguous(), "ieee").to(torch.bfloat16)
    S = (S.float() * torch.tensor(scale, dtype=torch.float32)).to(torch.bfloat16)[0]  # (K,) bf16
    r_m = S.amax()
    if stabilized and int((S >= r_m - eps).sum()) > 1:
        r_m = beta * r_m if r_m > 0 else (torch.zeros_like(r_m) if r_m < 0 else r_m)
    return torch.exp((S - r_m).float()).to(torch.bfloat16).float()


@pytest.mark.parametrize("stabilized", [False, True])
def test_p_bar_row_under_autocast_equals_the_reference_code_bit_for_bit(stabilized):
    g = torch.Generator().manual_seed(3)
    T, D = 96, 24
    q = (2 * torch.randn(T, D, generator=g)).bfloat16()
    k = (2 * torch.randn(T, D, generator=g)).bfloat16()
    k[1::2] = k[0::2]  # identical key pairs: repeated maxima
    q[1::3] = (2 * k[0::3])[: q[1::3].shape[0]]
    cfg = ReplayConfig.preset("bf16-autocast").with_(softmax="stabilized" if stabilized else "standard")
    n_fired = 0
    for row in (5, 40, 70, 95):
        p_lp, p_hp = p_bar_row(q[row], k, 1.0 / math.sqrt(D), row + 1, config=cfg)
        want = _autocast_row(q, k, row, stabilized)
        assert torch.equal(p_lp, want), row
        fired = bool(p_lp.max() < 1)
        n_fired += int(fired)
        # P̄_hp is the fp32 P̄ at the SAME shift m as P̄_lp, so both Ō sums are on one scale: where the
        # stabilized shift fired, neither side has a unit entry
        assert bool(p_hp.max() < 1) == fired, row
    assert (n_fired > 0) == stabilized


def test_autocast_scores_make_repeated_maxima_more_common_and_the_trace_follows_them():
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 128, 32
    q, k = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(2))
    scale = D**-0.5
    rep32 = repeated_max_rows(q, k, scale, True)
    rep16 = repeated_max_rows(q, k, scale, True, "bf16")
    assert int(rep16.sum()) > int(rep32.sum())  # scores within a bf16 ulp of the max tie exactly
    assert bool((rep16 | ~rep32).all())  # every fp32 tie is a bf16 tie
    s16 = scores_fp32(q, k, scale, True, "bf16")
    assert torch.equal(s16[torch.isfinite(s16)].bfloat16().float(), s16[torch.isfinite(s16)])
    b, h, row = [int(i) for i in rep16.nonzero()[0]]
    cfg = ReplayConfig.preset("bf16-autocast")
    p_lp, p_hp = p_bar_row(q[b, h, row], k[b, h], scale, row + 1, config=cfg)
    assert int((p_lp == 1).sum()) >= 2  # the trace sees the tie the preset's scores make
    v = torch.randn(row + 1, generator=g).bfloat16()
    tr = trace_pv(p_lp, p_hp, v, row=row)
    assert len(tr.p_one_positions) >= 2


def test_report_passes_the_preset_to_every_replaying_command():
    args = {name: command_line(name, "d.zarr", {"step": 1}, Recipe("bf16-autocast"),
                               Backend.EMULATE) for name in ANALYSES}
    assert args["bitdiff"][2:8] == ["--step", "1", "--a", "bf16-autocast", "--b", "fp32"]
    assert args["pcast"] == ["pcast", "d.zarr"]
    for name in ("isolate", "delta-bias", "rank1-sim", "pv-trace", "fix-check"):
        assert args[name][4:6] == ["--preset", "bf16-autocast"]
