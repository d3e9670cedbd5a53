"""Reading replay fidelity: candidates the recorded facts allow, the accumulation model the device implies,
the sign test of the elements a replay does not reproduce, and how per-layer recipes are named."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fa_forensics.fidelity.candidates import (
    CLEAR_MARGIN, admissible, admit, exclusions, implied, pick_best, traits, why_not_named,
)
from fa_forensics.analyses.significance import ALPHA
from fa_forensics.fidelity.match import candidate_recipes, fidelity
from fa_forensics.fidelity.mismatch import sign_test, tally, ulp_difference
from fa_forensics.fidelity.planner import plan_for
from fa_forensics.fidelity.recipe import Choice, Recipe
from fa_forensics.fidelity.run_facts import UNKNOWN, RunFacts, facts_at
from fa_forensics.layers.selection import load, replay_layer, select
from fa_forensics.dump import open_dump
from fa_forensics.enums import Accumulation
from fa_forensics.replay.config import ReplayConfig


def _facts(**kw) -> RunFacts:
    return RunFacts(**{**UNKNOWN.__dict__, **kw})


@dataclass(frozen=True)
class _Tried:
    preset: str
    accumulation: str
    o_bits_equal: float
    max_abs_err: float = 1e-3


def test_a_bf16_run_is_never_an_fp8_run_and_an_fp32_run_only_fp32():
    names = lambda facts: {r.preset for r in admissible(candidate_recipes(), facts)}  # noqa: E731
    bf16 = names(_facts(precision="bf16"))
    assert not any(n.startswith(("fp8", "fp16", "fp32")) for n in bf16) and "bf16-autocast-train" in bf16
    assert names(_facts(precision="fp32")) == {"fp32", "fp32-stabilized"}
    assert names(_facts(precision="fp32", softmax="stabilized")) == {"fp32-stabilized"}  # never FP8, never all
    assert names(_facts(precision="fp8")) == {"fp8-s1", "fp8-s256", "fp8-s448"}
    # nothing recorded: nothing ruled out but the plain-ops recipes, which replay a recorded op sequence
    assert names(UNKNOWN) == {r.preset for r in candidate_recipes()} - {"eager-reexec", "eager"}
    standard = names(_facts(precision="bf16", softmax="standard"))
    assert not any("stabilized" in n for n in standard)
    sdpa = names(_facts(precision="bf16", kernel="sdpa"))
    assert not any(n.startswith("bf16-autocast") for n in sdpa) and {"bf16", "bf16-hw"} <= sdpa


def test_cpu_autocast_with_the_stabilized_softmax_has_its_own_recipe():
    every = candidate_recipes(on_gpu=False)
    kept = {r.preset for r in admissible(every, _facts(precision="bf16", softmax="stabilized", device="cpu",
                                                        kernel="blocked_attention:BlockedAttention,layout=BHTD"))}
    assert "bf16-autocast-cpu-stabilized" in kept and all(traits(n).softmax == "stabilized" for n in kept)
    on_gpu = {r.preset for r in admissible(candidate_recipes(on_gpu=True),
                                           _facts(precision="bf16", softmax="stabilized", device="cuda"))}
    assert "bf16-autocast-stabilized" in on_gpu and "bf16-autocast-cpu-stabilized" not in on_gpu


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32", "fp8", None])
@pytest.mark.parametrize("softmax", ["standard", "stabilized", None])
@pytest.mark.parametrize("device", ["cpu", "cuda", None])
@pytest.mark.parametrize("kernel", [None, "sdpa", "flash_attn.flash_attn_func", "mymodule:attention,layout=BHTD"])
def test_every_combination_of_recorded_facts_has_recipes_that_fit_every_fact(precision, softmax, device, kernel):
    """The candidates are the product of the facts: each admitted recipe agrees with every recorded fact, and no
    combination is left without recipes (the FP8 recipes model the standard softmax only: there, the softmax is set
    aside and said so)."""
    facts = _facts(precision=precision, softmax=softmax, device=device, kernel=kernel)
    dtype = {"fp16": "float16"}.get(precision, "bfloat16")
    every = candidate_recipes(head_dim=64, n_keys=256, dtype=dtype, on_gpu=facts.on_gpu)
    admission = admit(every, facts)
    assert admission.recipes
    if softmax == "stabilized" and precision == "fp8":
        assert admission.relaxed == ("softmax",)  # no recipe models these together: said, not hidden
        return
    assert admission.relaxed == ()
    for r in admission.recipes:
        assert exclusions(r.preset, facts) == [], r
    for r, why in admission.excluded:
        assert why == exclusions(r.preset, facts) and why


def test_a_cpu_run_never_ran_a_gpu_kernel():
    every = candidate_recipes(on_gpu=True)
    gpu_kernels = {r.preset for r in every if r.preset.startswith(("sdpa-", "flash-attn-"))}
    assert gpu_kernels  # the catalogue offers SDPA's and flash_attn's kernels
    kept = lambda device: {r.preset for r in admissible(every, _facts(precision="bf16", device=device))}  # noqa: E731
    assert gpu_kernels <= kept("cuda") and gpu_kernels <= kept(None)
    assert not gpu_kernels & kept("cpu") and "bf16-autocast-cpu" in kept("cpu")


def test_auto_keeps_the_accumulation_the_device_implies_unless_the_other_is_clearly_better():
    ieee, tc = _Tried("bf16-hw", "ieee", 0.97560), _Tried("bf16-hw", "tensor-core", 0.97562)  # 0.002 % apart
    assert pick_best([ieee, tc], _facts(device="cpu")) is ieee
    assert why_not_named(ieee, tc, _facts(device="cpu")).startswith("the recorded device cpu implies ieee")
    assert pick_best([ieee, tc], UNKNOWN) is tc  # no device recorded: no preference, the best
    assert pick_best([ieee, tc], _facts(device="cuda")) is tc
    far = _Tried("bf16-hw", "tensor-core", 0.9756 + CLEAR_MARGIN)
    assert pick_best([ieee, far], _facts(device="cpu")) is far
    exact = _Tried("bf16", "tensor-core", 1.0)
    assert pick_best([_Tried("bf16", "ieee", 0.999), exact], _facts(device="cpu")) is exact


def test_the_recipe_implied_where_o_cannot_be_matched():
    assert implied(_facts(precision="bf16", dropout_p=0.1, device="cpu"), "bf16")[:2] == ("bf16-hw", Accumulation.IEEE)
    on_gpu = implied(_facts(precision="bf16", dropout_p=0.1, device="cuda"), "bf16")
    assert on_gpu[:2] == ("bf16-hw", Accumulation.TENSOR_CORE)
    assert implied(_facts(precision="bf16", kernel="sdpa"), "bf16")[0] == "bf16-hw"
    assert implied(_facts(precision="bf16", kernel="record"), "bf16")[0] == "bf16"
    preset, acc, why = implied(_facts(precision="fp32"), "bf16")
    assert (preset, acc) == ("bf16", Accumulation.IEEE) and "what bf16 would do" in why


def _bumped(stored: torch.Tensor, where: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """stored with the elements `where` moved one bf16 ulp away from zero (`up`) or towards it."""
    bits = stored.view(torch.int16).clone()
    bits[where] += torch.where(up[where], 1, -1).to(torch.int16)
    return bits.view(torch.bfloat16)


def test_the_sign_test_tells_unbiased_from_biased_mismatches(make_dump):
    """The replay of a dump whose O is the bf16 preset's, against stored O with 3 % of elements one ulp off."""
    path = make_dump(steps=(0,), batch=2, heads=2, seq=64, head_dim=8)
    dump = open_dump(path)
    (sel,) = select(dump)
    t = load(dump, sel)
    replayed = replay_layer(t, ReplayConfig.preset("bf16"), backward=False).o
    assert torch.equal(replayed.to(torch.bfloat16), t.o)
    g = torch.Generator().manual_seed(3)
    where = torch.rand(t.o.shape, generator=g) < 0.03
    positive = t.o.float() > 0

    random_signs = torch.rand(t.o.shape, generator=g) < 0.5
    noisy = _bumped(t.o, where, random_signs)
    assert (ulp_difference(noisy, replayed).abs() <= 1).all()
    fair = sign_test([tally(0, 0, sel.heads, replayed, noisy)], ALPHA)
    assert not fair.biased and fair.verdict.startswith("the mismatches are unbiased (p = ")
    assert fair.n_mismatched == int(where.sum()) and set(fair.ulp_histogram) == {"-1", "+1"}

    feature = torch.zeros_like(where)
    feature[..., 5] = True  # in feature 5 a third of the elements mismatch, every one upwards (stored > replayed)
    where = where | (feature & (torch.rand(t.o.shape, generator=g) < 0.3))
    skewed = _bumped(t.o, where, torch.where(feature, positive, random_signs))
    biased = sign_test([tally(0, 0, sel.heads, replayed, skewed)], ALPHA)
    assert biased.biased and biased.worst.feature == 5 and biased.worst.share_positive == 1.0
    assert "do not trust the bias findings" in biased.verdict and biased.p_feature < ALPHA

    thin = _bumped(t.o, torch.rand(t.o.shape, generator=g) < 0.03, positive)  # every mismatch upwards, few per feature
    overall = sign_test([tally(0, 0, sel.heads, replayed, thin)], ALPHA)
    assert overall.biased and overall.p_feature >= ALPHA / 2 and overall.p_pooled < 1e-10
    assert overall.verdict.startswith("the mismatches are biased overall (p = ")

    assert sign_test([tally(0, 0, sel.heads, replayed, t.o)], ALPHA) is None  # nothing mismatches: nothing to test


def test_layers_that_differ_only_in_accumulation_name_the_preset(make_dump):
    path = make_dump(steps=(0, 1), seq=16)
    dump = open_dump(path)
    sels = select(dump)
    recipe = Recipe(choices=(((0, 0), Choice("bf16", Accumulation.IEEE, 1.0)),
                             ((1, 0), Choice("bf16", Accumulation.TENSOR_CORE, 1.0))))
    fid = fidelity(dump, sels, plan_for(dump, sels, recipe), alpha=ALPHA)
    assert (fid.preset, fid.accumulation) == ("bf16", "per layer")
    assert fid.run_precision == "bf16" and fid.verifiable
    assert [(p.step, p.accumulation) for p in fid.per_layer] == [(0, "ieee"), (1, "tensor-core")]


def test_facts_are_read_defensively(make_dump):
    """A dump whose layers record no dtype, autocast or dropout: precision from the stored dtype, the rest unknown."""
    facts = facts_at(open_dump(make_dump(steps=(0,), seq=16, dtype=torch.float32)), 0, 0)
    assert facts.precision == "fp32" and facts.autocast is None and facts.softmax is None and facts.dropout_p == 0
    assert facts_at(None, 0, 0) == UNKNOWN


def test_facts_as_a_capture_records_them(make_dump):
    """Layer attributes of a capture that records its entry point, device and softmax variant ("unknown" = None)."""
    import zarr

    path = make_dump(steps=(0,), seq=16)
    group = zarr.open_group(str(path), mode="r+")["step_000000000/layer_000"]
    group.attrs.update({"source": "sdpa", "softmax": "standard", "device_type": "cuda", "autocast": True,
                        "dtype": "bfloat16", "dropout_p": 0.0})
    facts = facts_at(open_dump(path), 0, 0)
    assert (facts.kernel, facts.softmax, facts.device) == ("sdpa", "standard", "cuda")
    assert facts.autocast is True and facts.precision == "bf16"
    group.attrs.update({"softmax": "unknown"})
    assert facts_at(open_dump(path), 0, 0).softmax is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ulp_difference_counts_representable_values_across_zero(dtype):
    a = torch.tensor([0.0, -0.0, 1.0, -1.0]).to(dtype)
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    b = torch.tensor([tiny, tiny, 1.0, -1.0], dtype=torch.float64).to(dtype)
    assert ulp_difference(a, b).tolist() == [-1, -1, 0, 0]


def test_a_share_below_one_never_reads_as_every_bit():
    from fa_forensics.analyses.wording import bit_share

    assert bit_share(1.0) == "100.0 %" and bit_share(0.5) == "50.0 %" and bit_share(float("nan")) == "n/a"
    assert bit_share(0.99973) == "99.97 %" and bit_share(0.999996) == "99.9996 %"
