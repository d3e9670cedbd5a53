"""isolate on a small in-memory planted layer: Claim 1's repairs remove the δ bias, tiling does not; the
baseline is the recipe exactly as the other analyses replay it, so its Σδ is theirs."""
import pytest
import torch

from fa_forensics.analyses.isolate.compute import isolate_layers, measure_heads, variants
from fa_forensics.replay.config import DeltaSource, Precision
from test_analyses_delta_bias import planted_layer


def test_variants_are_single_repairs_of_the_recipe_as_replayed():
    from fa_forensics.replay.config import ReplayConfig

    untiled = {v.name: v for v in variants(1024)}
    assert untiled["baseline"].config == ReplayConfig()  # preset bf16 is untiled: so is its baseline
    assert "(= baseline under this preset)" in untiled["no-tiling"].description
    vs = {v.name: v for v in variants(1024, ReplayConfig.preset("bf16@block_m=512,block_n=512"), "bf16")}
    base = vs["baseline"].config
    assert (base.block_m, base.block_n) == (512, 512)
    assert vs["no-tiling"].config.block_m is None
    assert vs["pv-fp32"].config.pv_dtype is Precision.FP32 and vs["pv-fp32"].config.o_dtype is Precision.BF16
    assert vs["delta-dp-p"].config.delta is DeltaSource.DP_P and vs["delta-dp-p"].backward
    for v in vs.values():  # every repair changes at most one concern of the baseline (o-fp32: two dtypes)
        diff = [f for f in base.__dataclass_fields__ if getattr(base, f) != getattr(v.config, f)]
        assert len(diff) <= 2, (v.name, diff)


def test_delta_repairs_of_a_kernel_preset_run_the_reference_backward():
    """A kernel preset's backward fixes δ itself, so the δ repairs run the emulator's backward (and say so);
    the baseline keeps the kernel's backward."""
    from fa_forensics.replay.config import ReplayConfig
    from fa_forensics.replay.emulate.backward import backward
    from fa_forensics.replay.emulate.forward import forward

    vs = {v.name: v for v in variants(256, ReplayConfig.preset("sdpa-cudnn-sm90"), "sdpa-cudnn-sm90")}
    assert vs["baseline"].config.backward_kernel.value == "sdpa-cudnn"
    for name, source in (("delta-o-recomputed", DeltaSource.O_RECOMPUTED), ("delta-dp-p", DeltaSource.DP_P)):
        cfg = vs[name].config
        assert cfg.backward_kernel.value == "reference" and cfg.delta is source
        assert "sdpa-cudnn's own fixes δ" in vs[name].description
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 1, 64, 16, generator=g).bfloat16().float() for _ in range(4))
    deltas = []
    for name in ("baseline", "delta-dp-p"):
        cfg = vs[name].config
        f = forward(q, k, v, cfg, causal=True, scale=0.25, generator=None)
        deltas.append(backward(q, k, v, do, f.lse, cfg, causal=True, scale=0.25, o_for_delta=f.o).delta)
    assert not torch.equal(deltas[0], deltas[1])  # the repair changes δ


def test_measure_heads_uses_eq1_for_the_gradient_error():
    g = torch.Generator().manual_seed(0)
    o_var, o_hp = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)
    dd, pk = torch.randn(1, 2, 3, generator=g).double(), torch.randn(1, 2, 3, 4, generator=g).double()
    x = torch.randn(1, 3, 5, generator=g)
    m = measure_heads(o_var, o_hp, dd, pk, x, 0.5)
    dq = -0.5 * dd[0, 1, :, None] * pk[0, 1]  # Eq. 1: dQ_var − dQ_hp = −α diag(δ_var − δ_hp) PK
    assert m[1].dq_err_sq == pytest.approx(float((dq**2).sum()))
    assert m[1].dwq_err_sq == pytest.approx(float(((dq.T @ x[0].double()) ** 2).sum()))
    assert m[1].o_err_sum == pytest.approx(float((o_var - o_hp)[0, 1].double().sum()))
    assert m[1].delta_err_sum == pytest.approx(float(dd[0, 1].sum()))


def test_isolate_names_the_o_and_delta_repairs_and_not_tiling():
    from fa_forensics.fidelity.recipe import Recipe

    r = isolate_layers([planted_layer(step=0, seed=0, T=128)], Recipe("bf16@block_m=64,block_n=64"))
    by = {v.name: v for v in r.variants}
    assert r.n_biased_heads >= 1 and r.heads[0].head == 0 and r.heads[0].delta_err_sum > 0
    assert r.heads[0].significant and r.claim.found and (r.claim.layer, r.claim.head) == (0, 0)
    assert by["baseline"].delta_err_sum > 0 and by["baseline"].o_bias < 0
    for name in ("o-fp32", "delta-o-recomputed", "delta-dp-p"):
        assert name in r.culprits, name
        assert by[name].dq_err < 0.1 * by["baseline"].dq_err
    assert "no-tiling" not in r.culprits  # tiling is not the source (paper §3.2)
    assert by["baseline"].dwq_err is not None and by["baseline"].dwq_err > 0
    assert r.layers[0].layer == 0 and r.baseline_block == 64


@pytest.mark.parametrize("preset", ["sdpa-efficient@bwd_key_splits=2", "sdpa-cudnn-sm90", "sdpa-flash"])
def test_every_kernel_preset_builds_its_repairs(preset):
    """The repairs of a kernel preset drop what only the kernel's model means: the δ repairs its backward's knobs
    (the key splits), the stabilized and stochastic ones the forward's exp, lse, row-sum and 1/ℓ forms."""
    from fa_forensics.replay.config import ReplayConfig

    vs = {v.name: v for v in variants(256, ReplayConfig.preset(preset), preset)}
    assert vs["delta-dp-p"].config.bwd_key_splits is None
    plain = [v.config for v in vs.values() if v.config.softmax.value != "standard"]
    assert plain and all(not c.is_kernel_model for c in plain)


@pytest.mark.parametrize("residual_effect,is_culprit", [(0.005, True), (0.05, False)])
def test_a_repairs_residual_is_significant_by_the_one_rule(residual_effect, is_culprit):
    """Half the bias removed and a residual with a tiny p: significant (no culprit) only when it is also at least the
    effect floor, as fix-check decides a fix's residual."""
    from fa_forensics.analyses.isolate.compute import RepairResult, culprit

    r = RepairResult(name="pv-fp32", description="", o_bias=0.0, o_bias_se=0.0, o_rmse=0.0, delta_err_sum=0.1,
                     delta_err_se=0.01, delta_err_residual=0.1, reduction=0.6, residual_se=0.01, residual_p=1e-5,
                     delta_p_value=1.0, dq_err=0.0, dwq_err=None, residual_effect=residual_effect)
    assert culprit(r) is is_culprit
