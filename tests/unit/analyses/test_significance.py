"""One statistics policy and one set of quantities: Holm over the family, the effect floor, the rule for a fix, and
the same Σδ and O numbers quoted by every analysis on the same selection."""
import math
from pathlib import Path

import pytest

from fa_forensics.analyses.significance import (
    ALPHA, EFFECT_FLOOR, Family, big_enough, holm, outcome, removes, significant,
)
from test_analyses_delta_bias import planted_layer

PLANTED = Path(__file__).resolve().parents[3] / "sample_dumps" / "planted.zarr"


def test_holm_steps_down_inside_the_whole_family():
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p, 4) == pytest.approx([0.03, 0.06, 0.06, 0.02])  # 0.005·4, 0.01·3, 0.03·2, max(0.04·1, 0.06)
    # ranked among themselves inside a family of 10: the multipliers count the whole family
    assert holm(p, 10) == pytest.approx([0.09, 0.28, 0.24, 0.05])
    assert holm([math.nan, 0.5], 2) == pytest.approx([1.0, 1.0])  # a test that could not run proves nothing
    assert holm([1e-3], 1) == [1e-3]


def test_significant_needs_the_corrected_p_and_the_effect_floor():
    assert significant(ALPHA / 2, 0.2) and not significant(ALPHA, 0.2)
    assert not significant(1e-12, EFFECT_FLOOR / 2)  # a negligible bias on a long capture is no finding
    assert significant(1e-12, math.nan) and big_enough(math.nan)  # no unit to measure it in: the test decides


def test_the_family_counts_one_test_of_every_item_over_both_subsets_of_rows():
    f = Family(delta_items=12, o_cells=256)
    assert f.n_tests == (12 + 256) * 2 == 536
    assert f.describe() == ("Holm over 536 tests (12 Σδ (step, layer, head) items and 256 O (layer, head, feature) "
                            "cells, each over all rows and tied rows)")
    assert Family(o_cells=1).describe() == ("Holm over 2 tests (1 O (layer, head, feature) cell, each over all rows "
                                            "and tied rows)")
    assert Family(o_cells=1, extra=3).n_tests == 5


@pytest.mark.parametrize("share,residual,expected", [
    (0.95, True, "removed"), (0.6, False, "removed"), (0.6, True, "remains"), (0.3, False, "inconclusive"),
    (-0.5, True, "remains"), (math.nan, True, "remains"), (math.nan, False, "inconclusive"),
])
def test_a_fix_removes_remains_or_cannot_tell(share, residual, expected):
    assert outcome(share, residual) == expected
    assert removes(share, residual) == (expected == "removed")


def test_every_analysis_quotes_the_same_delta_items():
    from fa_forensics.analyses.delta_bias.compute import delta_bias_layers
    from fa_forensics.analyses.isolate.compute import isolate_layers
    from fa_forensics.analyses.rank1_sim.compute import rank1_sim_layers

    layers = [planted_layer(step=s, seed=s, T=128) for s in (0, 1)]
    db, iso, r1 = delta_bias_layers(layers), isolate_layers(layers), rank1_sim_layers(layers)
    key = lambda i: (i.step, i.layer, i.head)  # noqa: E731
    # the same items, to the last bit (repr: a head without tied rows has nan in its empty tied-rows item)
    assert [repr(i) for i in sorted(db.per_step, key=key)] == [repr(i) for i in sorted(iso.heads, key=key)]
    assert db.claim == iso.claim == r1.claim and db.claim.found and db.claim.head == 0
    assert (r1.focus_layer, r1.focus_head) == (db.focus_layer, db.focus_head) == (0, 0)
    base = next(v for v in iso.variants if v.name == "baseline")
    assert base.delta_err_sum == db.total and base.delta_err_se == db.total_se


@pytest.mark.slow
def test_bitdiff_fix_check_and_pv_trace_name_the_same_o_cell_and_sigma_delta():
    from fa_forensics.analyses.registry import BY_NAME
    from fa_forensics.dump import open_dump
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.layers.selection import select

    dump = open_dump(PLANTED)
    sels = select(dump)  # every step: the planted bias's units (step, batch row, tie group) are in all of them
    bd = BY_NAME["bitdiff"].compute(dump, sels, Recipe("bf16"), Recipe("fp32"), "emulate")
    fc = BY_NAME["fix-check"].compute(dump, sels, Recipe("bf16"), "emulate", **BY_NAME["fix-check"].defaults())
    pv = BY_NAME["pv-trace"].compute(dump, sels, Recipe("bf16"), "emulate", **BY_NAME["pv-trace"].defaults())
    db = BY_NAME["delta-bias"].compute(dump, sels, Recipe("bf16"), "emulate", **BY_NAME["delta-bias"].defaults())
    claims = [BY_NAME[n].module("compute").bias_claim(r) for n, r in (("bitdiff", bd), ("fix-check", fc),
                                                                       ("pv-trace", pv))]
    assert claims[0] == claims[2] and claims[0].found
    # fix-check decides its baseline in its one family, the selection's, which counts one test per variant: the
    # same cell, sign and numbers, the same family size and adjusted p as bitdiff's
    same = ("found", "quantity", "layer", "head", "feature", "sign", "value", "se", "p_value", "effect", "subset")
    assert all(getattr(claims[1], f) == getattr(claims[0], f) for f in same), (claims[0], claims[1])
    assert claims[1].n_tests == claims[0].n_tests == fc.family.n_tests
    assert fc.family.extra >= 1 + len(fc.alternatives)
    assert claims[0].adjusted_p == claims[1].adjusted_p
    assert (claims[0].head, claims[0].feature) == (1, dump.ground_truth["planted_feature"])
    assert fc.baseline.o_bias == claims[0].value and pv.cell.mean == claims[0].value
    head = db.claim.head
    assert fc.target["head"] == head and fc.baseline.delta_err_sum == db.focus_total.value  # one Σδ of that head


def test_one_cell_has_the_statistics_of_that_cell_among_all():
    """fix-check measures each variant in the target cell alone: the same numbers as that cell among every cell."""
    from dataclasses import asdict

    import torch

    from fa_forensics.analyses.quantities import cell_sums, o_cell, o_cells

    g = torch.Generator().manual_seed(4)
    parts = [cell_sums(s, 0, [0, 2], 1e-3 * torch.randn(2, 2, 40, 8, generator=g) + 2e-4 * (s + 1),
                       torch.full((2, 2, 40, 8), 4e-3)) for s in (0, 1)]
    every = {(c.layer, c.head, c.feature): c for c in o_cells(parts)}
    for head, feature in ((0, 0), (2, 7)):
        one, among = asdict(o_cell(parts, 0, head, feature)), asdict(every[(0, head, feature)])
        for decided in ("adjusted_p", "significant"):  # Holm needs every cell: one cell alone is undecided
            for d in (one, among, one["tied"], among["tied"]):
                d.pop(decided)
        assert repr(one) == repr(among) and one["n"] == 2 * 2 * 40  # batch × steps × rows (repr: nan equals nan)
        assert one["tied"]["n"] == 0  # no row's maximum repeats here
    assert o_cell(parts, 0, 1, 0) is None and o_cell(parts, 3, 0, 0) is None
