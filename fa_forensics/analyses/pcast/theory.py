"""Closed forms of the P-cast collapse (paper 002, Corollary 2 and its refinements).

δ_k = E[max of k standard normals] by numerical integration; the forward-order zeroed fraction
F(Δ, S) = Φ(Δ + δ_k − 10 ln 2 − ln S), its average over the spread of the per-row maximum, and a
leading-order estimate for reverse KV order.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy import integrate, stats

from fa_forensics.errors import InvalidSetting

LN_UNDERFLOW = 10.0 * math.log(2.0)  # 6.93: P̄·S < 2^-10 rounds to 0 in E4M3


def _max_normal_density(x: float, k: int) -> float:
    """Density of the maximum of k independent standard normals: k φ(x) Φ(x)^(k−1)."""
    return k * stats.norm.pdf(x) * stats.norm.cdf(x) ** (k - 1)


@functools.cache
def expected_max_normal(k: int) -> float:
    """δ_k = E[max of k standard normals], by numerical integration (δ_4 ≈ 1.0294)."""
    if k < 1:
        raise InvalidSetting("n_sinks", f"the number of sink tokens must be ≥ 1, got {k}")
    if k == 1:
        return 0.0
    value, _ = integrate.quad(lambda x: x * _max_normal_density(x, k), -np.inf, np.inf)
    return float(value)


@functools.cache
def std_max_normal(k: int) -> float:
    """Standard deviation of the maximum of k standard normals (the per-row spread of m)."""
    if k == 1:
        return 1.0
    second, _ = integrate.quad(lambda x: x * x * _max_normal_density(x, k), -np.inf, np.inf)
    return float(math.sqrt(second - expected_max_normal(k) ** 2))


def closed_form_fraction(delta: float, S: float, k: int) -> float:
    """Corollary 2: F(Δ, S) = Φ(Δ + δ_k − 10 ln 2 − ln S), the forward-order zeroed fraction."""
    return float(stats.norm.cdf(delta + expected_max_normal(k) - LN_UNDERFLOW - math.log(S)))


def closed_form_spread(delta: float, S: float, k: int) -> float:
    """E over rows of Φ(Δ + M_k − 10 ln 2 − ln S), M_k the max of k normals (not its mean).

    The paper's form puts the per-row maximum at its mean Δ + δ_k; averaging Φ over the spread
    of M_k instead raises the fraction where Φ is convex (argument < 0) and lowers it where Φ
    is concave (argument > 0).
    """
    shift = delta - LN_UNDERFLOW - math.log(S)
    if k == 1:
        # M_1 ~ N(0, 1): E Φ(shift + Z) = Φ(shift / √2)
        return float(stats.norm.cdf(shift / math.sqrt(2.0)))
    value, _ = integrate.quad(lambda x: stats.norm.cdf(shift + x) * _max_normal_density(x, k), -np.inf, np.inf)
    return float(value)


def closed_form_reverse(delta: float, S: float, k: int, n: int, block: int) -> float:
    """Leading-order zeroed fraction under reverse order (an estimate, not in the paper).

    Blocks before the sink block see a running max of at most E[max of N−k normals] (Eq. 11),
    the non-sink keys of the sink block (B−k of the N−k non-sink keys) see m ≈ max(Δ + δ_k, that).
    """
    c = LN_UNDERFLOW + math.log(S)
    m_pre = expected_max_normal(max(n - k, 1))
    m_sink = max(delta + expected_max_normal(k), m_pre)
    w_sink = max(min(block, n) - k, 0) / max(n - k, 1)
    return float(w_sink * stats.norm.cdf(m_sink - c) + (1 - w_sink) * stats.norm.cdf(m_pre - c))
