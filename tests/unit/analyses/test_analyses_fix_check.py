"""fix-check on a planted input (the paper's "two big, one small"): the stabilized softmax removes the
bias, the fixed offset of App. C does not."""
import math

import pytest
import torch

from fa_forensics.analyses.fix_check.compute import (
    fix_variants, max_p_bar_in_repeated_rows, measure_variant, summarize_fix,
)
from fa_forensics.analyses.primitives import scores_fp32
from fa_forensics.replay import ReplayConfig, replay

FEATURE = 3


def planted(B=1, H=2, T=128, D=32, seed=0, r_m_spread=True):
    """Rows whose maximum score is attained exactly twice (keys 2m and 2m+1 identical, score r_m in
    [10, 16) varying per row, or 15 for every row with r_m_spread=False; the rest ≈ 0),
    V[:, FEATURE] in [-2, -1) and dO[:, FEATURE] < 0. Returns bf16 q, k, v, do."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, H, T // 2, D, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    k = u.repeat_interleave(2, dim=2) * 10.0  # (B, H, T, D)
    m_of_row = (torch.arange(T) // 2 - 1).clamp(min=0)  # row T attends most to the previous pair
    c = (1.0 + 0.6 * torch.rand(B, H, T, 1, generator=g)) if r_m_spread else torch.full((B, H, T, 1), 1.5)
    q = u[:, :, m_of_row] * c * math.sqrt(D)
    v = torch.randn(B, H, T, D, generator=g)
    v[..., FEATURE] = -(1 + torch.rand(B, H, T, generator=g))
    do = 0.1 * torch.randn(B, H, T, D, generator=g)
    do[..., FEATURE] = -(0.5 + torch.rand(B, H, T, generator=g))
    return [x.bfloat16() for x in (q, k, v, do)]


def run_fix_check(**planted_kw):
    q, k, v, do = planted(**planted_kw)
    scale = 1 / math.sqrt(q.shape[-1])
    hp = replay(q, k, v, ReplayConfig.preset("fp32"), causal=True, scale=scale)
    s = scores_fp32(q, k, scale, True)
    variants = fix_variants(beta=2.0, eps=1e-3, offset=1.0)
    parts = {}
    for var in variants:
        if var.deployed is not None:  # stable_attention's own kernels: measured on dumps (tests/cli)
            continue
        out = replay(q, k, v, var.config, causal=True, scale=scale)
        parts[var.name] = [measure_variant(out.o, hp.o, do, out.stats, step=0, layer=0, heads=[0, 1],
                                           max_p_bar_repeated=max_p_bar_in_repeated_rows(s, var.config))]
    return summarize_fix(variants, parts)


@pytest.fixture(scope="module")
def result():
    return run_fix_check(B=2)  # 256 rows per head: enough for the bias to pass Holm over the 64 cells


def test_stabilized_softmax_removes_the_planted_bias(result):
    assert result.target["feature"] == FEATURE
    b, f = result.baseline, result.fixed
    assert b.o_bias < 0 and b.o_bias_p < 0.01  # rounded up in magnitude: O more negative
    assert b.delta_err_sum > 0 and b.delta_p < 0.01  # δ_lp − δ_hp > 0 (dO < 0 there)
    assert result.has_bias and result.claim.found and result.claim.adjusted_p < 0.01
    # the fixed bias is below its noise: not significant, several times smaller
    assert result.removed and result.exit_code == 0 and f.o_bias_p >= 0.01 and result.bias_reduction > 2
    assert result.triggered_rows == b.repeated_max_rows > 0
    assert b.max_p_bar == 1.0 and result.max_p_bar < 1.0 and f.nan_count == 0
    assert "REMOVES" in result.verdict


def test_fixed_offset_is_still_biased_and_others_are_not(result):
    alt = {a.name: a for a in result.alternatives}
    assert alt["fixed-offset"].still_biased and alt["fixed-offset"].o_bias_p < 0.01
    assert alt["fixed-offset"].max_p_bar == pytest.approx(0.3671875)  # e^-1 rounded down to bf16
    assert not alt["stochastic"].still_biased
    assert abs(alt["fp32-pv"].o_bias) < abs(result.baseline.o_bias) / 5


def test_unremoved_bias_gives_exit_code_1(result):
    # the baseline compared with itself as the "fix": nothing removed → exit code 1
    variants = fix_variants()
    variants[1] = variants[1].__class__("stabilized", "fixed", variants[0].config, "baseline again")
    q, k, v, do = planted(B=2)
    scale = 1 / math.sqrt(q.shape[-1])
    hp = replay(q, k, v, ReplayConfig.preset("fp32"), causal=True, scale=scale)
    out = replay(q, k, v, variants[0].config, causal=True, scale=scale)
    part = [measure_variant(out.o, hp.o, do, out.stats, step=0, layer=0, heads=[0, 1])]
    r = summarize_fix(variants, {v.name: part for v in variants})
    assert not r.removed and r.exit_code == 1 and r.bias_reduction == pytest.approx(1.0)



def _variant(name: str, role: str, removed_share: float, residual_significant: bool):
    from fa_forensics.analyses.fix_check.compute import VariantResult
    from fa_forensics.analyses.significance import outcome

    return VariantResult(name=name, role=role, what=name, o_bias=0.0, o_bias_se=0.0, o_bias_p=1.0,
                         delta_err_sum=None, delta_err_se=None, delta_p=None, max_abs_err=0.0, nan_count=0,
                         underflow=None, p_one_count=None, triggered_rows=None, repeated_max_rows=None,
                         max_p_bar=math.nan, still_biased=residual_significant, removed_share=removed_share,
                         outcome=outcome(removed_share, residual_significant))


@pytest.mark.parametrize("deployed_removes", [True, False])
@pytest.mark.parametrize("control_removes", [True, False])
def test_the_deployed_fix_and_its_control_are_worded_as_measured(deployed_removes, control_removes):
    """Each of the four outcomes of stable_attention and plain_attention gets its own words: never "does not remove
    it ... and so does plain_attention" beside a control that removes 93 %."""
    from fa_forensics.analyses.fix_check.compute import _control_clause

    deployed = _variant("stable_attention", "fixed", 0.97 if deployed_removes else 0.48, not deployed_removes)
    control = _variant("plain_attention", "control", 0.93 if control_removes else 0.2, not control_removes)
    text = _control_clause(deployed, [control])
    assert ("stable_attention removes it (97%)" in text) == deployed_removes
    assert ("stable_attention does not remove it (48%)" in text) == (not deployed_removes)
    control_words = {(True, True): "and so does plain_attention", (True, False): "plain_attention, its kernels "
                     "without the fix (20%) does not", (False, True): "though plain_attention, its kernels without "
                     "the fix (93%) does", (False, False): "nor does plain_attention"}
    assert control_words[(deployed_removes, control_removes)] in text, text


def test_a_variant_that_did_not_run_on_every_layer_step_is_left_out():
    """stable_attention runs only where its contract applies: where it skipped the layer-step of the target cell, the
    fix check compares the baseline with the variants measured on the same rows, never fails on the missing cell."""
    variants = fix_variants(beta=2.0, eps=1e-3, offset=1.0)
    parts: dict = {}
    for layer, seed in ((0, 0), (1, 5)):
        q, k, v, do = planted(B=1, seed=seed)
        scale = 1 / math.sqrt(q.shape[-1])
        hp = replay(q, k, v, ReplayConfig.preset("fp32"), causal=True, scale=scale)
        for var in variants:
            if var.deployed is not None and layer == 0:
                continue  # outside stable_attention's contract at layer 0
            out = replay(q, k, v, var.config, causal=True, scale=scale)  # its stand-in: the same replay as baseline
            parts.setdefault(var.name, []).append(
                measure_variant(out.o, hp.o, do, out.stats, step=0, layer=layer, heads=[0, 1]))
    r = summarize_fix(variants, parts)
    assert r.target["layer"] in (0, 1) and r.has_bias
    names = {r.fixed.name, *(a.name for a in r.alternatives)}
    assert not names & {"stable_attention", "plain_attention"} and r.fixed.name == "stabilized"


@pytest.mark.parametrize("share,words", [(0.95, "FIX REMOVES THE BIAS at"), (0.59, "FIX REMOVES MOST OF THE BIAS at")])
def test_a_fix_that_removes_half_of_the_bias_says_most(result, share, words):
    """The policy's "removes" covers ≥ 90 % gone, or ≥ 50 % with nothing significant left: the second is worded as
    most of the bias removed, the rest not significant, not as the bias removed."""
    import dataclasses

    from fa_forensics.analyses.fix_check.compute import _decide
    from fa_forensics.analyses.quantities import BiasCell
    from types import SimpleNamespace

    from fa_forensics.report.conclusions import conclude
    from fa_forensics.report.verdict import _fix

    fixed = dataclasses.replace(result.fixed, removed_share=share, outcome="removed", still_biased=False)
    target = BiasCell(result.target["layer"], result.target["head"], result.target["feature"], 0.0, 0.0, 1.0, 0.5, 1)
    outcome, verdict = _decide(result.baseline, fixed, result.alternatives, result.claim, result.family, target,
                               result.collapse, 1 / (1 - share))
    assert outcome == "removed" and verdict.startswith(words)
    assert ("what is left is not significant" in verdict) == (share < 0.9)
    payload = {"outcome": "removed", "has_bias": True, "bias": {"found": True, "quantity": "O"},
               "fixed": {"name": "stabilized", "removed_share": share}}
    line = _fix({"fix-check": conclude(SimpleNamespace(name="fix-check", data=payload, note=""))}, "")
    assert ("removes most of it" in line) == (share < 0.9) and "removes" in line


def test_the_family_is_said_once_and_is_the_one_the_decision_used(result):
    """The verdict's Holm count, the table's family and the JSON's are one number: the family the baseline's claim
    and every variant's residual were decided in (the selection's tests plus two per variant)."""
    import re

    from fa_forensics.analyses.fix_check.compute import payload
    from fa_forensics.analyses.fix_check.table import tables

    n_variants = 1 + len(result.alternatives)
    assert result.family.extra == n_variants and result.claim.n_tests == result.family.n_tests
    title = str(tables(result)[0].title)
    said = {int(n) for n in re.findall(r"over (\d+) tests", result.verdict + " " + title)}
    assert said == {result.family.n_tests}, (said, result.verdict, title)
    assert payload(result)["family"]["n_tests"] == result.family.n_tests == payload(result)["bias"].n_tests


@pytest.mark.parametrize("residual", [+2.0, -0.5])
def test_a_variant_that_reverses_the_bias_is_said_to(result, residual):
    """A still-biased variant whose residual has the opposite sign of the baseline's reverses the bias: the verdict
    and the table say so (and do not for a residual of the baseline's sign)."""
    import dataclasses

    from fa_forensics.analyses.fix_check.compute import _decide
    from fa_forensics.analyses.fix_check.table import _still
    from fa_forensics.analyses.quantities import BiasCell

    b = result.baseline
    offset = next(a for a in result.alternatives if a.name == "fixed-offset")
    moved = dataclasses.replace(offset, o_bias=residual * b.o_bias, o_bias_adjusted_p=1e-6, still_biased=True)
    others = [moved if a.name == "fixed-offset" else a for a in result.alternatives]
    target = BiasCell(result.target["layer"], result.target["head"], result.target["feature"], 0.0, 0.0, 1.0, 0.5, 1)
    _, verdict = _decide(b, result.fixed, others, result.claim, result.family, target, result.collapse, 10.0)
    reversed_ = residual < 0
    assert ("fixed-offset (reverses the bias: " in verdict) == reversed_, verdict
    assert "still biased: fixed-offset" in verdict
    assert _still(moved, b) == ("yes, reversed" if reversed_ else "yes") and _still(b, b) == "—"
