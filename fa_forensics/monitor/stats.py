"""Per-head attention statistics from Q and K, computed in row chunks.

The paper's leading indicator (App. E.1, Fig. 13) is the number of score rows whose maximum is
attained more than once: those rows give P̄ = exp(S − m) = 1 several times and feed the biased
rounding of P̄V. We count, per (batch-summed) head:
  max_logit       max over rows of the scaled score S = α q·k (causal positions only)
  near_max_ties   rows whose maximum is attained more than once within ε (r_m − S ≤ ε, count > 1)
  p_one_extra     Σ over rows of max(0, #{P̄ == 1 in the P̄ dtype} − 1): unit entries beyond the first
  top1_prob       mean over rows of the largest softmax probability, 1 / Σ_t exp(S_t − r_m)
  attn_entropy    mean over rows of the softmax entropy in nats, log Z − Σ_t P̄_t (S_t − r_m) / Z with
                  P̄ = exp(S − r_m) and Z = Σ_t P̄_t: from the P̄ and S − r_m the counts use anyway
                  (one multiply-add pass); log(T) for uniform attention, 0 when a row sees one key
Scores are counted in the score precision of the kernel being monitored (`score_dtype`): a kernel
that forms S in bf16 (the paper's recipe) rounds nearby scores onto one value and has several
times more repeated maxima than fp32 scores show. S = cast(fp32(cast(fp32(q·k) → score_dtype)·α)
→ score_dtype) (for fp32 scores: fp32(q·k)·α), then "within ε" is fp32(S − r_m) ≥ −ε on those
values. The torch version works `chunk` query rows at a time, so memory is O(chunk · T) per head
instead of O(T²); on a GPU the fused Triton kernel (replay/triton/monitor_kernel.py, the same
definitions) computes per-row results in one launch, without copies or a synchronization.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.monitor.p_one import count_p_one, near_set_within_p_one
from fa_forensics.optional import require

# Per-(layer, head) series the monitor appends to a dump's timeline/ group, one row per step.
TIMELINE_METRICS = ("max_logit", "near_max_ties", "p_one_extra", "top1_prob", "wq_sigma", "attn_entropy")


@dataclass(frozen=True)
class HeadStats:
    """Statistics of one attention call, one value per head (summed/maxed over the batch)."""

    max_logit: torch.Tensor  # (H,) fp32
    near_max_ties: torch.Tensor  # (H,) int64
    p_one_extra: torch.Tensor  # (H,) int64
    top1_prob: torch.Tensor  # (H,) fp32, mean over batch and rows
    rows: int  # rows per head that were looked at (B · T)
    attn_entropy: Optional[torch.Tensor] = None  # (H,) fp32, mean over batch and rows, nats (None: not measured)


@torch.no_grad()
def head_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    eps: float = 1e-3,
    p_dtype: torch.dtype = torch.bfloat16,
    chunk: int = 128,
    to_cpu: bool = True,
    score_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> HeadStats:
    """Statistics of softmax(α q kᵀ) per head, without building the T×T matrix.

    q, k: (B, H, T, D) (K may have its own length Tk). `p_dtype` is the dtype P̄ is cast to
    before P̄V (bf16 in the paper's setting). It decides which entries count as equal to 1.
    `score_dtype` is the precision the monitored kernel forms S in (fp32, bf16 or fp16).
    to_cpu=False leaves the results on q's device (the monitor copies a whole step at once).
    backend: "auto" (the Triton kernel for CUDA tensors, torch otherwise), "torch" or "triton".

    Cost per chunk of rows: one matmul, then scale, mask, max, subtract and exp over the columns
    that the causal mask leaves open. Then the P̄ == 1 count, done as floor(P̄ + 2⁻⁹) (see p_one.py),
    and the row sums. The ε comparison runs only on rows with two or more P̄ == 1 entries, when
    ε ≤ |EXP_ONE_MIN| (CPU only; on a GPU, deciding which rows those are would need a device sync).
    The results match the earlier direct version bit for bit (it is kept as the reference in
    tests/unit/monitor/test_monitor_stats.py):
    - the matmul is called on the same shapes;
    - scale, mask and subtract are exact IEEE operations on the same values (a score of −0 may
      become +0, which is equal as a number);
    - masked entries of the summed rows hold exp(−inf) = 0;
    - the counts are exact.
    The one thing this argument does not prove: a tail of a row (odd T) may go through torch's scalar
    exp instead of its vectorized one. The two agreed on 5·10⁷ random arguments.
    """
    B, H, T, D = q.shape
    Tk = k.shape[2]
    alpha = scale if scale is not None else D ** -0.5
    device = q.device
    if backend == "triton" or (backend == "auto" and q.is_cuda and _fused_kernel_fits(q, k)):
        return _head_statistics_fused(q, k, alpha, causal, eps, p_dtype, score_dtype, to_cpu)
    rounded = score_dtype != torch.float32
    kT = k.float().transpose(-1, -2)  # (B, H, D, Tk); a view, no copy when k is fp32
    max_logit = torch.full((H,), -torch.inf, device=device)
    ties = torch.zeros(H, dtype=torch.int64, device=device)
    p_one_extra = torch.zeros(H, dtype=torch.int64, device=device)
    top1_sum = torch.zeros(H, dtype=torch.float64, device=device)
    entropy_sum = torch.zeros(H, dtype=torch.float64, device=device)
    ties_from_p_one = device.type == "cpu" and near_set_within_p_one(eps, p_dtype)
    bias, mask = _causal_mask(T, Tk, device) if causal else (None, None)  # (T, Tk) fp32 0 / −inf, and bool
    add_mask = (bias is not None and device.type == "cpu" and score_dtype != torch.float16
                and _scores_are_finite(q, k, alpha, D))  # fp16 scores can overflow to ±inf
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        s = torch.matmul(q[:, :, start:stop].float(), kT)  # (B, H, c, Tk): the same call and shapes as ever (same bits)
        # columns the chunk's rows may see
        w = min(Tk, _round_up(max(stop + Tk - T, 1), _VECTOR_COLUMNS)) if causal else Tk
        d = s[..., :w]  # (B, H, c, w) view; columns ≥ w are masked for every row of the chunk
        if rounded:  # the kernel's S: the dot rounded to score_dtype, times α, rounded again
            d.copy_(d.to(score_dtype))
            d.mul_(alpha)
            d.copy_(d.to(score_dtype))
        else:
            d.mul_(alpha)  # S = α q·k
        if add_mask:  # finite scores: S + 0 = S exactly and S + (−inf) = −inf, as masked_fill but 8× cheaper
            d.add_(bias[start:stop, :w])
        elif mask is not None:  # ±inf or NaN scores (or a GPU): masked_fill (inf + (−inf) would be NaN)
            d.masked_fill_(mask[start:stop, :w], -torch.inf)
        r_m = d.amax(dim=-1, keepdim=True)  # (B, H, c, 1)
        max_logit = torch.maximum(max_logit, r_m.amax(dim=(0, 2, 3)))
        d.sub_(r_m)  # S − m ≤ 0; fl(m − S) = −fl(S − m) (rounding is symmetric)
        # (B, H, c, Tk) fp32; whole rows, so each row sum adds the same values in the same order
        p_bar = torch.empty_like(s)
        _exp_into(p_bar, d, start, T, Tk, causal)
        z = p_bar.sum(dim=-1)  # (B, H, c)
        top1_sum += (1.0 / z).double().sum(dim=(0, 2))
        entropy_sum += _row_entropy(p_bar[..., :w], d, z).double().sum(dim=(0, 2))
        ones = count_p_one(p_bar, p_dtype, overwrite=True)  # (B, H, c) P̄ == 1 in p_dtype (p_bar is spent)
        p_one_extra += (ones - 1).clamp_(min=0).sum(dim=(0, 2))
        if ties_from_p_one:  # near ⊂ {P̄ == 1}: only rows with two ones can have a repeated maximum
            candidates = ones > 1  # (B, H, c)
            if bool(candidates.any()):
                tie_rows = torch.zeros_like(candidates)
                tie_rows[candidates] = (d[candidates] >= -eps).sum(dim=-1) > 1
                ties += tie_rows.sum(dim=(0, 2))
        else:
            ties += ((d >= -eps).sum(dim=-1) > 1).sum(dim=(0, 2))  # NaN (fully masked rows) is never near
    rows_total = B * T
    move = (lambda t: t.cpu()) if to_cpu else (lambda t: t)
    return HeadStats(
        max_logit=move(max_logit),
        near_max_ties=move(ties),
        p_one_extra=move(p_one_extra),
        top1_prob=move((top1_sum / rows_total).float()),
        rows=rows_total,
        attn_entropy=move((entropy_sum / rows_total).float()),
    )


def _row_entropy(p_bar: torch.Tensor, d: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Softmax entropy per row, nats: log Z − Σ P̄·d / Z for d = S − r_m ≤ 0, P̄ = exp(d), Z = Σ P̄.

    Masked entries hold d = −inf and P̄ = 0: d is clamped in place to the lowest finite value of its dtype (−inf →
    e.g. −3.4e38 in fp32, which leaves every comparison with −ε as it was; NaN stays NaN), so their product is −0
    while a NaN score keeps the row NaN."""
    d.clamp_(min=torch.finfo(d.dtype).min)
    return torch.log(z) - torch.linalg.vecdot(p_bar, d) / z


def _fused_kernel_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The fused kernel takes one input dtype of fp32/bf16/fp16 and a power-of-two head dim 16..256."""
    D = q.shape[-1]
    return q.dtype == k.dtype and q.dtype in (torch.float32, torch.bfloat16,
                                              torch.float16) and D in (16, 32, 64, 128, 256)


def _head_statistics_fused(q, k, alpha, causal, eps, p_dtype, score_dtype, to_cpu) -> HeadStats:
    """head_statistics from the fused kernel's per-row results (B, H, T), reduced per head on the device."""
    require("triton", "the monitor's fused statistics kernel (CUDA tensors or backend='triton')")
    from fa_forensics.replay.triton.monitor_kernel import row_statistics

    B, H, T, _ = q.shape
    rowmax, near, ones, rowsum = row_statistics(q, k, scale=alpha, causal=causal, eps=eps, p_dtype=p_dtype,
                                                score_dtype=score_dtype)
    top1_sum = (1.0 / rowsum).double().sum(dim=(0, 2))
    move = (lambda t: t.cpu()) if to_cpu else (lambda t: t)
    return HeadStats(
        max_logit=move(rowmax.amax(dim=(0, 2))),
        near_max_ties=move((near > 1).sum(dim=(0, 2))),
        p_one_extra=move((ones.long() - 1).clamp_(min=0).sum(dim=(0, 2))),
        top1_prob=move((top1_sum / (B * T)).float()),
        rows=B * T,
    )


# Column counts are rounded up to a multiple of this. When Tk is a multiple of 32, every exp then runs
# in torch's vectorized CPU loop (2 × 16 fp32 lanes per step), as it did over the full rows.
_VECTOR_COLUMNS = 32


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _exp_into(p_bar: torch.Tensor, d: torch.Tensor, start: int, T: int, Tk: int, causal: bool) -> None:
    """p_bar[..., :w] = exp(d) and 0 beyond, for d = S − m (B, H, c, w).

    exp(−inf) costs torch's CPU exp about 3.5× a normal argument. Under a causal mask, the rows are
    therefore done in groups of 32, each over the columns its own rows may see. The entries outside
    those columns are masked (−inf), so 0 is written there, which is exactly exp(−inf).
    """
    c, w = d.shape[-2], d.shape[-1]
    group = _VECTOR_COLUMNS if causal else c
    for r0 in range(0, c, group):
        r1 = min(r0 + group, c)
        w_r = min(w, _round_up(max(start + r1 + Tk - T, 1), _VECTOR_COLUMNS)) if causal else w
        torch.exp(d[..., r0:r1, :w_r], out=p_bar[..., r0:r1, :w_r])
        if w_r < p_bar.shape[-1]:
            p_bar[..., r0:r1, w_r:].zero_()


def _scores_are_finite(q: torch.Tensor, k: torch.Tensor, alpha: float, D: int) -> bool:
    """True when every α·q·k is finite in fp32: finite inputs and D·max|q|·max|k|·α < 10³⁸ (no partial sum can
    overflow)."""
    def max_abs(t: torch.Tensor) -> float:  # one pass, no |t| copy; NaN propagates
        lo, hi = (float(v) for v in torch.aminmax(t))
        return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)

    bound = max_abs(q) * max_abs(k) * D * max(alpha, 1.0)  # NaN or inf inputs: not < 1e38
    return bound < 1e38


_MASK_CACHE: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _causal_mask(T: int, Tk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal mask (bottom-right aligned) as (T, Tk) fp32 bias (0 allowed, −inf masked) and as bool (True masked)."""
    key = (T, Tk, str(device))
    cached = _MASK_CACHE.get(key)
    if cached is None:
        rows = torch.arange(T, device=device) + (Tk - T)
        masked = torch.arange(Tk, device=device)[None, :] > rows[:, None]
        cached = (torch.zeros(T, Tk, device=device).masked_fill_(masked, -torch.inf), masked)
        if len(_MASK_CACHE) >= 8:  # a few shapes per run: keep the cache small
            _MASK_CACHE.pop(next(iter(_MASK_CACHE)))
        _MASK_CACHE[key] = cached
    return cached
