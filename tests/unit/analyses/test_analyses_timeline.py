"""analyses.timeline: the ties-vs-loss Spearman test uses only steps where both were measured."""
import numpy as np
from scipy import stats as sps

from fa_forensics.analyses.timeline.compute import analyse_timeline


def test_steps_without_a_ties_measurement_are_left_out_not_counted_as_zero():
    ties = np.array([1.0, 2.0, 3.0, 4.0, np.nan, np.nan])[:, None, None]  # (S, L=1, H=1)
    loss = np.array([1.0, 2.0, 3.0, 4.0, 9.0, 8.0])
    r = analyse_timeline({"step": np.arange(6), "loss": loss, "near_max_ties": ties})
    assert r.ties_loss_spearman == 1.0  # the four measured steps rise together
    wrong = sps.spearmanr([1, 2, 3, 4, 0, 0], loss).statistic  # what counting NaN rows as 0 gave
    assert wrong < 0.5


def test_fewer_than_three_measured_steps_give_no_correlation():
    ties = np.array([1.0, 2.0, np.nan, np.nan])[:, None, None]
    r = analyse_timeline({"step": np.arange(4), "loss": np.array([1.0, 2.0, 3.0, 4.0]), "near_max_ties": ties})
    assert r.ties_loss_spearman is None and r.ties_loss_p_value is None
