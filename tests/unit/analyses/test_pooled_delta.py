"""Σδ pooled over steps per (layer, head): one more item of the selection's family, and the Σδ claim of a selection
with several steps rests on it (found only when significant with its sign held at every step)."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.analyses.delta_bias.compute import delta_bias_layers
from fa_forensics.analyses.quantities import items_of_errors, layers_family, pool_deltas
from fa_forensics.analyses.significance import FIX_VARIANTS, Family
from fa_forensics.analyses.units import RowUnits

from test_analyses_delta_bias import planted_layer

PLANTED = Path(__file__).resolve().parents[3] / "sample_dumps" / "planted.zarr"


def _flipped(step: int, seed: int, T: int = 128):
    """`planted_layer` with the planted V feature's sign flipped in head 0: its δ error takes the other sign."""
    t = planted_layer(step=step, seed=seed, T=T)
    v = t.v.clone()
    v[:, 0, :, 0] = -v[:, 0, :, 0]
    return dataclasses.replace(t, v=v)


def test_pooling_merges_the_units_of_every_step_and_the_family_counts_it_once_per_head():
    """The pooled item of a head is the test over the union of its steps' units (the same sums a single test over
    all of them gives), and only heads with two or more steps add one to the family."""
    g = torch.Generator().manual_seed(0)
    B, h, T = 2, 2, 40
    dd = [torch.randn(B, h, T, generator=g, dtype=torch.float64) + 0.05 for _ in range(3)]
    units = torch.ones(B, h, T, dtype=torch.float64)
    ids = (torch.arange(T) // 5).view(1, 1, T).expand(B, h, T) + 8 * torch.arange(B).view(B, 1, 1)
    ru = RowUnits(unit=ids.contiguous(), tied=torch.zeros(B, h, T, dtype=torch.bool))
    items = [i for s in range(3) for i in items_of_errors(s, 0, [0, 1], dd[s], units, ru)]
    pooled = pool_deltas(items)
    assert [(p.layer, p.head, p.steps) for p in pooled] == [(0, 0, (0, 1, 2)), (0, 1, (0, 1, 2))]
    # the same as one layer-step holding the three steps' rows, each step's units kept apart
    one = items_of_errors(0, 0, [0, 1], torch.cat(dd, dim=2), torch.cat([units] * 3, dim=2),
                          RowUnits(unit=torch.cat([ids + 16 * s for s in range(3)], dim=2).contiguous(),
                                   tied=torch.zeros(B, h, 3 * T, dtype=torch.bool)))
    for p, i in zip(pooled, one):
        assert p.delta_err_sum == pytest.approx(i.delta_err_sum)
        assert p.delta_err_se == pytest.approx(i.delta_err_se)
        assert p.n_units == i.n_units == 48 and p.t_p_value == pytest.approx(i.t_p_value)
        assert p.step_signs == tuple(int(torch.sign(dd[s][:, p.head].sum())) for s in range(3))
    assert pool_deltas([i for i in items if i.step == 0]) == []  # one step: its item is the test, not made twice
    assert Family(delta_items=6, pooled_heads=2).n_tests == (6 + 2) * 2


def test_a_head_biased_at_every_step_is_found_pooled_and_named_over_its_steps():
    r = delta_bias_layers([planted_layer(step=s, seed=s) for s in range(2)])
    assert r.family.pooled_heads == 2 and r.family == layers_family([planted_layer(step=s) for s in range(2)])
    c = r.claim
    assert c.found and (c.layer, c.head) == (0, 0) and c.step is None and c.steps == (0, 1) and c.sign_holds
    p = r.focus_pooled
    assert p is not None and p.step_signs == (1, 1) and p.holds
    assert (c.value, c.se, c.n_units) == (pytest.approx(p.delta_err_sum), pytest.approx(p.delta_err_se), p.n_units)
    from fa_forensics.analyses.delta_bias.compute import verdict

    assert c.where_steps == "over steps 0..1" and "a bias of the run (its sign holds at every step)" in verdict(r)


def test_a_bias_whose_sign_flips_at_one_step_is_no_bias_of_the_run_though_its_pooled_sum_is_significant():
    """Steps 0 and 1 are biased one way; at step 2 (a short one) the planted feature's sign is flipped, so the head
    errs the other way there, too weakly to be significant alone. Pooled over the three steps the sum is still
    significant, but its sign does not hold at step 2, so nothing is claimed; without step 2 the same head is a bias
    of the run."""
    from fa_forensics.analyses.delta_bias.compute import verdict

    steady = [planted_layer(step=0, seed=0), planted_layer(step=1, seed=2)]
    r = delta_bias_layers([*steady, _flipped(step=2, seed=1, T=16)])
    step2 = next(i for i in r.per_step if (i.step, i.head) == (2, 0))
    assert step2.delta_err_sum < 0 and not step2.found  # the other sign, not significant alone
    p = next(p for p in r.pooled if p.head == 0)
    assert p.significant and p.delta_err_sum > 0 and p.step_signs == (1, 1, -1) and not p.sign_holds
    assert not p.found
    c = r.claim
    assert not c.found and (c.layer, c.head) == (0, 0) and c.steps == (0, 1, 2) and c.opposed_steps == (2,)
    assert "its sign does not hold step after step (step 2 has the other sign)" in verdict(r)
    control = delta_bias_layers(steady).claim
    assert control.found and (control.layer, control.head) == (0, 0) and control.steps == (0, 1)


def test_a_head_flipping_sign_between_synth_steps_of_opposite_v_skew_is_not_found_pooled():
    """Two steps of a planted synth head with opposite v-skew (1: every planted V value negative, 0: positive): the
    steps' Σδ have opposite signs, so the pooled item's sign does not hold and nothing is claimed."""
    from fa_forensics.layers.selection import LayerTensors
    from fa_forensics.planted import SynthSpec, plant_step

    def layer(spec, step):
        t = plant_step(spec, 0, {}, torch.Generator().manual_seed(step + 1)).tensors
        return LayerTensors(step=step, layer=0, heads=[0, 1], q=t["q"], k=t["k"], v=t["v"], o=t["o"], do=t["do"],
                            x=t["x"], scale=spec.head_dim ** -0.5, causal=True)

    spec = SynthSpec(seq=128, heads=2, head_dim=16, batch=2, steps=1, ties=2, v_skew=1.0, planted_heads=(1,))
    r = delta_bias_layers([layer(spec, 0), layer(dataclasses.replace(spec, v_skew=0.0), 1)])
    planted = [i for i in r.per_step if i.head == 1]
    assert planted[0].delta_err_sum * planted[1].delta_err_sum < 0  # opposite signs at the two steps
    p = next(p for p in r.pooled if p.head == 1)
    assert not p.sign_holds and not p.found
    assert not (r.claim.found and r.claim.head == 1)


@pytest.mark.slow
def test_the_planted_dump_is_found_by_its_sigma_delta_pooled_over_steps():
    """planted.zarr: no single step's Σδ item is significant (about 40 units each), the planted head pooled over
    its 3 steps is (126 units), with its sign held at every step."""
    from fa_forensics.analyses.delta_bias.compute import run
    from fa_forensics.dump import open_dump
    from fa_forensics.layers.selection import select

    dump = open_dump(PLANTED)
    r = run(dump, select(dump, None, None, None))
    c = r.claim
    assert not any(i.found for i in r.per_step)
    assert c.found and c.step is None and c.steps == (0, 1, 2) and c.sign_holds and c.adjusted_p < 0.01
    assert c.head in dump.ground_truth["planted_heads"]
    assert r.family.pooled_heads == 4 and r.family.n_tests == (12 + 4 + 256) * 2 + FIX_VARIANTS


@pytest.mark.slow
def test_delta_bias_and_fix_check_print_the_same_family(tmp_path):
    """Every command counts the same family for the same selection, the pooled Σδ items included."""
    from fa_forensics.cli import app
    from fa_forensics.planted import SynthSpec, synth

    path = tmp_path / "two_steps.zarr"
    synth(path, SynthSpec(seq=64, heads=2, head_dim=16, batch=1, steps=2, ties=2))
    sizes = {}
    for command in ("delta-bias", "fix-check"):
        out = tmp_path / f"{command}.json"
        res = CliRunner().invoke(app, [command, str(path), "--json", str(out)])
        assert res.exit_code in (0, 1), res.output
        family = json.loads(out.read_text())["family"]
        assert f"Holm over {family['n_tests']} tests" in " ".join(res.output.split())
        sizes[command] = (family["n_tests"], family["pooled_heads"])
    assert sizes["delta-bias"] == sizes["fix-check"] == ((4 + 2 + 32) * 2 + FIX_VARIANTS, 2)


def test_the_family_counts_every_variant_fix_check_tests():
    from fa_forensics.analyses.fix_check.compute import fix_variants

    assert len([v for v in fix_variants() if v.role != "baseline"]) == FIX_VARIANTS
