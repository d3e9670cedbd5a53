"""Shared uncertainty helpers: every number that claims a bias carries its uncertainty.

A bias is reported as a signed mean ± standard error (`mean_se`), a signed sum ± its standard
error (`sum_se`), and/or a two-sided sign test (`sign_test`, scipy.stats.binomtest on the
counts of positive and negative values; exact zeros carry no sign and are left out). `MeanSE.p_value`
is the matching one-sample t-test: it sees a bias carried by a few large values (e.g. rare round-ups
of a carry) that the sign test, which only counts signs, can miss.
All functions take any float tensor (or array-like) and treat it as one flat sample.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binomtest, ttest_rel
from scipy.stats import t as student_t


@dataclass(frozen=True)
class MeanSE:
    """A signed mean (or sum) of n values with its standard error."""

    value: float
    se: float
    n: int

    @property
    def z(self) -> float:
        """value / se (nan when se is 0 or n < 2)."""
        return self.value / self.se if self.se > 0 else float("nan")

    @property
    def p_value(self) -> float:
        """Two-sided one-sample t-test p-value of H0 'the true mean is 0' (nan for n < 2)."""
        if self.n < 2 or not self.se > 0:
            return float("nan")
        return float(2 * student_t.sf(abs(self.z), self.n - 1))

    def __str__(self) -> str:
        return format_pm(self.value, self.se)


@dataclass(frozen=True)
class SignTest:
    """Two-sided sign test of H0 'positive and negative values are equally likely'."""

    n_pos: int
    n_neg: int
    n_zero: int
    frac_positive: float  # n_pos / (n_pos + n_neg); nan when every value is 0
    p_value: float  # 1.0 when every value is 0


def _flat64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def mean_se(x) -> MeanSE:
    """Mean of the values and its standard error s/√n (se = nan for n < 2)."""
    a = _flat64(x)
    n = a.size
    if n == 0:
        return MeanSE(float("nan"), float("nan"), 0)
    mean = float(a.mean())
    se = float(a.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return MeanSE(mean, se, n)


def sum_se(x) -> MeanSE:
    """Sum of the values and its standard error s·√n (the se of a mean scaled by n)."""
    m = mean_se(x)
    return MeanSE(m.value * m.n, m.se * m.n, m.n) if m.n else MeanSE(0.0, float("nan"), 0)


def rms(x) -> float:
    """Root mean square of the values (0 for an empty sample)."""
    a = _flat64(x)
    return float(np.sqrt(np.mean(a * a))) if a.size else 0.0


def sign_test(x) -> SignTest:
    """Sign test on the values: counts of > 0 and < 0 and the two-sided binomial p-value."""
    a = _flat64(x)
    n_pos = int((a > 0).sum())
    n_neg = int((a < 0).sum())
    n_zero = int(a.size - n_pos - n_neg)
    n = n_pos + n_neg
    if n == 0:
        return SignTest(0, 0, n_zero, float("nan"), 1.0)
    p = float(binomtest(n_pos, n, 0.5, alternative="two-sided").pvalue)
    return SignTest(n_pos, n_neg, n_zero, n_pos / n, p)


def format_pm(value: float, se: float) -> str:
    """'-1.23e-03 ± 4.0e-05' (the se with two significant digits)."""
    if not math.isfinite(se):
        return f"{value:+.3e}"
    return f"{value:+.3e} ± {se:.1e}"


def format_p(p: float) -> str:
    """A p-value for a table: '< 1e-300' for 0, else 2 significant digits."""
    if p == 0:
        return "< 1e-300"
    return f"{p:.2g}"


# ---- paired comparisons over the same instances (seeds) ----------------------------------------

@dataclass(frozen=True)
class Ratio:
    """mean(a)/mean(b) over paired instances, with its delta-method standard error."""

    value: float
    se: float
    n: int
    numerator: str
    denominator: str
    delta: float
    seq: int


def ratio_of_means(a, b) -> MeanSE:
    """R = ā / b̄ over paired values, se(R) = sd(a − R·b) / (√n · |b̄|) (delta method, linearised ratio estimator)."""
    a, b = _flat64(a), _flat64(b)
    r = float(a.mean() / b.mean())
    se = float(np.std(a - r * b, ddof=1) / (math.sqrt(a.size) * abs(b.mean()))) if a.size > 1 else float("nan")
    return MeanSE(r, se, int(a.size))


def paired_ratio(a: np.ndarray, b: np.ndarray, numerator: str, denominator: str, delta: float, seq: int) -> Ratio:
    """`ratio_of_means` of paired instances, labelled."""
    m = ratio_of_means(a, b)
    return Ratio(m.value, m.se, m.n, numerator, denominator, float(delta), int(seq))


@dataclass(frozen=True)
class PairedTTest:
    """Paired t-test of H0 'MSE(a) = MSE(b)' over the same instances (seeds)."""

    delta: float
    seq: int
    a: str
    b: str
    n: int
    mean_diff: float  # mean of MSE(a) − MSE(b)
    se_diff: float
    t: float
    p_value: float
    mse_a: float
    mse_b: float
    verdict: str  # "indistinguishable" | "a better" | "b better" (adjusted p below the policy's α)
    adjusted_p: float = math.nan  # p, Holm-adjusted over the tests of its family (`holm_tests`); nan: alone


def paired_ttest(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str, delta: float, seq: int) -> PairedTTest:
    """scipy's ttest_rel on per-instance MSEs, with the mean difference and its se; its verdict at the statistics
    policy's α (`analyses.significance`), as a test of its own (`holm_tests` corrects a family of them)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = a - b
    m = mean_se(d)
    mean_d, se_d = m.value, m.se
    if a.size < 2 or not np.any(d != 0):
        t, p = (0.0, 1.0) if a.size >= 2 else (float("nan"), float("nan"))
    else:
        res = ttest_rel(a, b)
        t, p = float(res.statistic), float(res.pvalue)
    return PairedTTest(float(delta), int(seq), name_a, name_b, int(a.size), mean_d, se_d, t, p,
                       float(a.mean()), float(b.mean()), _ttest_verdict(p, mean_d), p)


def _ttest_verdict(p: float, mean_diff: float) -> str:
    from fa_forensics.analyses.significance import ALPHA

    return "indistinguishable" if not (p < ALPHA) else ("a better" if mean_diff < 0 else "b better")


def holm_tests(tests: list[PairedTTest]) -> list[PairedTTest]:
    """The paired t-tests of one family, their p-values Holm-adjusted over the family and their verdicts redone."""
    from dataclasses import replace

    from fa_forensics.analyses.significance import holm

    adjusted = holm([t.p_value for t in tests], len(tests))
    return [replace(t, adjusted_p=a, verdict=_ttest_verdict(a, t.mean_diff)) for t, a in zip(tests, adjusted)]
