"""Uncertainty helpers: checked against hand-computed values and scipy."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from fa_forensics.analyses.stats import format_pm, mean_se, sign_test, sum_se


def test_mean_se_matches_hand_computation():
    m = mean_se(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert m.value == pytest.approx(2.5)
    assert m.se == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
    assert m.n == 4
    assert m.z == pytest.approx(2.5 / m.se)


def test_mean_se_single_value_has_no_se():
    m = mean_se([3.0])
    assert m.value == 3.0 and math.isnan(m.se)


def test_sum_se_scales_mean_se_by_n():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s, m = sum_se(x), mean_se(x)
    assert s.value == pytest.approx(float(x.sum()))
    assert s.se == pytest.approx(m.se * 100)


def test_sign_test_counts_and_p_value():
    x = [1.0] * 9 + [-1.0] + [0.0] * 5  # zeros carry no sign
    st = sign_test(x)
    assert (st.n_pos, st.n_neg, st.n_zero) == (9, 1, 5)
    assert st.frac_positive == pytest.approx(0.9)
    assert st.p_value == pytest.approx(binomtest(9, 10, 0.5).pvalue)
    assert st.p_value == pytest.approx(2 * 11 / 1024)


def test_sign_test_balanced_is_not_significant_and_all_zero_is_p_one():
    assert sign_test([1.0, -1.0] * 50).p_value == pytest.approx(1.0)
    st = sign_test(torch.zeros(10))
    assert st.p_value == 1.0 and math.isnan(st.frac_positive)


def test_format_pm_shows_sign_and_se():
    assert format_pm(-0.00123, 4e-5) == "-1.230e-03 ± 4.0e-05"


def test_t_test_p_value_matches_scipy():
    from scipy.stats import ttest_1samp

    x = torch.tensor([0.5, 1.5, -0.2, 2.0, 0.9, 1.1], dtype=torch.float64)
    assert mean_se(x).p_value == pytest.approx(ttest_1samp(x.numpy(), 0.0).pvalue)
    assert sum_se(x).p_value == pytest.approx(mean_se(x).p_value)
