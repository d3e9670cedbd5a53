"""The unit of evidence: rows that share their dominant key set in one (step, batch row) count once.

Unit tests of `analyses.units` (which rows form a unit) and `stats.unit_test` (the cluster-robust tests), and on
real synth dumps: a null with tie groups of random sign claims nothing where rows taken one by one do; a bias
confined to tied rows is found in the tied-rows subset; fix-check decides its baseline and variants in one family.
"""
import math

import numpy as np
import pytest
import torch
from scipy.stats import ttest_1samp

from fa_forensics.analyses.significance import TIED_ROWS, Family
from fa_forensics.analyses.stats import unit_sums, unit_test
from fa_forensics.analyses.units import rows_as_units, units_of_scores

NEG = -math.inf


def test_rows_that_share_their_maximum_key_form_one_unit_and_ties_are_marked():
    s = torch.tensor([[[[5.0, 1.0, NEG], [4.0, 2.0, NEG], [1.0, 3.0, 3.0], [1.0, 3.0, 3.0], [2.0, 2.0, 0.0]]]])
    u = units_of_scores(s)  # (1, 1, 5) rows
    ids = u.unit[0, 0].tolist()
    assert ids[0] == ids[1]  # both dominated by key 0
    assert ids[2] == ids[3]  # the same tied set {1, 2}
    assert len({ids[0], ids[2], ids[4]}) == 3  # {0}, {1, 2}, {0, 1}: three sets
    assert u.tied[0, 0].tolist() == [False, False, True, True, True]
    assert u.n_units == [3]


def test_units_never_span_batch_rows():
    s = torch.zeros(2, 1, 3, 4)
    s[..., 1] = 1.0  # every row of both batch rows dominated by key 1
    u = units_of_scores(s)
    assert u.n_units == [2]
    assert set(u.unit[0, 0].tolist()).isdisjoint(u.unit[1, 0].tolist())


def test_with_every_row_its_own_unit_the_tests_are_the_row_t_test():
    x = torch.randn(200, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.1
    t = unit_test(unit_sums(x, rows_as_units((1, 1, 200)).unit[0, 0]))
    ref = ttest_1samp(x.numpy(), 0.0)
    assert float(t.se) == pytest.approx(float(x.std() / math.sqrt(200)), rel=1e-12)
    assert float(t.t_p_value) == pytest.approx(ref.pvalue, rel=1e-9)
    assert int(t.n_units) == 200


def test_clustered_se_is_larger_than_row_se_on_correlated_rows():
    g = torch.Generator().manual_seed(7)
    unit = torch.arange(20).repeat_interleave(30)  # 20 units of 30 rows
    x = torch.randn(20, dtype=torch.float64, generator=g)[unit] + 0.1 * torch.randn(600, dtype=torch.float64,
                                                                                  generator=g)
    clustered = unit_test(unit_sums(x, unit))
    rows = unit_test(unit_sums(x, torch.arange(600)))
    assert float(clustered.mean) == pytest.approx(float(rows.mean))
    assert float(clustered.se) > 4 * float(rows.se)  # √30 ≈ 5.5 when units share their value
    assert int(clustered.n_units) == 20 and int(clustered.n) == 600
    signs = (x.view(20, 30).sum(1) > 0).sum()
    assert float(clustered.frac_positive) == pytest.approx(float(signs) / 20)


def test_a_few_heavy_units_carry_the_few_degrees_of_freedom_beside_many_small_ones():
    """Eight tie groups holding most rows, all erring one way by chance, beside 45 one-row units of noise: the
    t-test reads the CR1 error against the heavy units' degrees of freedom (about 7), not G − 1 = 52; the same
    units sharing only a dominant key (not tied) err nearly independently and keep more."""
    g = torch.Generator().manual_seed(3)
    heavy = torch.arange(8).repeat_interleave(226)
    unit = torch.cat([heavy, 8 + torch.arange(45)])
    per_unit = 0.4 + 0.05 * torch.randn(53, dtype=torch.float64, generator=g)
    per_unit[8:] = torch.randn(45, dtype=torch.float64, generator=g)
    x = per_unit[unit] + 0.01 * torch.randn(unit.numel(), dtype=torch.float64, generator=g)
    tied = torch.cat([torch.ones(8 * 226, dtype=torch.bool), torch.zeros(45, dtype=torch.bool)])
    t = unit_test(unit_sums(x, unit, tied=tied))
    assert int(t.n_units) == 53
    assert 6.5 < float(t.df) < 8.0
    untied = unit_test(unit_sums(x, unit))
    assert float(untied.df) == pytest.approx((8 * 226 + 45) ** 2 / (8 * 226 ** 2 + 45) - 1)
    assert float(untied.se) == float(t.se) and float(untied.t_p_value) < float(t.t_p_value)
    from scipy.stats import t as student_t
    z = abs(float(t.mean / t.se))
    assert float(t.t_p_value) == pytest.approx(2 * student_t.sf(z, float(t.df)), rel=1e-9)
    assert float(t.t_p_value) > 100 * 2 * student_t.sf(z, 52)  # what G − 1 would have claimed
    equal = unit_test(unit_sums(x[: 8 * 226], heavy, tied=tied[: 8 * 226]))  # units of one size: G − 1
    assert float(equal.df) == pytest.approx(7.0)


def test_a_unit_holds_its_rows_in_every_cell_and_leaves_out_non_finite_values():
    x = torch.tensor([[1.0, math.nan], [3.0, 2.0], [-1.0, 4.0]], dtype=torch.float64)
    s = unit_sums(x, torch.tensor([0, 0, 1]))
    assert s.n.tolist() == [3, 2] and s.s1.tolist() == [3.0, 6.0] and s.n_units.tolist() == [2, 2]
    assert s.u_pos.tolist() == [1, 2] and s.u_neg.tolist() == [1, 0]
    tied = unit_sums(x, torch.tensor([0, 0, 1]), rows=torch.tensor([False, True, True]))
    assert tied.n.tolist() == [2, 2] and tied.s1.tolist() == [2.0, 6.0]


def test_the_family_counts_both_subsets_of_rows():
    assert Family(delta_items=3, o_cells=10).n_tests == (3 + 10) * 2
    assert "all rows and tied rows" in Family(o_cells=1).describe()


# ---- on real synth dumps --------------------------------------------------------------------------------

def _o_claims(path):
    """The O claim of a synth dump (preset bf16, its stored O's) with rows taken one by one and with units."""
    from fa_forensics.analyses.quantities import cell_sums, o_cells, o_claim, o_units, selection_family
    from fa_forensics.analyses.units import layer_units
    from fa_forensics.dump import open_dump
    from fa_forensics.fidelity.recipe import Recipe, hp_config, lp_config_for
    from fa_forensics.layers.selection import as_seen_by, load, replay_layer, select

    dump = open_dump(path)
    sels = select(dump)
    by_row, by_unit = [], []
    for sel in sels:
        lp = lp_config_for(dump, sel.step, sel.layer, Recipe("bf16"))
        t = as_seen_by(load(dump, sel), lp)
        hp = replay_layer(t, hp_config(), backward=False).o
        err = replay_layer(t, lp, backward=False).o.double() - hp.double()
        unit = o_units(hp, lp.o_dtype.value)
        by_row.append(cell_sums(t.step, t.layer, t.heads, err, unit))
        by_unit.append(cell_sums(t.step, t.layer, t.heads, err, unit, layer_units(t, lp)))
    family = selection_family(dump, sels)
    return o_claim(o_cells(by_row, family), family), o_claim(o_cells(by_unit, family), family)


@pytest.mark.slow
def test_tie_groups_of_random_sign_are_no_finding_once_a_group_counts_once(tmp_path):
    from fa_forensics.planted import SynthSpec, synth

    # a null: each tie group errs one way, its sign drawn at random; rows one by one claim a bias (Holm p 0.0009)
    synth(tmp_path / "null.zarr", SynthSpec(seq=128, heads=2, head_dim=16, batch=2, steps=2, ties=2, v_skew=0.5,
                                            seed=3))
    by_row, by_unit = _o_claims(tmp_path / "null.zarr")
    assert by_row.found  # the false alarm of rows taken as independent
    assert not by_unit.found and by_unit.n_units < by_row.n_units


@pytest.mark.slow
def test_a_bias_confined_to_tied_rows_is_found_there(tmp_path):
    from fa_forensics.planted import SynthSpec, synth

    # two tie groups in the second half of the keys, one-signed V: the bias lives in the tied rows
    synth(tmp_path / "late.zarr", SynthSpec(seq=128, heads=2, head_dim=16, batch=8, steps=4, ties=2, v_skew=1.0,
                                            tie_groups=2, tie_start=0.5, seed=0))
    _, claim = _o_claims(tmp_path / "late.zarr")
    assert claim.found and claim.subset == TIED_ROWS and claim.head == 1 and claim.sign == -1
    assert 32 <= claim.n_units < claim.n_rows
    assert claim.effect >= 0.01 and claim.adjusted_p < 0.01


def test_a_variant_is_judged_in_the_baselines_family():
    from fa_forensics.analyses.fix_check.compute import _variants_in_family, one_family
    from fa_forensics.analyses.quantities import BiasCell
    from fa_forensics.analyses.significance import holm

    cells = [BiasCell(0, 0, f, 1e-3, 1e-4, p, 0.5, 100, 1e-2, p) for f, p in enumerate(np.geomspace(1e-4, 0.5, 16))]
    family = Family(o_cells=len(cells))
    joint = one_family(family, 2)
    adjusted = _variants_in_family(cells, [1e-4, 0.5], joint)
    assert joint.n_tests == family.n_tests + 2 and joint.o_cells == family.o_cells
    # a variant as significant as the baseline's best cell is adjusted no less than that cell is in the family
    base_adjusted = holm([c.tested_p for c in cells], joint.n_tests)[0]
    assert adjusted[0] >= base_adjusted
    assert adjusted[1] == 1.0


@pytest.mark.slow
def test_fix_check_never_calls_a_variant_still_biased_where_the_baseline_has_no_bias(tmp_path):
    from fa_forensics.analyses.quantities import selection_family
    from fa_forensics.analyses.registry import BY_NAME
    from fa_forensics.dump import open_dump
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.layers.selection import select
    from fa_forensics.planted import SynthSpec, synth

    # the tied null above: rows one by one would claim a bias, units do not
    synth(tmp_path / "null.zarr", SynthSpec(seq=128, heads=2, head_dim=16, batch=2, steps=2, ties=2, v_skew=0.5,
                                            seed=3))
    dump = open_dump(tmp_path / "null.zarr")
    fc = BY_NAME["fix-check"].compute(dump, select(dump), Recipe(), "emulate", **BY_NAME["fix-check"].defaults())
    variants = [fc.fixed, *fc.alternatives]
    assert not fc.has_bias and fc.outcome == "no-bias" and fc.exit_code == 0
    assert not any(v.still_biased for v in variants)
    # one family, the baseline's claim's and the printed one: the selection's, which counts one test per variant
    assert fc.family.n_tests == fc.claim.n_tests == selection_family(dump, select(dump)).n_tests
    assert fc.family.extra >= len(variants)
    assert all(v.o_bias_adjusted_p >= min(v.o_bias_p * 2, 1.0) for v in variants)
    assert "still biased: " not in fc.verdict


def test_the_mean_is_tested_not_the_median():
    # errors skewed with a mean of exactly 0: 55 % small negatives, 45 % larger positives, one row per unit
    x = torch.cat([torch.full((2200,), -9 / 16), torch.full((1800,), 11 / 16)]).to(torch.float64)
    t = unit_test(unit_sums(x, torch.arange(4000)))
    assert float(t.mean) == pytest.approx(0.0, abs=1e-12)
    assert float(t.p_value) < 1e-9  # the sign test sees the median's shift ...
    assert float(t.t_p_value) > 0.99  # ... the t-test, the one the family counts, sees no bias
    from fa_forensics.analyses.quantities import BiasCell

    cell = BiasCell(0, 0, 0, float(t.mean), float(t.se), float(t.p_value), float(t.frac_positive), 4000,
                    t_p_value=float(t.t_p_value))
    assert cell.tested_p == float(t.t_p_value)
    assert BiasCell(0, 0, 0, 0.0, math.nan, 1.0, math.nan, 1).tested_p == 1.0  # no units to test: counts as 1


def test_one_error_repeated_in_every_unit_is_judged_by_its_units_signs():
    # no spread for the t-test: the units' signs decide (all 10 agree: 2^(1-10))
    x = torch.full((40,), -3 * 2.0 ** -10, dtype=torch.float64)
    t = unit_test(unit_sums(x, torch.arange(40) // 4))
    assert float(t.se) == 0 and float(t.t_p_value) == pytest.approx(2.0 ** -9)
    zeros = unit_test(unit_sums(torch.zeros(40, dtype=torch.float64), torch.arange(40) // 4))
    assert float(zeros.t_p_value) == 1.0


@pytest.mark.slow
def test_a_skewed_feature_of_a_tied_null_is_no_finding(tmp_path):
    import json

    from typer.testing import CliRunner

    from fa_forensics.analyses.calibration import TIED_NULL_SHAPES, make_null
    from fa_forensics.cli import app

    # seed 167 of the tied null family (T 2048): in layer 0 head 0 feature 18, 55 % of the 2047 single-row units are
    # positive (sign-test p ~ 2e-5) while the mean is 2.7 standard errors from 0 among ~140 tests: no bias
    dump = make_null(tmp_path / "null167.zarr", 167, TIED_NULL_SHAPES)
    res = CliRunner().invoke(app, ["bitdiff", str(dump), "--json", str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "b.json").read_text())
    cell = next(c for c in d["mean_signed_error"] if (c["layer"], c["head"], c["feature"]) == (0, 0, 18))
    assert cell["p_value"] < 1e-4 and cell["t_p_value"] > 1e-3 and cell["n_units"] > 2000
    assert not d["bias"]["found"] and d["biased_features"] == []
