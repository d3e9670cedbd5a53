"""Could the elements a replay does not reproduce matter? A sign test of the mismatches, per feature.

A replay that reproduces 88-99 % of the stored O differs from the kernel that trained somewhere. The
bias findings rest on the mean of O_lp − O_hp per (layer, head, feature): they stand if the kernel's
differences from the replay carry no sign of their own in any feature. `tally` counts, over the
mismatching elements of one layer-step, the sign of (stored − replayed) per (head, feature) and the
histogram of the difference in units in the last place of the stored dtype; `sign_test` tests each
feature (two-sided binomial test of "as many + as −", Bonferroni over the features tested) and all
features pooled (a skew spread thinly over every feature).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

ULP_BINS = 4  # histogram bins −4 … +4 ulp; further differences are counted in the outer bins


@dataclass(frozen=True)
class MismatchTally:
    """Signs and ulp differences of the mismatching elements of one layer-step."""

    step: int
    layer: int
    heads: list[int]
    positive: torch.Tensor  # (h, D) int64: elements with stored > replayed
    negative: torch.Tensor  # (h, D) int64: elements with stored < replayed
    ulp_histogram: dict  # signed ulp difference (str, "<=-4" … ">=4") -> count


def _ordered(bits: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Sign-magnitude float bits mapped to integers whose difference counts representable values (ulps)."""
    x = bits.to(torch.int64)
    top = 1 << (8 * itemsize - 1)
    x = torch.where(x < 0, x + 2 * top, x)  # the unsigned pattern
    return torch.where(x >= top, top - x, x)


def ulp_difference(stored: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """(stored − replayed) in ulps of stored's dtype (int64), replayed rounded to that dtype first."""
    r = replayed.to(stored.dtype)
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[stored.dtype.itemsize]
    return _ordered(stored.view(view), stored.dtype.itemsize) - _ordered(r.view(view), stored.dtype.itemsize)


def tally(step: int, layer: int, heads: Sequence[int], replayed: torch.Tensor, stored: torch.Tensor) -> MismatchTally:
    """Count the mismatches of stored vs replayed O, both (B, h, T, D), per (head, feature)."""
    diff = ulp_difference(stored, replayed)
    finite = torch.isfinite(stored.double()) & torch.isfinite(replayed.to(stored.dtype).double())
    diff = torch.where(finite, diff, torch.zeros_like(diff))
    positive = (diff > 0).sum(dim=(0, 2))
    negative = (diff < 0).sum(dim=(0, 2))
    clipped = diff[diff != 0].clamp(-ULP_BINS, ULP_BINS)
    values, counts = torch.unique(clipped, return_counts=True)
    hist = {_bin(int(v)): int(c) for v, c in zip(values, counts)}
    return MismatchTally(step, layer, list(heads), positive, negative, hist)


def _bin(v: int) -> str:
    return f"<={-ULP_BINS}" if v <= -ULP_BINS else f">={ULP_BINS}" if v >= ULP_BINS else f"{v:+d}"


def _binom_p(k, n):
    """Two-sided sign-test p of k successes in n trials at probability 1/2 (elementwise; 1 where n = 0):
    the symmetric binomial's two tails, 2·P(X ≤ min(k, n − k)), capped at 1."""
    import numpy as np
    from scipy.stats import binom

    k, n = np.asarray(k, dtype=np.int64), np.asarray(n, dtype=np.int64)
    p = np.minimum(1.0, 2.0 * binom.cdf(np.minimum(k, n - k), np.maximum(n, 1), 0.5))
    return np.where(n > 0, p, 1.0)


@dataclass(frozen=True)
class WorstFeature:
    """The (layer-step, head, feature) whose mismatches have the most one-sided sign."""

    step: int
    layer: int
    head: int
    feature: int
    positive: int  # mismatches where stored > replayed
    n: int  # mismatches in the feature
    share_positive: float
    share_se: float


@dataclass(frozen=True)
class MismatchTest:
    """The sign test of the stored-O elements a replay does not reproduce (`replay_fidelity.mismatch`; its JSON
    keys in this order). `p_feature` is Bonferroni-corrected over the `n_features` features tested; `biased`: it
    or the pooled p is below α / 2 (two tests: a sign of its own in one feature, or in all of them together)."""

    n_mismatched: int
    positive: int
    share_positive: float
    share_se: float
    p_pooled: float
    n_features: int
    p_feature: float
    worst: WorstFeature
    ulp_histogram: dict[str, int]
    biased: bool
    verdict: str


def sign_test(tallies: Sequence[MismatchTally], alpha: float) -> Optional[MismatchTest]:
    """The sign test of the mismatching elements at level `alpha`, or None when nothing mismatches."""
    n_pos = sum(int(t.positive.sum()) for t in tallies)
    n_neg = sum(int(t.negative.sum()) for t in tallies)
    n = n_pos + n_neg
    if not n:
        return None
    cells = 0
    worst: Optional[dict[str, Any]] = None  # the most one-sided cell so far, with its p-value
    for t in tallies:
        n_cell = t.positive + t.negative  # (h, D)
        tested = n_cell > 0
        if not bool(tested.any()):
            continue
        p = torch.from_numpy(_binom_p(t.positive.numpy(), n_cell.numpy()))
        cells += int(tested.sum())
        hi, f = divmod(int(torch.where(tested, p, torch.full_like(p, 2.0)).argmin()), p.shape[1])
        if worst is None or float(p[hi, f]) < worst["p"]:
            worst = {"step": t.step, "layer": t.layer, "head": t.heads[hi], "feature": f,
                     "positive": int(t.positive[hi, f]), "n": int(n_cell[hi, f]), "p": float(p[hi, f])}
    if worst is None:  # n > 0: some cell was tested
        return None
    p_feature = min(1.0, worst["p"] * cells)
    share = worst["positive"] / worst["n"]
    worst.update(share_positive=share, share_se=math.sqrt(share * (1 - share) / worst["n"]))
    del worst["p"]
    hist: dict[str, int] = {}
    for t in tallies:
        for key, count in t.ulp_histogram.items():
            hist[key] = hist.get(key, 0) + count
    order = [_bin(v) for v in range(-ULP_BINS, ULP_BINS + 1) if v]
    hist = {k: hist[k] for k in order if k in hist}
    pooled_share = n_pos / n
    pooled_se = math.sqrt(pooled_share * (1 - pooled_share) / n)
    p_pooled = float(_binom_p(n_pos, n))
    pooled = f"{100 * pooled_share:.0f} % ± {100 * pooled_se:.0f} % of {n} positive"
    # two tests (per feature, pooled), each at alpha / 2
    biased = min(p_feature, p_pooled) < alpha / 2
    if p_feature < alpha / 2:
        verdict = (f"the mismatches are biased (p = {p_feature:.2g}, sign test per feature, Bonferroni over {cells}; "
                   f"step {worst['step']} layer {worst['layer']} head {worst['head']} feature {worst['feature']}: "
                   f"{100 * share:.0f} % ± {100 * worst['share_se']:.0f} % of {worst['n']} positive): "
                   f"do not trust the bias findings")
    elif biased:
        verdict = (f"the mismatches are biased overall (p = {p_pooled:.2g}, pooled sign test; {pooled}): "
                   f"do not trust the bias findings")
    else:
        verdict = (f"the mismatches are unbiased (p = {min(1.0, 2 * min(p_feature, p_pooled)):.2g}, sign tests per "
                   f"feature, Bonferroni over {cells}, and pooled; {pooled}): bias findings stand")
    return MismatchTest(n, n_pos, pooled_share, pooled_se, p_pooled, cells, p_feature, WorstFeature(**worst), hist,
                        biased, verdict)
