"""The monitor's repeated-maximum counts on a random sample of query rows, with confidence intervals.

Counting the rows whose maximum repeats (monitor/stats.py) needs every score of every row twice: the
row maximum in score precision, then the compare. Here each batch row contributes a simple random
sample of n of its T query positions (without replacement, the same positions for every head), and
only those rows are computed, with the statistics' own definitions (score precision, ε, the P̄ dtype):
on a GPU by the fused kernel (replay/triton/monitor_kernel.py, `rows=`), on a CPU in torch. A head has
N = B·T rows, m = B·n of them sampled; per head:
- near_max_ties: rows with a repeated maximum. Estimate N·k/m (k: such rows in the sample); interval
  N·[p_lo, p_hi] from the exact Clopper–Pearson interval of k in m, cut to what is certain:
  [k, k + N − m]. The sample is stratified by batch row and drawn without replacement, so k varies
  less than a binomial count of the same mean: the interval covers at least `confidence`.
- p_one_extra: Σ over rows of max(0, #P̄ == 1 − 1). Estimate N · the sample mean; interval from the
  normal approximation of the stratified estimator (with the finite-population correction), cut to
  [sampled sum, sampled sum + (N − m)·(Tk − 1)], when at least 5 sampled rows have extra ones; with
  fewer, only that certain range (measured on a planted population: the normal interval of heads with 2
  or 5 such rows in 256 covered in 28 % and 52 % of 200 samples).
- top1_prob: the mean top-1 probability, sample mean with the same normal interval (values in [0, 1]).
- max_logit_sampled: the largest score of the sampled rows, a lower bound of the head's max logit (the
  full maximum comes from the attention's own row maxima: monitor/lse_stats.py).
Work is split so a GPU run synchronizes once: `sampled_rows` queues the kernel and returns device
tensors; `SampledRows.estimate` (on the host, at the step's end) reduces them and forms the intervals.
With n = T every row is computed and each interval collapses to the exact count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fa_forensics.monitor.p_one import count_p_one


def sample_rows(batch: int, T: int, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(batch, n) int64 positions: per batch row a simple random sample of n of the T positions, ascending."""
    n = max(1, min(int(n), T))
    keys = torch.rand(batch, T, generator=generator)
    return keys.argsort(dim=1)[:, :n].sort(dim=1).values


def rows_for_fraction(T: int, fraction: float) -> int:
    """How many positions per batch row a sampling fraction asks for (at least 1, at most T)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"monitor sampling fraction {fraction!r} must be in (0, 1]")
    return max(1, min(T, round(fraction * T)))


@dataclass(frozen=True)
class Estimate:
    """Per head (H,) float64: the estimate and its interval."""

    value: np.ndarray
    low: np.ndarray
    high: np.ndarray


@dataclass(frozen=True)
class SampledHeadStats:
    near_max_ties: Estimate
    p_one_extra: Estimate
    top1_prob: Estimate
    max_logit_sampled: np.ndarray  # (H,) lower bound of the max logit
    rows: int  # N = B·T per head
    rows_sampled: int  # m = B·n per head
    confidence: float


@dataclass(frozen=True)
class SampledRows:
    """Per sampled row (B, H, n), on the device that computed them: maximum, #near, #P̄ == 1, Σ exp(s − m)."""

    rowmax: torch.Tensor
    near: torch.Tensor
    ones: torch.Tensor
    rowsum: torch.Tensor
    T: int
    Tk: int

    def estimate(self, confidence: float = 0.95) -> SampledHeadStats:
        """Per-head estimates with intervals (on the host: one device-to-host copy)."""
        rowmax, near, ones, rowsum = (t.detach().double().cpu().numpy() for t in
                                      (self.rowmax, self.near, self.ones, self.rowsum))
        B, H, n = near.shape
        N, m = B * self.T, B * n
        with np.errstate(divide="ignore", invalid="ignore"):
            top1 = 1.0 / rowsum  # NaN for a row with no visible key, as in head_statistics
        ties = (near > 1).sum(axis=(0, 2)).astype(np.int64)  # (H,)
        extra = np.clip(ones - 1, 0, None)
        return SampledHeadStats(
            near_max_ties=_count_estimate(ties, N, m, confidence),
            p_one_extra=_total_estimate(extra, self.T, confidence, cap=max(self.Tk - 1, 0)),
            top1_prob=_mean_estimate(top1, self.T, confidence),
            max_logit_sampled=rowmax.max(axis=(0, 2)),
            rows=N, rows_sampled=m, confidence=confidence,
        )


def _count_estimate(k: np.ndarray, N: int, m: int, confidence: float) -> Estimate:
    """Rows with a property among N, from k of m sampled: Clopper–Pearson, cut to the certain range."""
    from scipy.stats import beta

    if m >= N:
        exact = k.astype(np.float64)
        return Estimate(exact, exact, exact)
    a = 1.0 - confidence
    k = k.astype(np.float64)
    p_lo = np.where(k > 0, beta.ppf(a / 2, k, m - k + 1), 0.0)
    p_hi = np.where(k < m, beta.ppf(1 - a / 2, k + 1, m - k), 1.0)
    low = np.maximum(N * p_lo, k)
    high = np.minimum(N * p_hi, k + (N - m))
    return Estimate(N * k / m, low, high)


def _stratified_mean(x: np.ndarray, T: int, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """x (B, H, n): per head the stratified sample mean (batch rows are strata of T) and its standard error."""
    from scipy.stats import norm

    B, _, n = x.shape
    mean = x.mean(axis=(0, 2))
    if n >= T or n < 2:
        half = np.zeros_like(mean) if n >= T else np.full_like(mean, np.inf)
        return mean, half
    var_b = x.var(axis=2, ddof=1)  # (B, H)
    se = np.sqrt((1.0 - n / T) * var_b.sum(axis=0) / n) / B
    return mean, norm.ppf(0.5 + confidence / 2) * se


def _mean_estimate(x: np.ndarray, T: int, confidence: float) -> Estimate:
    mean, half = _stratified_mean(x, T, confidence)
    return Estimate(mean, np.clip(mean - half, 0.0, 1.0), np.clip(mean + half, 0.0, 1.0))


MIN_NONZERO_FOR_NORMAL = 5  # sampled rows with a nonzero count below which the normal interval is not given


def _total_estimate(x: np.ndarray, T: int, confidence: float, cap: int) -> Estimate:
    """Σ over the N rows of a per-row count in [0, cap], from the sampled rows: the normal interval when at
    least MIN_NONZERO_FOR_NORMAL sampled rows are nonzero, else only the certain range (a normal interval of a
    rare count covers far less than it says)."""
    B, _, n = x.shape
    N = B * T
    mean, half = _stratified_mean(x, T, confidence)
    seen = x.sum(axis=(0, 2))
    certain_high = seen + (N - B * n) * cap
    normal = (x > 0).sum(axis=(0, 2)) >= MIN_NONZERO_FOR_NORMAL
    low = np.where(normal, np.maximum(N * (mean - half), seen), seen)
    high = np.where(normal, np.minimum(N * (mean + half), certain_high), certain_high)
    return Estimate(N * mean, low, high)


@torch.no_grad()
def sampled_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *, scale: Optional[float] = None,
                 causal: bool = True, eps: float = 1e-3, p_dtype: torch.dtype = torch.bfloat16,
                 score_dtype: torch.dtype = torch.float32, backend: str = "auto") -> SampledRows:
    """The statistics of the rows `rows` (B, n) of q (B, H, T, D) against k (B, H, Tk, D), queued on q's device.

    Definitions as monitor/stats.py's head_statistics (causal: bottom-right aligned, key j visible to query i
    when j ≤ i + Tk − T). backend: "auto" (the Triton kernel for CUDA tensors), "triton" or "torch".
    """
    B, H, T, D = q.shape
    Tk = k.shape[2]
    alpha = scale if scale is not None else D ** -0.5
    rows = rows.to(device=q.device, dtype=torch.int64)
    if backend == "triton" or (backend == "auto" and q.is_cuda and q.dtype == k.dtype
                               and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
                               and D in (16, 32, 64, 128, 256)):
        from fa_forensics.replay.triton.monitor_kernel import row_statistics

        rowmax, near, ones, rowsum = row_statistics(q, k, scale=alpha, causal=causal, eps=eps, p_dtype=p_dtype,
                                                    score_dtype=score_dtype, rows=rows)
        return SampledRows(rowmax, near, ones, rowsum, T, Tk)
    return _sampled_rows_torch(q, k, rows, alpha, causal, eps, p_dtype, score_dtype)


def _sampled_rows_torch(q, k, rows, alpha, causal, eps, p_dtype, score_dtype) -> SampledRows:
    B, H, T, _ = q.shape
    Tk = k.shape[2]
    out = {name: [] for name in ("rowmax", "near", "ones", "rowsum")}
    cols = torch.arange(Tk, device=q.device)
    for b in range(B):
        s = torch.matmul(q[b][:, rows[b]].float(), k[b].float().transpose(-1, -2))  # (H, n, Tk)
        if score_dtype != torch.float32:  # the kernel's S: the dot rounded to score_dtype, times α, rounded again
            s = (s.to(score_dtype).float() * alpha).to(score_dtype).float()
        else:
            s = s * alpha
        if causal:
            s = s.masked_fill(cols[None, :] > rows[b][:, None] + (Tk - T), -torch.inf)
        r_m = s.amax(dim=-1, keepdim=True)
        d = s - r_m  # NaN for a row with no visible key: never near, never 1
        p_bar = torch.exp(d)
        out["rowmax"].append(r_m[..., 0])
        out["near"].append((d >= -eps).sum(dim=-1))
        out["rowsum"].append(p_bar.sum(dim=-1))
        out["ones"].append(count_p_one(p_bar, p_dtype, overwrite=True))
    stacked = {name: torch.stack(v) for name, v in out.items()}
    return SampledRows(stacked["rowmax"], stacked["near"], stacked["ones"], stacked["rowsum"], T, Tk)
