"""delta-bias on small in-memory layers: a planted biased head is found, a plain random head is not."""
import pytest
import torch

from fa_forensics.analyses.delta_bias.compute import delta_bias_layers, feature_contributions
from fa_forensics.analyses.primitives import delta_error
from fa_forensics.layers.selection import LayerTensors


def planted_layer(step=0, T=128, D=16, C=32, seed=0, standout=(3, 7), layer=0):
    """Two heads, non-causal. Head 0: each query row's maximum score is attained by two identical keys
    (P̄ = 1 twice, 15 key pairs so the tie sums vary), every other score ~11 lower; feature 0 of V is
    negative in [-2, -1) (two of them carry when added), dO negative there. Head 1: plain random.
    X has stand-out input features `standout`."""
    g = torch.Generator().manual_seed(seed)
    B, h = 1, 2
    q, k, v, do = (torch.randn(B, h, T, D, generator=g) for _ in range(4))
    ncat = D - 1
    cat = torch.arange(T) % ncat + 1  # which key pair is the maximum of each row
    q[0, 0] = 0.0
    q[0, 0, torch.arange(T), cat] = 8.0
    k[0, 0] = 0.25 * torch.randn(T, D, generator=g)
    for c in range(1, ncat + 1):
        k[0, 0, 2 * c - 2 : 2 * c, c] = 6.0  # identical keys: bit-identical scores α·8·6 = 12
    v[0, 0, :, 0] = -(1.0 + torch.rand(T, generator=g))
    do[0, 0, :, 0] = -(0.5 + torch.rand(T, generator=g))
    x = torch.randn(B, T, C, generator=g)
    for c in standout:
        x[..., c] += 12.0
    bf = torch.bfloat16
    return LayerTensors(step=step, layer=layer, heads=[0, 1], q=q.to(bf), k=k.to(bf), v=v.to(bf), o=None,
                        do=do.to(bf), x=x.to(bf), scale=D**-0.5, causal=False)


def test_delta_error_equals_difference_of_rowsums():
    g = torch.Generator().manual_seed(1)
    do, o1, o2 = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    expected = (do.double() * (o1.double() - o2.double())).sum(-1)
    torch.testing.assert_close(delta_error(do, o1, o2), expected)


def test_feature_contributions_sum_to_delta_error_and_count_sign_agreement():
    do = torch.tensor([[[[1.0, -2.0], [-1.0, 3.0]]]])  # (1, 1, 2, 2)
    o_lp = torch.tensor([[[[0.5, 0.0], [0.0, 1.0]]]])
    o_hp = torch.tensor([[[[0.0, 0.0], [1.0, 2.0]]]])  # errors: [[0.5, 0], [-1, -1]]
    contribution, agree, both = feature_contributions(do, o_lp, o_hp)
    torch.testing.assert_close(contribution, torch.tensor([[0.5 + 1.0, -3.0]], dtype=torch.float64))
    assert agree.tolist() == [[2, 0]] and both.tolist() == [[2, 1]]
    assert float(contribution.sum()) == pytest.approx(float(delta_error(do, o_lp, o_hp).sum()))


def test_planted_head_has_positive_significant_delta_bias_carried_by_planted_feature():
    r = delta_bias_layers([planted_layer(step=s, seed=s) for s in range(2)])
    planted = [p for p in r.per_step if p.head == 0]
    plain = [p for p in r.per_step if p.head == 1]
    assert all(p.delta_err_sum > 0 and p.p_value < 0.01 for p in planted)
    assert all(p.p_value > 0.01 for p in plain)
    assert (r.focus_layer, r.focus_head) == (0, 0)
    assert r.top_features[0].feature == 0 and r.top_features[0].sign_agreement > 0.6
    assert r.steps == [0, 1] and r.cumulative[1] == pytest.approx(r.step_sums[0] + r.step_sums[1])
    assert r.total > 0 and r.total_p_value < 0.01
    assert r.top_token is not None and r.top_token.delta_err > 0 and len(r.top_token.do) == 16
    assert r.top_token.do[0] < 0 and r.top_token.o_err[0] < 0  # Fig. 5b/c: same sign in the planted feature


def test_fig_5a_draws_the_focus_head_and_its_title_quotes_its_total(tmp_path):
    """The cumulative figure names one head, so it draws that head's Σδ per step and quotes the sum the table gives
    for it, not the selection's total (here the plain head pulls the selection's total elsewhere)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from fa_forensics.analyses.delta_bias import figure

    r = delta_bias_layers([planted_layer(step=s, seed=s) for s in range(3)])
    assert [i.step for i in r.focus_items] == [0, 1, 2] and {i.head for i in r.focus_items} == {r.focus_head}
    head = r.focus_total
    assert sum(i.delta_err_sum for i in r.focus_items) == pytest.approx(head.value)
    assert head.value != pytest.approx(r.total, rel=1e-3)  # the two numbers differ: the title must pick the head's
    title = figure.total_title(r)
    assert f"layer {r.focus_layer} head {r.focus_head}: {head.value:+.3g} ± {head.se:.2g} over 3 steps" in title

    drawn = {}
    close = plt.close

    def keep(fig=None):  # read the drawn series before the figure is closed
        if fig is not None and hasattr(fig, "axes") and fig.axes:
            lines = fig.axes[0].lines
            drawn["line"] = next(ln for ln in lines if ln.get_label() == "cumulative over steps").get_ydata()
        close(fig)

    plt.close = keep
    try:
        figure.plot_cumulative(r, tmp_path / "c.png")
    finally:
        plt.close = close
    cumulative = torch.tensor([i.delta_err_sum for i in r.focus_items]).cumsum(0).tolist()
    assert list(drawn["line"]) == pytest.approx(cumulative)


def test_captions_claim_the_mechanism_only_where_the_bias_is_significant():
    """A figure's caption says what the page may claim: the planted head's mechanism where its Σδ bias is
    significant, a view of noise on plain heads (no "reproduces the paper" on a dump without the bias)."""
    from fa_forensics.analyses.delta_bias.figure import top_token_caption
    from fa_forensics.analyses.isolate.figure import variants_caption
    from fa_forensics.analyses.rank1_sim.compute import rank1_sim_layers
    from fa_forensics.analyses.rank1_sim.figure import caption

    planted = planted_layer()
    plain = LayerTensors(step=0, layer=0, heads=[1], q=planted.q[:, 1:], k=planted.k[:, 1:], v=planted.v[:, 1:],
                         o=None, do=planted.do[:, 1:], x=planted.x, scale=planted.scale, causal=False)
    biased, noise = delta_bias_layers([planted]), delta_bias_layers([plain])
    assert biased.claim.found and biased.claim.sign > 0 and not noise.claim.found
    assert "share their sign" in top_token_caption(biased) and "positive" in top_token_caption(biased)
    assert "rounding noise, not a mechanism" in top_token_caption(noise)
    # isolate's claim is these Σδ items' (analyses.quantities): its caption reads the same claim
    assert "removes the baseline's positive" in variants_caption(biased)
    assert "no significant Σ(δ_lp − δ_hp) bias here" in variants_caption(noise)
    r = rank1_sim_layers([plain])
    assert f"here mean cosine {r.cosine_offdiag_mean:+.2f}" in caption(r) and "are alike and" not in caption(r)
