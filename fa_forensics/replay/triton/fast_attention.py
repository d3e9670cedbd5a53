"""Training-speed attention kernels: FlashAttention-2 forward and backward, with the stabilized softmax.

These run `stable_attention` (STABLE=True) and the same kernel without the fix (STABLE=False, the
"plain" kernel the fix's cost is measured against). Unlike kernels.py (every cast a replay knob,
for bit-faithful replay), these are built for speed, after Triton's fused-attention tutorial and
FlashAttention-2:
- scores in log2 units: the exponent is fp32(Q Kᵀ)·(α·log2 e) − m, one FMA, so the exponential is
  a bare exp2 (the scale folded in);
- the stabilized shift is computed in the same pass as the row maximum (one extra compare per
  score and one row sum per block), no second pass and no extra memory traffic;
- causal masking only on the diagonal blocks (the blocks below are loaded and used unmasked), the
  sequence-end mask only when T is not a multiple of the tile (a constexpr);
- backward: δ = rowsum(dO ∘ O) precomputed once (its own small kernel); one program per KV block
  walks the query blocks for dK and dV, then the same program walks the KV blocks for the dQ of
  one query block (a separate pass: dQ accumulates in fp32 registers and is stored once, no atomics,
  so the backward is deterministic);
- tiles, warps and pipeline stages from a fixed table per (head dim, dtype), the same for the
  stabilized and plain kernels; Triton's autotuner, TMA tensor descriptors for the K/V tiles, warp
  specialization of the KV loop and the one-pass tie test are options (fast_tiles.py); under the
  interpreter one small fixed config.

Numerics contract (the forward; the CPU reference `replay/stable_reference.py` implements it):
  inputs   Q, K, V in one dtype X (bf16, fp16 or fp32); dots accumulate in fp32 (fp32 inputs:
           input_precision "ieee", never TF32).
  scores   qk = fp32(q·k), −inf where masked (causal: key > query; key ≥ T); s₂ = qk · fp32(α·log2 e)
           (log2 units; on a GPU the multiply may fuse with the subtraction of m below).
  blocks   KV blocks of STABLE_BLOCK_N = 64 keys from key 0, in increasing order. The tile of rows
           (BLOCK_M, autotuned) does not change any result: rows are independent.
  shift    per row and block, r = fp32(max(qk) · α·log2 e) (= the block's max s₂). STABLE: when at least
           two scores of the block are within ε of it, qk ≥ fp32(max(qk) − ε_raw) with ε_raw = fp32(ε/α)
           (the test in the dot's own units, on the block maximum the online softmax takes anyway: one
           compare per score and a row count, or the two largest scores of one reduction, which
           decide alike), and r > −inf, the block's shift
           is r + e with e = (β − 1)·r for r > 0, e = −r for r ≤ 0 (the paper's β·m and 0), and
           e capped at E₂ = fp32(cap(X)·log2 e) (see `max_extra_shift`); else r. The running
           shift is m ← max(m, block shift).
  update   a = exp2(m_old − m), P = exp2(s₂ − m) (fp32), ℓ ← ℓ·a + rowsum(P) (fp32),
           acc ← acc·a + cast(P → X)·V (fp32 accumulator).
  output   O = cast(acc / ℓ → X), LSE₂ = m + log2 ℓ (log2 units) for the backward.
  FMA contraction is allowed (enable_fp_fusion on): the GPU may fuse a multiply and an add.
Why the cap: without it, a repeated maximum r makes the block's largest P equal exp(−(β−1)·r);
past r ≈ 87/(β−1) (fp32/bf16) or 16/(β−1) (fp16 P̄) every P̄ underflows to 0 and O collapses
(the paper's kernel collapses already at ≈ 23, from its 10⁻¹⁰ floor on ℓ; this one has no floor).
With the cap the largest P̄ is at least exp(−cap), a normal number of X with a quarter of X's
range left for the rest of the row, so ℓ can neither underflow nor be floored, and no P̄ is 1.
Backward: P = exp2(s₂ − LSE₂), dV = Σ cast(P → X)ᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − δ),
dK = α Σ cast(dS → X)ᵀ Q, dQ = α Σ cast(dS → X) K, all accumulated in fp32 and stored once in X.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# One definition of the contract's constants, shared with the torch reference (which imports no triton)
from fa_forensics.numerics.elementary import LOG2E
from fa_forensics.replay.stable_reference import STABLE_BLOCK_N, max_extra_shift
from fa_forensics.replay.triton import fast_tiles
from fa_forensics.replay.triton.fast_tiles import KernelOptions


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _load_kv(K, V, ptr, offs_n, T, MASK_T: tl.constexpr):
    """The (BLOCK_N, D) tiles of K and V at `ptr`; rows past T read as 0 only where MASK_T compiles the check."""
    if MASK_T:
        k = tl.load(K + ptr, mask=offs_n[:, None] < T, other=0.0)
        v = tl.load(V + ptr, mask=offs_n[:, None] < T, other=0.0)
    else:
        k = tl.load(K + ptr)
        v = tl.load(V + ptr)
    return k, v


@triton.jit
def _load_kv_fwd(K, V, base, bh, start_n, offs_n, offs_d, T, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_T: tl.constexpr, USE_TMA: tl.constexpr):
    """The forward's K and V tiles: from (B·H, T, D) tensor descriptors (rows past T arrive as 0), or pointers."""
    if USE_TMA:
        k = K.load([bh, start_n, 0]).reshape(BLOCK_N, D)
        v = V.load([bh, start_n, 0]).reshape(BLOCK_N, D)
    else:
        k, v = _load_kv(K, V, base + offs_n[:, None] * D + offs_d[None, :], offs_n, T, MASK_T)
    return k, v


@triton.jit
def _top2(a1, a2, b1, b2):
    """Combine two rows' (largest, second largest) pairs, duplicates counted: the one-pass tie test."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _block_max_and_tie(qk, eps_raw, STABLE: tl.constexpr, TIE_TEST: tl.constexpr):
    """Per row: the block maximum of qk and (STABLE) whether two of its scores are ≥ fp32(max − ε_raw)."""
    if STABLE and TIE_TEST == "top2":  # the two largest in one reduction: tie ⇔ the second reaches the threshold
        r_raw, second = tl.reduce((qk, tl.full(qk.shape, float("-inf"), tl.float32)), 1, _top2)
        tie = second >= r_raw - eps_raw
    else:
        r_raw = tl.max(qk, 1)
        if STABLE:  # an exact count in fp32 ones and zeros (one compare-to-float and one add per score)
            tie = tl.sum(tl.where(qk >= (r_raw - eps_raw)[:, None], 1.0, 0.0), 1) > 1.0
        else:
            tie = r_raw != r_raw  # unused: the plain kernel has no rule
    return r_raw, tie


@triton.jit
def _fwd_blocks(acc, l_i, m_i, r_i, q, K, V, base, bh, offs_m, offs_d, T, qk_scale, eps_raw, beta_m1, max_extra2, lo,
                hi, D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr,
                STABLE: tl.constexpr, DOT_PRECISION: tl.constexpr, TIE_TEST: tl.constexpr, USE_TMA: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr, ROW_MAX: tl.constexpr):
    """Online softmax over the KV blocks [lo, hi), masked only where the constexprs say so. r_i: the running row
    maximum of s₂ (kept only with ROW_MAX; the stabilized shift m_i can exceed it)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + offs_n0
        k, v = _load_kv_fwd(K, V, base, bh, start_n, offs_n, offs_d, T, D, BLOCK_N, MASK_T, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32, unscaled
        if MASK_CAUSAL:
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        if MASK_T:
            qk = tl.where(offs_n[None, :] < T, qk, float("-inf"))
        r_raw, tie = _block_max_and_tie(qk, eps_raw, STABLE, TIE_TEST)
        r = r_raw * qk_scale  # = max of the scaled scores (a positive scale commutes with max)
        if STABLE:  # the paper's rule, in this pass: ties within ε of the block max move the shift up
            extra = tl.minimum(tl.where(r > 0.0, beta_m1 * r, -r), max_extra2)
            m_blk = tl.where(tie & (r > float("-inf")), r + extra, r)
        else:
            m_blk = r
        m_new = tl.maximum(m_i, m_blk)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: P = 0, no NaN
        a = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk * qk_scale - m_sub[:, None])  # one FMA and an exp2 per score
        l_i = l_i * a + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v, acc * a[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        if ROW_MAX:
            r_i = tl.maximum(r_i, r)
    return acc, l_i, m_i, r_i


@triton.jit
def fast_attn_fwd(Q, K, V, O, LSE2, MAX2, T, qk_scale, eps_raw, beta_m1, max_extra2,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  EVEN: tl.constexpr, STABLE: tl.constexpr, DOT_PRECISION: tl.constexpr, TIE_TEST: tl.constexpr,
                  USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, ROW_MAX: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head). Q, K, V, O contiguous (B, H, T, D); with USE_TMA,
    K and V are tensor descriptors over (B·H, T, D) with blocks (1, BLOCK_N, D). With ROW_MAX, MAX2 (B, H, T)
    receives each row's maximum of s₂ (log2 units; the monitor's top-1 probability is exp2(MAX2 − LSE2))."""
    start_m = tl.program_id(0) * BLOCK_M
    bh32 = tl.program_id(1)
    bh = bh32.to(tl.int64)
    base = bh * T * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_ptr = Q + base + offs_m[:, None] * D + offs_d[None, :]
    if EVEN:
        q = tl.load(q_ptr)
    else:
        q = tl.load(q_ptr, mask=offs_m[:, None] < T, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:  # blocks left of the diagonal: no mask; then the diagonal blocks (BLOCK_M is a multiple of BLOCK_N)
        lo, mid, hi, MASK_MID = 0, start_m, tl.minimum(start_m + BLOCK_M, T), not EVEN
    else:  # full blocks; then, for T not a multiple of BLOCK_N, the last one masked
        lo, mid, hi, MASK_MID = 0, (T // BLOCK_N) * BLOCK_N, T, True
    r_i = m_i
    acc, l_i, m_i, r_i = _fwd_blocks(acc, l_i, m_i, r_i, q, K, V, base, bh32, offs_m, offs_d, T, qk_scale, eps_raw,
                                     beta_m1, max_extra2, lo, mid, D, BLOCK_N, False, False, STABLE, DOT_PRECISION,
                                     TIE_TEST, USE_TMA, WARP_SPECIALIZE, ROW_MAX)
    if CAUSAL or not EVEN:
        acc, l_i, m_i, r_i = _fwd_blocks(acc, l_i, m_i, r_i, q, K, V, base, bh32, offs_m, offs_d, T, qk_scale, eps_raw,
                                         beta_m1, max_extra2, mid, hi, D, BLOCK_N, CAUSAL, MASK_MID, STABLE,
                                         DOT_PRECISION, TIE_TEST, USE_TMA, WARP_SPECIALIZE, ROW_MAX)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # rows past T only
    o = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    o_ptr = O + base + offs_m[:, None] * D + offs_d[None, :]
    lse_ptr = LSE2 + bh * T + offs_m
    if EVEN:
        tl.store(o_ptr, o)
        tl.store(lse_ptr, m_i + tl.log2(l_safe))
        if ROW_MAX:
            tl.store(MAX2 + bh * T + offs_m, r_i)
    else:
        tl.store(o_ptr, o, mask=offs_m[:, None] < T)
        tl.store(lse_ptr, m_i + tl.log2(l_safe), mask=offs_m < T)
        if ROW_MAX:
            tl.store(MAX2 + bh * T + offs_m, r_i, mask=offs_m < T)


# ---------------------------------------------------------------------------------------------
# Backward: δ preprocess, then dK/dV (per KV block) and dQ (per query block) in one kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def fast_attn_delta(O, DO, DELTA, T, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """δ = rowsum(fp32(dO) · fp32(O)) per row, once (B, H, T) fp32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, D)
    ptr = bh * T * D + offs_m[:, None] * D + offs_d[None, :]
    row_ok = offs_m < T
    o = tl.load(O + ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + bh * T + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE2, DELTA, base, row_base, offs_n, offs_d, T, qk_scale, lo, hi,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """dK, dV of one KV block (BLOCK_N, D) over the query blocks [lo, hi), in the transposed layout."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        ptr = base + offs_m[:, None] * D + offs_d[None, :]
        if MASK_T:
            q = tl.load(Q + ptr, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(DO + ptr, mask=offs_m[:, None] < T, other=0.0)
            lse2 = tl.load(LSE2 + row_base + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < T, other=0.0)
        else:
            q = tl.load(Q + ptr)
            do = tl.load(DO + ptr)
            lse2 = tl.load(LSE2 + row_base + offs_m)
            delta = tl.load(DELTA + row_base + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M) = s₂ᵀ
        p_t = tl.exp2(s_t - lse2[None, :])
        if MASK_CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        if MASK_T:
            p_t = tl.where((offs_m[None, :] < T) & (offs_n[:, None] < T), p_t, 0.0)
        dv = tl.dot(p_t.to(q.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dq_blocks(dq, q, do, lse2, delta, K, V, base, offs_m, offs_d, T, qk_scale, lo, hi,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """dQ of one query block (BLOCK_M, D) over the KV blocks [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k, v = _load_kv(K, V, base + offs_n[:, None] * D + offs_d[None, :], offs_n, T, MASK_T)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASK_CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if MASK_T:
            p = tl.where((offs_n[None, :] < T) & (offs_m[:, None] < T), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(q.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def fast_attn_bwd(Q, K, V, DO, DQ, DK, DV, LSE2, DELTA, T, sm_scale, qk_scale,
                  D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
                  BLOCK_N2: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program j: dK, dV of KV block j (BLOCK_N1 keys), then dQ of query block j (BLOCK_M2 = BLOCK_N1 rows)."""
    j = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * T * D
    row_base = bh * T
    offs_d = tl.arange(0, D)
    # -- dK, dV ----------------------------------------------------------------------------------
    start_n = j * BLOCK_N1
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    kv_ptr = base + offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(K + kv_ptr, mask=offs_n[:, None] < T, other=0.0)
    v = tl.load(V + kv_ptr, mask=offs_n[:, None] < T, other=0.0)
    dk = tl.zeros([BLOCK_N1, D], tl.float32)
    dv = tl.zeros([BLOCK_N1, D], tl.float32)
    full = (T // BLOCK_M1) * BLOCK_M1  # query blocks below this need no sequence-end mask
    lo = 0
    if CAUSAL:  # the diagonal query blocks masked, the ones below unmasked
        dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE2, DELTA, base, row_base, offs_n, offs_d, T, qk_scale,
                                  start_n, tl.minimum(start_n + BLOCK_N1, T), D, BLOCK_M1, True, not EVEN,
                                  DOT_PRECISION)
        lo = start_n + BLOCK_N1
    dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE2, DELTA, base, row_base, offs_n, offs_d, T, qk_scale,
                              lo, full, D, BLOCK_M1, False, False, DOT_PRECISION)
    if not EVEN:
        dk, dv = _bwd_dkdv_blocks(dk, dv, k, v, Q, DO, LSE2, DELTA, base, row_base, offs_n, offs_d, T, qk_scale,
                                  tl.maximum(full, lo), T, D, BLOCK_M1, False, True, DOT_PRECISION)
    tl.store(DK + kv_ptr, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
    tl.store(DV + kv_ptr, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)
    # -- dQ --------------------------------------------------------------------------------------
    start_m = j * BLOCK_M2
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    row_ok = offs_m < T
    q_ptr = base + offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(Q + q_ptr, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_ptr, mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE2 + row_base + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M2, D], tl.float32)
    if CAUSAL:
        dq = _bwd_dq_blocks(dq, q, do, lse2, delta, K, V, base, offs_m, offs_d, T, qk_scale, 0, start_m,
                            D, BLOCK_N2, False, False, DOT_PRECISION)
        dq = _bwd_dq_blocks(dq, q, do, lse2, delta, K, V, base, offs_m, offs_d, T, qk_scale, start_m,
                            tl.minimum(start_m + BLOCK_M2, T), D, BLOCK_N2, True, not EVEN, DOT_PRECISION)
    else:
        full = (T // BLOCK_N2) * BLOCK_N2
        dq = _bwd_dq_blocks(dq, q, do, lse2, delta, K, V, base, offs_m, offs_d, T, qk_scale, 0, full,
                            D, BLOCK_N2, False, False, DOT_PRECISION)
        if not EVEN:
            dq = _bwd_dq_blocks(dq, q, do, lse2, delta, K, V, base, offs_m, offs_d, T, qk_scale, full, T,
                                D, BLOCK_N2, False, True, DOT_PRECISION)
    tl.store(DQ + q_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Launches: tiles from the table (or the autotuner), the options of fast_tiles.KernelOptions
# ---------------------------------------------------------------------------------------------
def _config(tiles) -> triton.Config:
    return triton.Config(tiles.meta(), num_warps=tiles.num_warps, num_stages=tiles.num_stages)


_FWD_TUNED = triton.autotune(configs=[_config(t) for t in fast_tiles.fwd_autotune_set()],
                             key=["T", "D", "CAUSAL", "STABLE", "EVEN", "TIE_TEST", "USE_TMA",
                                  "WARP_SPECIALIZE", "ROW_MAX"])(fast_attn_fwd)
_BWD_TUNED = triton.autotune(configs=[_config(t) for t in fast_tiles.bwd_autotune_set()],
                             key=["T", "D", "CAUSAL", "EVEN"])(fast_attn_bwd)
_AUTOTUNE_EVEN = 128  # every autotuned tile divides 128: T a multiple of it needs no sequence-end masks


def _check(q: torch.Tensor) -> None:
    D = q.shape[-1]
    if D not in (16, 32, 64, 128):
        from fa_forensics.errors import ConfigError

        raise ConfigError(f"stable_attention: head dim {D} is not supported by the Triton kernel; "
                          "use 16, 32, 64 or 128")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32: exact products, no TF32; 16-bit: tensor cores


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors over K and V viewed as (B·H, T, D), blocks (1, BLOCK_N, D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fa_forensics.errors import ConfigError

    B, H, T, D = k.shape
    if any(x.data_ptr() % 16 for x in (k, v)) or (D * k.element_size()) % 16:
        raise ConfigError("stable_attention: TMA needs K and V 16-byte aligned with rows of a multiple of 16 bytes; "
                          f"got K at {k.data_ptr() % 16} bytes past 16, D {D}; run without the tma option")
    return tuple(TensorDescriptor(x, shape=[B * H, T, D], strides=[T * D, D, 1], block_shape=[1, STABLE_BLOCK_N, D])
                 for x in (k, v))


def forward(q, k, v, *, causal: bool, scale: float, stable: bool, beta: float = 2.0, eps: float = 1e-3,
            options: KernelOptions | None = None, row_max: bool = False):
    """O (B, H, T, D) in q's dtype and LSE₂ (B, H, T) fp32 (log2 units); with row_max also each row's maximum
    of s₂ = α·log2 e·q·k (B, H, T) fp32, log2 units. q, k, v contiguous, one dtype."""
    _check(q)
    options = options or KernelOptions.from_env()
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse2 = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    max2 = torch.empty_like(lse2) if row_max else lse2  # not written without ROW_MAX
    kk, vv = _kv_descriptors(k, v) if options.tma else (k, v)
    args = (q, kk, vv, o, lse2, max2, T, scale * LOG2E, eps / scale, beta - 1.0, max_extra_shift(q.dtype) * LOG2E)
    consts = dict(D=D, BLOCK_N=STABLE_BLOCK_N, CAUSAL=causal, STABLE=stable, DOT_PRECISION=_dot_precision(q.dtype),
                  TIE_TEST=options.tie_test, USE_TMA=options.tma, WARP_SPECIALIZE=options.warp_specialize,
                  ROW_MAX=row_max)
    try:
        if options.tuning == "autotune" and not _interpreting():
            _FWD_TUNED[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](*args, **consts,
                                                                              EVEN=T % _AUTOTUNE_EVEN == 0)
        else:
            tiles = fast_tiles.INTERPRETER_FWD if _interpreting() else fast_tiles.fwd_tiles(D, causal, q.dtype)
            fast_attn_fwd[(triton.cdiv(T, tiles.block_m), B * H)](*args, **consts, **tiles.meta(),
                                                                  EVEN=T % tiles.block_m == 0,
                                                                  num_warps=tiles.num_warps,
                                                                  num_stages=tiles.num_stages)
    except RuntimeError as exc:  # Triton's warp specialization is partial: say so in one line
        if not options.warp_specialize:
            raise
        from fa_forensics.errors import ConfigError

        raise ConfigError(f"stable_attention: Triton {triton.__version__} could not warp-specialize the forward on "
                          f"this GPU ({str(exc).splitlines()[0]}); run without the warp_specialize option") from exc
    return (o, lse2, max2) if row_max else (o, lse2)


def backward(q, k, v, o, lse2, do, *, causal: bool, scale: float, options: KernelOptions | None = None):
    """dq, dk, dv (B, H, T, D) in q's dtype. do contiguous in q's dtype."""
    options = options or KernelOptions.from_env()
    B, H, T, D = q.shape
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    fast_attn_delta[(triton.cdiv(T, 64), B * H)](o, do, delta, T, D=D, BLOCK_M=64)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, do, dq, dk, dv, lse2, delta, T, scale, scale * LOG2E)
    consts = dict(D=D, CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    if options.tuning == "autotune" and not _interpreting():
        _BWD_TUNED[lambda meta: (triton.cdiv(T, meta["BLOCK_N1"]), B * H)](*args, **consts,
                                                                           EVEN=T % _AUTOTUNE_EVEN == 0)
        return dq, dk, dv
    tiles = fast_tiles.INTERPRETER_BWD if _interpreting() else fast_tiles.bwd_tiles(D, causal, q.dtype)
    fast_attn_bwd[(triton.cdiv(T, tiles.block_n1), B * H)](*args, **consts, **tiles.meta(),
                                                           EVEN=T % tiles.block_n1 == 0, num_warps=tiles.num_warps,
                                                           num_stages=tiles.num_stages)
    return dq, dk, dv


def autotuned_picks() -> dict[str, list[dict]]:
    """The configs the autotuner settled on so far, per kernel: [{key, config}] (for the device benchmark)."""
    picks = {}
    for name, tuner in (("fwd", _FWD_TUNED), ("bwd", _BWD_TUNED)):
        picks[name] = [{"key": [str(x) for x in key], "config": {**cfg.kwargs, "num_warps": cfg.num_warps,
                                                                  "num_stages": cfg.num_stages}}
                       for key, cfg in tuner.cache.items()]
    return picks
