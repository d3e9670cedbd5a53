"""The monitor's per-row attention statistics in one fused kernel (never a T×T matrix in memory).

monitor/stats.py reduces these rows to its per-head HeadStats; its chunked torch version is the
reference, and this kernel follows its definitions operation for operation:
  s      = cast(fp32(cast(fp32(q·k) → SCORE_DTYPE) · α) → SCORE_DTYPE) (fp32 scores: one fp32
           multiply, no casts), −inf where masked (causal, bottom-right aligned: key j is visible
           to query i when j ≤ i + Tk − T; keys ≥ Tk).
  m      = the row's maximum of s (pass 1, over all KV blocks).
  ℓ      = Σ exp(s − m) in fp32 (pass 1, online: rescaled when m grows) → top-1 probability 1/ℓ.
  near   = #{s : fp32(s − m) ≥ −ε} (pass 2, with the final m): a row with near > 1 has a repeated maximum.
  ones   = #{s : cast(exp(s − m) → P_DTYPE) == 1} (pass 2; COUNTS=False skips pass 2).
Two passes over K because "within ε of the row maximum" needs the final maximum; each pass is one
Q Kᵀ tile product per block (the statistics cost about two forward score computations, no P V).
The rows are every row, or a sample of row positions per batch row (the same for every head), for
the monitor's sampled estimator (monitor/sampled.py).
exp is evaluated as exp2(x·log2 e). The counts equal the torch version's exactly whenever both
form the same scores (the dot's summation order can differ by an fp32 ulp on a GPU) and no
exp(s − m) lies within a few ulps of the P̄ == 1 threshold (torch's exp and this exp2 differ in
the last bit).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fa_forensics.numerics.elementary import LOG2E

_LOG2E = tl.constexpr(LOG2E)
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _scores(q, K, base, offs_m, offs_n, offs_d, T, Tk, scale, D: tl.constexpr, CAUSAL: tl.constexpr,
            SCORE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < Tk, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SCORE_DTYPE == tl.float32:
        s = s * scale
    else:
        s = (s.to(SCORE_DTYPE).to(tl.float32) * scale).to(SCORE_DTYPE).to(tl.float32)
    visible = offs_n[None, :] < Tk
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Tk - T))
    return tl.where(visible, s, float("-inf"))


@triton.jit
def monitor_rows(Q, K, ROWS, ROWMAX, NEAR, ONES, ROWSUM, T, Tk, H, n_rows, scale, eps,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 SCORE_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SAMPLED: tl.constexpr, COUNTS: tl.constexpr = True):
    """One program: BLOCK_M rows of one (batch, head); Q (B, H, T, D), K (B, H, Tk, D) contiguous. Every row
    (n_rows = T), or with SAMPLED the rows ROWS[b, :n_rows] (positions, ascending) of batch row b; the
    results go to (B·H, n_rows)."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # index into this (batch, head)'s rows
    bh = tl.program_id(1).to(tl.int64)
    row_ok = i < n_rows
    if SAMPLED:
        offs_m = tl.load(ROWS + (bh // H) * n_rows + i, mask=row_ok, other=0)
    else:
        offs_m = i
    offs_d = tl.arange(0, D)
    q = tl.load(Q + bh * T * D + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = bh * Tk * D
    hi = Tk
    if CAUSAL:  # keys no row of this block can see are skipped
        hi = tl.minimum(Tk, tl.max(tl.where(row_ok, offs_m, 0), 0) + 1 + Tk - T)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ell = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, hi, BLOCK_N):  # pass 1: maximum and row sum
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _scores(q, K, k_base, offs_m, offs_n, offs_d, T, Tk, scale, D, CAUSAL, SCORE_DTYPE, DOT_PRECISION)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        ell = ell * tl.exp2((m - m_sub) * _LOG2E) + tl.sum(
            tl.exp2((s - m_sub[:, None]) * _LOG2E), 1)
        m = m_new
    out = bh * n_rows + i
    if COUNTS:
        near = tl.zeros([BLOCK_M], tl.int32)
        ones = tl.zeros([BLOCK_M], tl.int32)
        for start_n in range(0, hi, BLOCK_N):  # pass 2: counts against the final maximum
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = _scores(q, K, k_base, offs_m, offs_n, offs_d, T, Tk, scale, D, CAUSAL, SCORE_DTYPE, DOT_PRECISION)
            d = s - m[:, None]  # NaN for a row with no visible key: never near, never 1
            near += tl.sum((d >= -eps).to(tl.int32), 1)
            p_bar = tl.exp2(d * _LOG2E).to(P_DTYPE).to(tl.float32)
            ones += tl.sum((p_bar == 1.0).to(tl.int32), 1)
        tl.store(NEAR + out, near, mask=row_ok)
        tl.store(ONES + out, ones, mask=row_ok)
    ell = tl.where(m == float("-inf"), float("nan"), ell)  # no visible key: top-1 is undefined, as in torch
    tl.store(ROWMAX + out, m, mask=row_ok)
    tl.store(ROWSUM + out, ell, mask=row_ok)


def row_statistics(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool, eps: float,
                   p_dtype: torch.dtype, score_dtype: torch.dtype, rows: torch.Tensor | None = None,
                   counts: bool = True):
    """Per row (B, H, n): maximum (fp32), #near (int32), #P̄ == 1 (int32), Σ exp(s − m) (fp32).

    q (B, H, T, D), k (B, H, Tk, D) in one dtype (fp32, bf16 or fp16); D a power of two ≥ 16.
    rows: None for every row (n = T), or (B, n) int positions, ascending per batch row, the same n for
    every batch row (the monitor's sampled rows: monitor/sampled.py); each costs what a full row costs.
    counts=False runs pass 1 only (max logit and top-1 of every row at half the cost; the counts can come
    from sampled rows): #near and #P̄ == 1 are then None.
    """
    B, H, T, D = q.shape
    Tk = k.shape[2]
    q, k = q.contiguous(), k.contiguous()
    n = T if rows is None else rows.shape[1]
    rows_arg = q if rows is None else rows.to(device=q.device, dtype=torch.int32).contiguous()  # q: never read
    rowmax = torch.empty((B, H, n), dtype=torch.float32, device=q.device)
    rowsum = torch.empty_like(rowmax)
    near = torch.empty((B, H, n), dtype=torch.int32, device=q.device)
    ones = torch.empty_like(near)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    block_m, block_n = (32, 32) if interpreting else (64, 64)
    if rows is not None and not interpreting:
        block_m = 16  # sampled rows spread over the sequence: small blocks keep each one's causal key range short
    monitor_rows[(triton.cdiv(n, block_m), B * H)](
        q, k, rows_arg, rowmax, near, ones, rowsum, T, Tk, H, n, float(scale), float(eps),
        D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, SCORE_DTYPE=_TL[score_dtype], P_DTYPE=_TL[p_dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SAMPLED=rows is not None, COUNTS=counts,
        num_warps=4,
    )
    return (rowmax, near, ones, rowsum) if counts else (rowmax, None, None, rowsum)
