"""rank1-sim pieces against plain-torch references, and the planted stand-out input features."""
import math

import pytest
import torch

from fa_forensics.analyses.primitives import attention_probs
from fa_forensics.analyses.rank1_sim.compute import (
    column_weights, effective_rank, gradient_error, growth_exponent, rank1_cosines, rank1_sim_layers,
)
from test_analyses_delta_bias import planted_layer


def test_gradient_error_equals_explicit_sum_of_rank1_matrices():
    g = torch.Generator().manual_seed(0)
    dd, pk = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    x = torch.randn(2, 5, 6, generator=g)
    E = gradient_error(dd, pk, x, 0.5)
    ref = sum(0.5 * dd[b, 1, t] * torch.outer(pk[b, 1, t], x[b, t]) for b in range(2) for t in range(5))
    torch.testing.assert_close(E[1], ref.double())


def test_rank1_cosines_equal_flattened_matrix_cosines():
    g = torch.Generator().manual_seed(1)
    u, w = torch.randn(3, 4, generator=g), torch.randn(3, 6, generator=g)
    flat = torch.stack([torch.outer(u[i], w[i]).reshape(-1) for i in range(3)]).double()
    flat = torch.nn.functional.normalize(flat, dim=-1)
    torch.testing.assert_close(rank1_cosines(u, w), flat @ flat.T)


def test_attention_probs_match_torch_sdpa_weights():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g)
    P = attention_probs(q, k, 0.5, causal=True)
    assert torch.all(P.triu(1) == 0)
    torch.testing.assert_close(P.sum(-1), torch.ones(1, 2, 6, dtype=torch.float64))
    ref = torch.softmax((0.5 * q @ k.transpose(-1, -2)).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1),
                                                                    -math.inf), -1)
    torch.testing.assert_close(P, ref.double())


def test_effective_rank_growth_exponent_and_column_weights():
    assert effective_rank(torch.tensor([3.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_rank(torch.ones(4)) == pytest.approx(4.0)
    assert growth_exponent([float(n) for n in range(1, 9)]) == pytest.approx(1.0)
    assert growth_exponent([math.sqrt(n) for n in range(1, 9)]) == pytest.approx(0.5)
    assert math.isnan(growth_exponent([1.0, 2.0]))
    w = column_weights(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    torch.testing.assert_close(w, torch.tensor([(9 / 25) / 2, (16 / 25 + 1) / 2], dtype=torch.float64))


def test_planted_standout_features_top_the_columns():
    r = rank1_sim_layers([planted_layer(step=s, seed=s, T=64) for s in range(3)])
    assert r.has_x and (r.focus_layer, r.focus_head) == (0, 0)
    assert {c.feature for c in r.top_columns[:2]} == {3, 7}
    assert r.top_columns[0].weight > 0.3  # the two stand-out features hold most of the norm
    assert len(r.tokens) == 3 * 4 and len(r.step_norms) == 3
    assert 0.0 < r.top_sv_ratio <= 1.0 and r.effective_rank >= 1.0
    assert not math.isnan(r.accumulation_exponent) and not math.isnan(r.cross_step_alignment)


@pytest.mark.parametrize("found,exponent,said", [
    (True, 1.01, "exponent 1.01"), (False, 1.01, "no exponent claimed"), (None, 0.52, "exponent 0.52"),
    (True, float("nan"), "exponent not measured")])
def test_the_accumulation_legend_claims_an_exponent_only_where_the_verdict_interprets_it(found, exponent, said):
    from types import SimpleNamespace

    from fa_forensics.analyses.rank1_sim.figure import accumulation_label

    claim = None if found is None else SimpleNamespace(found=found)
    label = accumulation_label(SimpleNamespace(accumulation_exponent=exponent, claim=claim))
    assert said in label
    assert ("1.01" in label) == (found is True and exponent == 1.01)
