"""Whether a head needs a P-cast fix, decided on an interval: three bands, and the heads with nothing to decide.

The lost probability mass of a head is a mean over its query rows, but rows are not independent
draws: consecutive query rows of one sequence see nearly the same keys (the same sinks, the same
running maxima) and lose mass together. The unit resampled is therefore a run of consecutive query
rows of one batch row (`unit_rows`: 32 rows, fewer on short sequences so that a sequence gives at
least 4 runs), and the interval is a cluster bootstrap over those runs (percentile, `N_BOOT`
resamples from a fixed seed, so the same dump gives the same interval). The shares are ratios of
sums over the resampled runs, so a run with fewer visible keys weighs less, as it does in the point
estimate.

Bands of the default setting's lost mass against the floor `FIX_MASS_ZEROED`:
- "needs-fix": the whole interval lies above the floor;
- "borderline": the interval contains the floor (alike heads on either side of it get this band together);
- "no-fix": the whole interval lies at or below the floor;
- "one-hot": every query row puts all its probability on one key (within `ONE_HOT_TOLERANCE`): nothing to lose;
- "empty": no query row sees a non-sink key (T ≤ sink tokens, or no rows): nothing the cast could drop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

FIX_MASS_ZEROED = 0.005  # a head needs a fix when the default cast silently drops this fraction of the probability mass
CONFIDENCE = 0.95  # level of the bootstrap intervals
N_BOOT = 2000  # bootstrap resamples
BOOT_SEED = 0
UNIT_ROWS = 32  # consecutive query rows per resampled unit (at most)
MIN_UNITS_PER_SEQUENCE = 4
ONE_HOT_TOLERANCE = 2.0 ** -24  # a row is one-hot when one key holds ≥ 1 − this (what an fp32 ℓ cannot tell from 1)

NEEDS_FIX, BORDERLINE, NO_FIX, ONE_HOT, EMPTY = "needs-fix", "borderline", "no-fix", "one-hot", "empty"
BANDS = (NEEDS_FIX, BORDERLINE, NO_FIX, ONE_HOT, EMPTY)


def unit_rows(T: int) -> int:
    """Query rows per unit for sequences of length T: 32, or T // 4 when that is smaller (at least 1)."""
    return max(1, min(UNIT_ROWS, T // MIN_UNITS_PER_SEQUENCE))


def unit_index(B: int, T: int) -> torch.Tensor:
    """(B, T) int64: the unit of every query row (runs of `unit_rows(T)` rows, never across batch rows)."""
    per_seq = math.ceil(T / unit_rows(T)) if T else 0
    runs = torch.arange(T) // unit_rows(T)
    return torch.arange(B)[:, None] * per_seq + runs[None, :]


def unit_sums(values: torch.Tensor, units: torch.Tensor) -> np.ndarray:
    """Per-unit sums of `values` (B, T) over the unit index (B, T), as float64 (n_units,)."""
    n = int(units.max()) + 1 if units.numel() else 0
    out = torch.zeros(n, dtype=torch.float64)
    out.index_add_(0, units.reshape(-1), values.reshape(-1).to(torch.float64))
    return out.numpy()


@dataclass(frozen=True)
class Share:
    """A share (ratio of sums over units) with its cluster-bootstrap interval."""

    value: float
    lo: float
    hi: float


def bootstrap_share(num: np.ndarray, den: np.ndarray) -> Share:
    """Σ num / Σ den over units, with the percentile interval of the same ratio over units resampled with replacement.

    One unit, or units that all agree, give an interval of width 0 (there is no spread to measure). A resample whose
    Σ den is 0 is left out. Σ den = 0 overall gives NaNs.
    """
    total = float(den.sum())
    if total <= 0:
        nan = float("nan")
        return Share(nan, nan, nan)
    value = float(num.sum()) / total
    if len(num) < 2:
        return Share(value, value, value)
    rng = np.random.default_rng(BOOT_SEED)
    idx = rng.integers(0, len(num), size=(N_BOOT, len(num)))
    d = den[idx].sum(axis=1)
    ratios = num[idx].sum(axis=1)[d > 0] / d[d > 0]
    alpha = (1.0 - CONFIDENCE) / 2
    lo, hi = np.quantile(ratios, [alpha, 1.0 - alpha])
    return Share(value, min(float(lo), value), max(float(hi), value))


def band_of(lost: Share) -> str:
    """needs-fix / borderline / no-fix from the lost mass's interval against `FIX_MASS_ZEROED`."""
    if lost.lo > FIX_MASS_ZEROED:
        return NEEDS_FIX
    if lost.hi > FIX_MASS_ZEROED:
        return BORDERLINE
    return NO_FIX


def one_hot_rows(p: torch.Tensor) -> torch.Tensor:
    """(…, q) bool: rows of the exact softmax p (…, q, N) that put ≥ 1 − ONE_HOT_TOLERANCE on one key."""
    return p.amax(dim=-1) >= 1.0 - ONE_HOT_TOLERANCE


def mse_ratio(mse: float, best: float) -> float:
    """mse / best, defined where best is 0: 1 when both are 0, NaN ("n/a") when only best is."""
    if best > 0:
        return mse / best
    return 1.0 if mse == 0 else float("nan")


def ratio_text(mse: float, best: float) -> str:
    """'×1.23', or '×n/a' where the ratio is undefined (a best MSE of 0 below a setting that errs)."""
    r = mse_ratio(mse, best)
    return f"×{r:.2f}" if math.isfinite(r) else "×n/a"


def interval_text(s: Share, digits: int = 2) -> str:
    """'0.51 % (95 % interval 0.45-0.58 %)' for a share."""
    if not math.isfinite(s.value):
        return "n/a"
    return f"{s.value:.{digits}%} ({CONFIDENCE:.0%} interval {s.lo:.{digits}%} to {s.hi:.{digits}%})"
