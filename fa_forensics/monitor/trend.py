"""Trend tests of the alarm rule, vectorized over every (layer, head) at once.

- `mann_kendall_z(y)`: the Mann–Kendall statistic S = Σ_{i<j} sign(y_j − y_i) over a window of n
  values, as a z-score with the continuity correction, (S − sign(S)) / √(n(n−1)(2n+5)/18). It counts
  how many later values exceed earlier ones, so it is distribution-free: a single outlier moves S by at
  most n − 1 of its n(n−1)/2 pairs. Tied values (equal counts) add 0 to S; the variance is kept
  without the tie correction, which only makes z smaller (a conservative test).
- `theil_sen_slope(x, y)`: the median of the pairwise slopes (y_j − y_i) / (x_j − x_i): the rate of
  the drift, robust to outliers in the same way.
scipy.stats.kendalltau and scipy.stats.theilslopes compute the same numbers one series at a time
(tests/unit/monitor/test_monitor_alarm.py checks them against each other); the rule needs every
head of every layer at every monitored step, hence these array forms. A NaN anywhere in a series'
window gives NaN (no test).
"""
from __future__ import annotations

import functools
import math

import numpy as np


def mann_kendall_z(y: np.ndarray) -> np.ndarray:
    """y (n, ...) in time order → z (...): the Mann–Kendall trend z-score (positive for a rise)."""
    n = y.shape[0]
    i, j = _pairs(n)
    s = np.sign(y[j] - y[i]).sum(axis=0)  # every pair i < j at once; NaN if any value is NaN
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    return (s - np.sign(s)) / sd


@functools.cache
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs (i, j), i < j < n, made once per window length."""
    return np.triu_indices(n, 1)


def theil_sen_slope(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x (n,) strictly increasing, y (n, ...) → (...): the median of the pairwise slopes of y over x."""
    n = y.shape[0]
    i, j = _pairs(n)
    dx = (np.asarray(x, dtype=np.float64)[j] - np.asarray(x, dtype=np.float64)[i]).reshape((-1,) + (1,) * (y.ndim - 1))
    slopes = np.ascontiguousarray(np.moveaxis((y[j] - y[i]) / dx, 0, -1))  # pairs last: a fast partition
    return np.median(slopes, axis=-1)
