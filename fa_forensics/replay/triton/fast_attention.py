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
- tiles, warps and pipeline stages autotuned on a GPU (configs for Hopper: 128-row tiles,
  num_stages 3-4, num_warps 4-8); under the interpreter one fixed config.

Numerics contract (the forward; the CPU reference `replay/stable_reference.py` implements it):
  inputs   Q, K, V in one dtype X (bf16, fp16 or fp32); dots accumulate in fp32 (fp32 inputs:
           input_precision "ieee", never TF32).
  scores   qk = fp32(q·k), −inf where masked (causal: key > query; key ≥ T); s₂ = qk · fp32(α·log2 e)
           (log2 units; on a GPU the multiply may fuse with the subtraction of m below).
  blocks   KV blocks of STABLE_BLOCK_N = 64 keys from key 0, in increasing order. The tile of rows
           (BLOCK_M, autotuned) does not change any result: rows are independent.
  shift    per row and block, r = fp32(max(qk) · α·log2 e) (= the block's max s₂). STABLE: when at least
           two scores of the block are within ε of it, qk ≥ fp32(max(qk) − ε_raw) with ε_raw = fp32(ε/α)
           (the test in the dot's own units: one compare per score), and r > −inf, the block's shift
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
def _fwd_blocks(acc, l_i, m_i, q, K, V, base, offs_m, offs_d, T, qk_scale, eps_raw, beta_m1, max_extra2, lo, hi,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr,
                STABLE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over the KV blocks [lo, hi), masked only where the constexprs say so."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k, v = _load_kv(K, V, base + offs_n[:, None] * D + offs_d[None, :], offs_n, T, MASK_T)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32, unscaled
        if MASK_CAUSAL:
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        if MASK_T:
            qk = tl.where(offs_n[None, :] < T, qk, float("-inf"))
        r_raw = tl.max(qk, 1)
        r = r_raw * qk_scale  # = max of the scaled scores (a positive scale commutes with max)
        if STABLE:  # the paper's rule, in this pass: ties within ε of the block max move the shift up
            n_near = tl.sum((qk >= (r_raw - eps_raw)[:, None]).to(tl.int32), 1)  # one compare per score
            extra = tl.minimum(tl.where(r > 0.0, beta_m1 * r, -r), max_extra2)
            m_blk = tl.where((n_near > 1) & (r > float("-inf")), r + extra, r)
        else:
            m_blk = r
        m_new = tl.maximum(m_i, m_blk)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: P = 0, no NaN
        a = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk * qk_scale - m_sub[:, None])  # one FMA and an exp2 per score
        l_i = l_i * a + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v, acc * a[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fast_attn_fwd(Q, K, V, O, LSE2, T, qk_scale, eps_raw, beta_m1, max_extra2,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  EVEN: tl.constexpr, STABLE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head). Q, K, V, O contiguous (B, H, T, D)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
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
    if CAUSAL:
        # blocks left of the diagonal: no mask; then the diagonal blocks (BLOCK_M is a multiple of BLOCK_N)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, base, offs_m, offs_d, T, qk_scale, eps_raw, beta_m1,
                                    max_extra2, 0, start_m, D, BLOCK_N, False, False, STABLE, DOT_PRECISION)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, base, offs_m, offs_d, T, qk_scale, eps_raw, beta_m1,
                                    max_extra2, start_m, tl.minimum(start_m + BLOCK_M, T), D, BLOCK_N, True,
                                    not EVEN, STABLE, DOT_PRECISION)
    else:
        full = (T // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, base, offs_m, offs_d, T, qk_scale, eps_raw, beta_m1,
                                    max_extra2, 0, full, D, BLOCK_N, False, False, STABLE, DOT_PRECISION)
        if not EVEN:
            acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, base, offs_m, offs_d, T, qk_scale, eps_raw, beta_m1,
                                        max_extra2, full, T, D, BLOCK_N, False, True, STABLE, DOT_PRECISION)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # rows past T only
    o = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    o_ptr = O + base + offs_m[:, None] * D + offs_d[None, :]
    lse_ptr = LSE2 + bh * T + offs_m
    if EVEN:
        tl.store(o_ptr, o)
        tl.store(lse_ptr, m_i + tl.log2(l_safe))
    else:
        tl.store(o_ptr, o, mask=offs_m[:, None] < T)
        tl.store(lse_ptr, m_i + tl.log2(l_safe), mask=offs_m < T)


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
# Tuning and launches
# ---------------------------------------------------------------------------------------------
def _fwd_configs() -> list:
    """Hopper-sized forward tiles (BLOCK_N is fixed by the contract; BLOCK_M a multiple of it)."""
    shapes = ((128, 8, 3), (128, 4, 3), (128, 8, 4), (64, 4, 4))
    return [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=s) for m, w, s in shapes]


def _bwd_configs() -> list:
    """(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2): dK/dV walks thin query blocks, dQ thin KV blocks."""
    shapes = ((32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 3), (32, 64, 64, 32, 4, 4))
    return [triton.Config({"BLOCK_M1": a, "BLOCK_N1": b, "BLOCK_M2": c, "BLOCK_N2": d}, num_warps=w, num_stages=s)
            for a, b, c, d, w, s in shapes]


_FWD_TUNED = triton.autotune(configs=_fwd_configs(), key=["T", "D", "CAUSAL", "STABLE", "EVEN"])(fast_attn_fwd)
_BWD_TUNED = triton.autotune(configs=_bwd_configs(), key=["T", "D", "CAUSAL", "EVEN"])(fast_attn_bwd)
# Under the interpreter: one small config (each tl.dot is evaluated in numpy).
_INTERPRETER_FWD = dict(BLOCK_M=64)
_INTERPRETER_BWD = dict(BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16)


def _check(q: torch.Tensor) -> None:
    D = q.shape[-1]
    if D not in (16, 32, 64, 128):
        from fa_forensics.errors import ConfigError

        raise ConfigError(f"stable_attention: head dim {D} is not supported by the Triton kernel; "
                          "use 16, 32, 64 or 128")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32: exact products, no TF32; 16-bit: tensor cores


def forward(q, k, v, *, causal: bool, scale: float, stable: bool, beta: float = 2.0, eps: float = 1e-3):
    """O (B, H, T, D) in q's dtype and LSE₂ (B, H, T) fp32 (log2 units). q, k, v contiguous, one dtype."""
    _check(q)
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse2 = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    args = (q, k, v, o, lse2, T, scale * LOG2E, eps / scale, beta - 1.0, max_extra_shift(q.dtype) * LOG2E)
    consts = dict(D=D, BLOCK_N=STABLE_BLOCK_N, CAUSAL=causal, EVEN=T % 128 == 0, STABLE=stable,
                  DOT_PRECISION=_dot_precision(q.dtype))
    if _interpreting():
        consts["EVEN"] = T % _INTERPRETER_FWD["BLOCK_M"] == 0
        fast_attn_fwd[(triton.cdiv(T, _INTERPRETER_FWD["BLOCK_M"]), B * H)](*args, **consts, **_INTERPRETER_FWD)
    else:
        _FWD_TUNED[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](*args, **consts)
    return o, lse2


def backward(q, k, v, o, lse2, do, *, causal: bool, scale: float):
    """dq, dk, dv (B, H, T, D) in q's dtype. do contiguous in q's dtype."""
    B, H, T, D = q.shape
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    fast_attn_delta[(triton.cdiv(T, 64), B * H)](o, do, delta, T, D=D, BLOCK_M=64)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, do, dq, dk, dv, lse2, delta, T, scale, scale * LOG2E)
    consts = dict(D=D, CAUSAL=causal, EVEN=T % 128 == 0, DOT_PRECISION=_dot_precision(q.dtype))
    if _interpreting():
        consts["EVEN"] = T % _INTERPRETER_BWD["BLOCK_N1"] == 0
        fast_attn_bwd[(triton.cdiv(T, _INTERPRETER_BWD["BLOCK_N1"]), B * H)](*args, **consts, **_INTERPRETER_BWD)
    else:
        _BWD_TUNED[lambda meta: (triton.cdiv(T, meta["BLOCK_N1"]), B * H)](*args, **consts)
    return dq, dk, dv
