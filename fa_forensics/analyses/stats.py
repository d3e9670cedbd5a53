"""Shared uncertainty helpers: every number that claims a bias carries its uncertainty.

A bias is reported as a signed mean ± standard error (`mean_se`), a signed sum ± its standard
error (`sum_se`), with `MeanSE.p_value`, the matching one-sample t-test; a two-sided sign test
(`sign_test`, scipy.stats.binomtest on the counts of positive and negative values; exact zeros carry
no sign and are left out) describes the signs beside it. The bias claims test units of rows, not rows
(`unit_sums`, `unit_test`: the t-test of the mean is the test, the sign test a description).
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
        """Two-sided one-sample t-test p-value of H0 'the true mean is 0' (1 when every value is 0; nan for n < 2
        or values that are all the same non-zero number, which no test of spread can judge)."""
        if self.n >= 2 and self.se == 0 and self.value == 0:
            return 1.0
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


# ---- cluster-robust tests: the unit is a group of rows that err together --------------------------------

@dataclass(frozen=True)
class UnitSums:
    """Sufficient statistics of rows grouped into units, per cell (any shape, all tensors alike), additive over
    disjoint sets of units (steps, batch rows): merged by `merge_unit_sums`."""

    n: torch.Tensor  # rows with a finite value
    s1: torch.Tensor  # Σ value
    n_units: torch.Tensor  # units with at least one finite row
    a: torch.Tensor  # Σ_g S_g² (S_g: a unit's sum)
    b: torch.Tensor  # Σ_g n_g·S_g
    c: torch.Tensor  # Σ_g n_g²
    w1: torch.Tensor  # Σ_g w_g, w_g the unit sum's variance in rows' variances (`unit_weights`) ...
    w2: torch.Tensor  # ... and Σ_g w_g²: the units' effective number (Σ w)² / Σ w² (`unit_test`)
    u_pos: torch.Tensor  # units with S_g > 0
    u_neg: torch.Tensor  # units with S_g < 0


def unit_weights(ng: torch.Tensor, tied_unit: torch.Tensor | None) -> torch.Tensor:
    """Each unit's sum's variance in units of one row's: n_g² for a unit of tied rows (they share the keys whose
    P̄ = 1 and the carry they make, so they err as one), n_g for a unit that shares only its dominant key (its rows'
    other keys differ, so they err nearly independently). ng (G, *cell); tied_unit (G,) bool or None (none tied)."""
    if tied_unit is None:
        return ng
    return torch.where(tied_unit.view(-1, *([1] * (ng.dim() - 1))), ng * ng, ng)


def unit_sums(x: torch.Tensor, unit: torch.Tensor, rows: torch.Tensor | None = None,
              tied: torch.Tensor | None = None) -> UnitSums:
    """`UnitSums` of values x (R, *cell) whose rows belong to units unit (R,) int64 (ids 0..G−1); `rows` (R,) bool
    keeps some rows only; `tied` (R,) bool marks rows whose maximum repeats (their unit errs as one:
    `unit_weights`); a non-finite value is left out of its cell."""
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    if rows is not None:
        finite = finite & rows.view(-1, *([1] * (x.dim() - 1)))
    d = torch.where(finite, x, torch.zeros_like(x))
    G = int(unit.max()) + 1 if unit.numel() else 0
    S = torch.zeros(G, *x.shape[1:], dtype=torch.float64).index_add_(0, unit, d)
    ng = torch.zeros(G, *x.shape[1:], dtype=torch.float64).index_add_(0, unit, finite.to(torch.float64))
    tied_unit = None if tied is None else torch.zeros(G, dtype=torch.float64).index_add_(0, unit, tied.to(
        torch.float64)) > 0
    w = unit_weights(ng, tied_unit)
    return UnitSums(ng.sum(0), S.sum(0), (ng > 0).sum(0), (S * S).sum(0), (ng * S).sum(0), (ng * ng).sum(0),
                    w.sum(0), (w * w).sum(0), (S > 0).sum(0), (S < 0).sum(0))


def merge_unit_sums(parts) -> UnitSums:
    """The sums of disjoint sets of units (elementwise sums of their fields)."""
    parts = list(parts)
    return UnitSums(*(sum(getattr(p, f) for p in parts) for f in UnitSums.__dataclass_fields__))


@dataclass(frozen=True)
class UnitTest:
    """The mean of rows grouped into units, its cluster-robust standard error and the tests over units (tensors of
    the cells' shape)."""

    mean: torch.Tensor
    se: torch.Tensor  # CR1: sqrt(G/(G−1)·Σ_g (S_g − n_g·mean)²) / n; nan for G < 2
    t_p_value: torch.Tensor  # two-sided t-test of mean/se with `df` degrees of freedom: the test of the bias
    p_value: torch.Tensor  # two-sided sign test over the units' sums (1 when no unit has a sign): descriptive only,
    # since it tests the units' median, and rounding errors can be skewed with a mean of 0
    frac_positive: torch.Tensor  # units with S_g > 0 among those with a sign
    n: torch.Tensor
    n_units: torch.Tensor
    df: torch.Tensor  # `effective_units` − 1: G − 1 for units alike, fewer where a few units hold most of the variance


def effective_units(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The effective number of units (Σ w_g)² / Σ w_g² (Satterthwaite): the CR1 variance is a sum of the units'
    squared residuals, the g-th of variance ∝ w_g² (w_g the unit sum's variance, `unit_weights`), so a few units
    that hold most of the variance carry its few degrees of freedom whatever the number of small ones beside them."""
    return torch.where(w2 > 0, w1 * w1 / w2.clamp(min=1), torch.zeros_like(w1))


def unit_test(s: UnitSums) -> UnitTest:
    """Cluster-robust tests of 'the mean is 0' where rows of one unit err together and units are independent:
    the CR1 standard error (which is the row standard error s/√n when every unit is one row) with the effective
    units' degrees of freedom (`effective_units` − 1: G − 1 when the units are alike; eight tie groups that hold
    most rows beside many one-row units give about 7, not G − 1): the test of the mean. The sign test counting each
    unit once is described beside it, not counted: it tests the median, and an error distribution skewed with a
    mean of 0 (a feature whose O values sit low in their binades) shifts the median of thousands of units."""
    from scipy.stats import binom

    n = s.n.to(torch.float64)
    G = s.n_units.to(torch.float64)
    mean = torch.where(n > 0, s.s1 / n.clamp(min=1), torch.full_like(n, math.nan))
    m0 = mean.nan_to_num(0.0)
    ss = (s.a - 2 * m0 * s.b + m0 * m0 * s.c).clamp(min=0)
    se = torch.where(G > 1, (G / (G - 1).clamp(min=1) * ss).sqrt() / n.clamp(min=1), torch.full_like(n, math.nan))
    z = (mean / se).abs()
    df = torch.minimum(effective_units(s.w1.to(torch.float64), s.w2.to(torch.float64)), G) - 1
    t_p = torch.as_tensor(np.asarray(2 * student_t.sf(z.numpy(), df.clamp(min=1).numpy())), dtype=torch.float64)
    t_p = torch.where((G > 1) & (se > 0), t_p, torch.full_like(n, math.nan))
    signed = (s.u_pos + s.u_neg).to(torch.float64)
    k = torch.minimum(s.u_pos, s.u_neg).to(torch.float64)
    sign_p = torch.as_tensor(np.asarray(2.0 * binom.cdf(k.numpy(), signed.clamp(min=1).numpy(), 0.5)),
                             dtype=torch.float64).clamp(max=1.0)
    sign_p = torch.where(signed > 0, sign_p, torch.ones_like(sign_p))
    frac = torch.where(signed > 0, s.u_pos.to(torch.float64) / signed.clamp(min=1), torch.full_like(n, math.nan))
    # every unit off the mean by exactly 0 (one error repeated, or none): no spread for the t-test to judge, so its
    # units' signs are the test (2^(1−G) when all G agree; 1 when every error is 0, as no unit has a sign)
    t_p = torch.where((G > 1) & (se == 0), sign_p, t_p)
    return UnitTest(mean, se, t_p, sign_p, frac, s.n, s.n_units, df)
