"""The monitor's sampled estimator (monitor/sampled.py): every row sampled gives head_statistics' exact counts;
a sample's intervals cover the true counts of a planted population at their stated confidence."""
import numpy as np
import pytest
import torch

from fa_forensics.monitor import head_statistics
from fa_forensics.monitor.sampled import rows_for_fraction, sample_rows, sampled_rows


def _planted(seed, B=2, H=3, T=128, D=16, ties_from=9, spread=3.0):
    """Random bf16 q, k; in head 1 keys 5 and 9 are equal and the queries from `ties_from` on point at them."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, T, D, generator=g) * spread).bfloat16()
    k = torch.randn(B, H, T, D, generator=g).bfloat16()
    k[:, 1, 9] = k[:, 1, 5]
    q[:, 1, ties_from:] = (4 * k[:, 1, 5]).unsqueeze(1)
    return q, k


def test_sample_rows_are_sorted_distinct_positions_and_follow_the_generator():
    rows = sample_rows(3, 50, 8, torch.Generator().manual_seed(1))
    assert rows.shape == (3, 8) and rows.dtype == torch.int64
    assert all(len(set(r.tolist())) == 8 and r.tolist() == sorted(r.tolist()) for r in rows)
    assert int(rows.min()) >= 0 and int(rows.max()) < 50
    assert torch.equal(rows, sample_rows(3, 50, 8, torch.Generator().manual_seed(1)))
    assert rows_for_fraction(1024, 1 / 16) == 64 and rows_for_fraction(10, 1e-6) == 1
    with pytest.raises(ValueError, match="fraction"):
        rows_for_fraction(10, 0.0)


@pytest.mark.parametrize("causal, score_dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_every_row_sampled_gives_head_statistics_exactly(causal, score_dtype):
    q, k = _planted(0)
    B, H, T, D = q.shape
    kw = dict(scale=D ** -0.5, causal=causal, eps=1e-3, p_dtype=torch.bfloat16, score_dtype=score_dtype)
    full = head_statistics(q, k, **kw)
    rows = torch.arange(T).expand(B, T)
    est = sampled_rows(q, k, rows, **kw).estimate()
    assert est.rows == est.rows_sampled == B * T
    assert est.near_max_ties.value.tolist() == full.near_max_ties.tolist()
    assert est.near_max_ties.low.tolist() == est.near_max_ties.high.tolist() == full.near_max_ties.tolist()
    assert est.p_one_extra.value.tolist() == full.p_one_extra.tolist()
    assert np.array_equal(est.max_logit_sampled, full.max_logit.double().numpy())
    np.testing.assert_allclose(est.top1_prob.value, full.top1_prob.numpy(), rtol=1e-6)
    assert int(full.near_max_ties[1]) > 100  # the planted head ties in most rows


def test_intervals_cover_the_true_counts_at_their_confidence():
    """200 independent samples of 1/8 of the rows of one planted population (ties in head 1 from row 100 on,
    65 of its 256 rows; heads 0 and 2 have 5 and 2): the 95 % intervals of near_max_ties and
    top1_prob (and of p_one_extra, whose rare heads get only the certain range) cover the true values in at least
    90 % of the samples, and the tie interval of the planted head is far narrower than the certain range."""
    q, k = _planted(1, B=2, T=128, ties_from=100, spread=6.0)
    B, H, T, D = q.shape
    kw = dict(scale=D ** -0.5, causal=True, eps=1e-3, p_dtype=torch.bfloat16, score_dtype=torch.bfloat16)
    truth = head_statistics(q, k, **kw)
    true_ties = truth.near_max_ties.double().numpy()
    true_top1 = truth.top1_prob.double().numpy()
    true_extra = truth.p_one_extra.double().numpy()
    assert 40 <= true_ties[1] <= 70 and 0 < true_ties[0] < 10 and 0 < true_ties[2] < 10
    gen = torch.Generator().manual_seed(2)
    cover_ties, cover_top1, cover_extra, widths = [], [], [], []
    for _ in range(200):
        est = sampled_rows(q, k, sample_rows(B, T, T // 8, gen), **kw).estimate(confidence=0.95)
        t = est.near_max_ties
        cover_ties.append((t.low <= true_ties) & (true_ties <= t.high))
        cover_top1.append((est.top1_prob.low <= true_top1 + 1e-12) & (true_top1 - 1e-12 <= est.top1_prob.high))
        cover_extra.append((est.p_one_extra.low <= true_extra) & (true_extra <= est.p_one_extra.high))
        widths.append(t.high[1] - t.low[1])
    assert np.mean(cover_ties, axis=0).min() >= 0.9, np.mean(cover_ties, axis=0)
    assert np.mean(cover_top1, axis=0).min() >= 0.9, np.mean(cover_top1, axis=0)
    assert np.mean(cover_extra, axis=0).min() >= 0.9, np.mean(cover_extra, axis=0)  # rare heads: the certain range
    assert np.median(widths) < 0.5 * B * T  # informative: the certain range is [k, k + 224]
