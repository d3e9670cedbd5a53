"""FlashAttention-2 kernels whose every cast is a ReplayConfig setting (forward, δ, dK/dV, dQ).

Structure follows Triton's fused-attention tutorial (exp2 for the exponential, the log-sum-exp
saved by the forward, a separate δ kernel, a backward without atomics: one kernel owns dK/dV of a
KV block, another owns dQ of a query block), with these differences, all for faithful replay:

- S = α·(Q Kᵀ) is formed in fp32 (the scale multiplies the fp32 dot; K is never pre-scaled in
  its input dtype) and stays in natural-log units: row maxima, the stabilized count
  "within ε of the block max", the shift m and the lse are all compared and stored in natural
  units, exactly as the CPU emulator does them. The exp2 domain enters only inside the
  exponential: exp(x) is evaluated as exp2(x·log2 e), so ε needs no conversion (it is applied to
  S in the units the user gave it).
- Cast dtypes (P̄, the P̄V product / accumulator, O, dS, and the autocast reference's
  intermediates: scores S_DTYPE, running statistics STATS_DTYPE, s − m SUB_DTYPE, rescaled
  accumulator RESCALE_DTYPE) are constexpr dtypes; a cast point is `x.to(DT).to(tl.float32)`
  (a no-op for fp32), so values are held in fp32 and only rounded there. fp32 dots use
  input_precision="ieee" (never TF32); elementwise math is fp32 throughout.
- The softmax rule ("standard" | "stabilized" | "fixed-offset") and the fp8 P-scale mode
  ("exponent-offset" | "multiply") are constexpr strings, not bit flags.

Masking: a score outside the causal triangle or past T is −inf before the row max, so its P is
exactly 0. A row whose every score so far is masked keeps m = −inf; the shift subtracted is then
0 (never −inf − (−inf)), which keeps P = 0 and the rescale factor 0 instead of NaN.

Layout: Q, K, V, dO, O, dQ, dK, dV are contiguous (B, H, T, D); LSE and DELTA are (B, H, T) fp32;
STATS is (B, H, T, 4) int32 per row. Program ids: axis 0 = row (or KV) block, axis 1 = b·H + h.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fa_forensics.numerics.elementary import LOG2E

_LOG2E = tl.constexpr(LOG2E)  # log2 e as the kernels' exp(x) = exp2(x · log2 e) reads it


@triton.jit
def _row_shift(s, m_i, beta, eps, offset, SOFTMAX: tl.constexpr, S_DTYPE: tl.constexpr):
    """New running shift m (BLOCK_M,) after seeing block scores s (BLOCK_M, BLOCK_N), and whether
    the stabilized rule fired. Paper Algorithm 3, lines 7-10, with the adjusted m'' in the max.

    The "within ε" test is fp32 r_m − s ≤ ε, or, for scores below fp32 (the autocast reference's
    `S >= rowmax − eps` on bf16 tensors), s ≥ cast(r_m − ε → S_DTYPE). A row with no visible
    score in the block (r_m = −inf) never counts as repeated: it keeps m_i."""
    r_m = tl.max(s, 1)  # block row max, natural units
    fired = r_m != r_m  # all False, right shape
    if SOFTMAX == "stabilized":
        if S_DTYPE == tl.float32:
            r_s = tl.sum(((r_m[:, None] - s) <= eps).to(tl.int32), 1)  # scores within ε of r_m
        else:
            threshold = (r_m - eps).to(S_DTYPE).to(tl.float32)  # (BLOCK_M,)
            r_s = tl.sum((s >= threshold[:, None]).to(tl.int32), 1)
        repeated = (r_s > 1) & (r_m > float("-inf"))
        fired = repeated & (r_m != 0.0)
        m_blk = tl.where((r_m > 0.0) & repeated, beta * r_m, r_m)
        m_blk = tl.where((r_m < 0.0) & repeated, 0.0, m_blk)
    elif SOFTMAX == "fixed-offset":
        m_blk = r_m + offset
    else:
        m_blk = r_m
    return tl.maximum(m_i, m_blk), fired


@triton.jit
def _scaled_p(s_minus_m, p_scale, log2_p_scale, P_SCALED: tl.constexpr, P_SCALE_MODE: tl.constexpr):
    """P = exp(s − m) in fp32 and S·P as it is rounded by the P̄ cast (fp8 P scale S);
    s_minus_m (BLOCK_M, BLOCK_N) is the (already rounded) difference x = s − m."""
    p = tl.exp2(s_minus_m * _LOG2E)  # (BLOCK_M, BLOCK_N) fp32, unscaled
    if P_SCALED:
        if P_SCALE_MODE == "exponent-offset":  # FlashAttention-3: exp2(x·log2 e + log2 S)
            p_s = tl.exp2(s_minus_m * _LOG2E + log2_p_scale)
        else:  # FlashInfer: exp2(x·log2 e) · S
            p_s = p * p_scale
    else:
        p_s = p
    return p, p_s


@triton.jit
def _scores(q, k, scale, S_DTYPE: tl.constexpr):
    """s = cast(fp32(cast(fp32(q kᵀ) → S_DTYPE) · α) → S_DTYPE), held in fp32 (BLOCK_M, BLOCK_N).
    The scale multiplies the fp32 (or S_DTYPE-rounded) dot: K is never pre-scaled."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee").to(S_DTYPE).to(tl.float32)
    return (s * scale).to(S_DTYPE).to(tl.float32)


# ---------------------------------------------------------------------------------------------
# Forward.
# Numerics contract (a "cast → DT" is x.to(DT).to(fp32): round to nearest-even, a no-op for fp32):
#   inputs   Q, K, V in IN_DTYPE (bf16 | fp16 | fp8 | fp32), loaded as is; dots accumulate in fp32.
#   S        s = cast(fp32(cast(fp32(Q Kᵀ) → S_DTYPE) · α) → S_DTYPE), −inf where masked afterwards
#            (S_DTYPE fp32 = the hardware kernel; bf16 = the autocast reference, which rounds the
#            einsum's output and again after `* scale`).
#   shift    m per row, running over KV blocks in KV order (forward or reverse), by SOFTMAX
#            (_row_shift), then cast → STATS_DTYPE (the reference's row-max buffer dtype).
#            A row with no visible key in a block (causal, BLOCK_M > BLOCK_N) leaves m, ℓ and acc
#            unchanged, as the emulator skips it.
#   r        = exp2(cast(m_old − m → STATS_DTYPE)·log2 e), the rescale of the old ℓ and acc.
#   P        = exp2(cast(s − m → SUB_DTYPE)·log2 e) fp32, SUB_DTYPE = the dtype PyTorch gives
#            s − m (S_DTYPE if equal to STATS_DTYPE, else fp32);
#   ℓ        ← cast(fp32(ℓ·r) + fp32(rowsum(P) in L_SUM_DTYPE) → STATS_DTYPE), from the PRE-cast,
#            unscaled P (fp64: the sum is exact up to 2⁻⁵³ and rounded once, as the emulator does;
#            fp32: the hardware's tree, for speed)
#   P̄        = cast(S_p·P → P_DTYPE), RNE (saturating for fp8 on sm_90); S_p = p_scale applied by
#            P_SCALE_MODE when P_SCALED.
#   P̄V       fp32 dot with operands in DOT_PV_DTYPE (a dtype holding P̄ and V exactly), after the
#            rescale acc_r = cast(fp32(acc·r) → RESCALE_DTYPE) (bf16 = the reference's oc.mul_):
#            PV_FP32: acc ← tl.dot(P̄, V, acc_r) (the hardware accumulator continues the sum);
#            else (the autocast reference): pv = cast(P̄V → PV_DTYPE), acc ← cast(acc_r + pv → PV_DTYPE).
#   epilogue O = cast(acc / (S_p·ℓ) → O_DTYPE) (S_p = 1 unless P_SCALED), RNE.
#   LSE      = m + log(ℓ) fp32 (m, ℓ as stored: STATS_DTYPE values), natural log, unshifted domain
#            (what the backward subtracts).
#   STATS    per row int32: [ties of the row max of s (all blocks), #P̄ == S_p, stabilized fired (0/1),
#            #(S_p·P > 0 and P̄ == 0)].
# ---------------------------------------------------------------------------------------------
@triton.jit
def attn_fwd(
    Q, K, V, O, LSE, STATS,
    T, H, scale, beta, eps, offset, p_scale, log2_p_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, REVERSE: tl.constexpr, SOFTMAX: tl.constexpr,
    P_DTYPE: tl.constexpr, DOT_PV_DTYPE: tl.constexpr, PV_FP32: tl.constexpr, PV_DTYPE: tl.constexpr,
    O_DTYPE: tl.constexpr, P_SCALED: tl.constexpr, P_SCALE_MODE: tl.constexpr, L_SUM_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr, STATS_DTYPE: tl.constexpr, SUB_DTYPE: tl.constexpr, RESCALE_DTYPE: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_ok = offs_m < T
    d_ok = offs_d < D
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    n_ties = tl.zeros([BLOCK_M], tl.int32)
    n_p_one = tl.zeros([BLOCK_M], tl.int32)
    n_zeroed = tl.zeros([BLOCK_M], tl.int32)
    fired_any = tl.zeros([BLOCK_M], tl.int32)

    # -- stage 0: which KV blocks this row block sees (causal: up to the diagonal) --------------
    hi = T
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, T)
    n_blocks = tl.cdiv(hi, BLOCK_N)
    for it in range(0, n_blocks):
        j = it
        if REVERSE:
            j = n_blocks - 1 - it
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        col_ok = offs_n < T
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        # -- stage 1: s = α·QKᵀ, rounded to S_DTYPE after the dot and after × α; masked to −inf --
        s = _scores(q, k, scale, S_DTYPE)  # (BLOCK_M, BLOCK_N)
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        # -- stage 2: statistics of the exact row max (ties over all blocks) -----------------
        b_max = tl.max(s, 1)
        b_ties = tl.sum((s == b_max[:, None]).to(tl.int32), 1)
        n_ties = tl.where(b_max > row_max, b_ties, tl.where(b_max == row_max, n_ties + b_ties, n_ties))
        row_max = tl.maximum(row_max, b_max)
        seen = b_max > float("-inf")  # (BLOCK_M,) the row sees a key of this block
        # -- stage 3: shift, P, ℓ, P̄ (m and ℓ rounded to STATS_DTYPE after every update) ------
        m_new, fired = _row_shift(s, m_i, beta, eps, offset, SOFTMAX, S_DTYPE)
        m_new = m_new.to(STATS_DTYPE).to(tl.float32)
        fired_any = fired_any | fired.to(tl.int32)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        r = tl.exp2((m_i - m_sub).to(STATS_DTYPE).to(tl.float32) * _LOG2E)  # rescale of ℓ, acc
        s_minus_m = (s - m_sub[:, None]).to(SUB_DTYPE).to(tl.float32)  # (BLOCK_M, BLOCK_N)
        p, p_s = _scaled_p(s_minus_m, p_scale, log2_p_scale, P_SCALED, P_SCALE_MODE)
        l_i = (l_i * r + tl.sum(p.to(L_SUM_DTYPE), 1).to(tl.float32)).to(STATS_DTYPE).to(tl.float32)
        p_bar = p_s.to(P_DTYPE)
        p_bar32 = p_bar.to(tl.float32)
        if P_SCALED:
            n_p_one += tl.sum((p_bar32 == p_scale).to(tl.int32), 1)
        else:
            n_p_one += tl.sum((p_bar32 == 1.0).to(tl.int32), 1)
        n_zeroed += tl.sum(((p_s > 0.0) & (p_bar32 == 0.0)).to(tl.int32), 1)
        # -- stage 4: O accumulator: rescale (rounded to RESCALE_DTYPE), then add P̄V -----------
        if RESCALE_DTYPE == tl.float32:
            acc_r = acc * r[:, None]  # an unseen row has r = 1 (or acc = 0): exact, no select needed
        else:
            acc_r = tl.where(seen[:, None], (acc * r[:, None]).to(RESCALE_DTYPE).to(tl.float32), acc)
        if PV_FP32:
            acc = tl.dot(p_bar.to(DOT_PV_DTYPE), v.to(DOT_PV_DTYPE), acc_r, input_precision="ieee")
        else:
            pv = tl.dot(p_bar.to(DOT_PV_DTYPE), v.to(DOT_PV_DTYPE), input_precision="ieee")
            pv = pv.to(PV_DTYPE).to(tl.float32)
            acc = (acc_r + pv).to(PV_DTYPE).to(tl.float32)
        m_i = m_new

    # -- epilogue --------------------------------------------------------------------------
    l_safe = tl.where(row_ok, l_i, 1.0)  # padded rows (past T) have ℓ = 0 and are not stored
    if P_SCALED:
        o = acc / (p_scale * l_safe)[:, None]
    else:
        o = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], o.to(O_DTYPE), mask=out_mask)
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.log(l_safe), mask=row_ok)
    st = STATS + (bh.to(tl.int64) * T + offs_m) * 4
    tl.store(st + 0, n_ties, mask=row_ok)
    tl.store(st + 1, n_p_one, mask=row_ok)
    tl.store(st + 2, fired_any, mask=row_ok)
    tl.store(st + 3, n_zeroed, mask=row_ok)


@triton.jit
def _row_dot(a, b, acc_rows, BLOCK_M: tl.constexpr):
    """acc_rows + Σ_n a[:, n]·b[:, n] (BLOCK_M,) as ONE fp32 dot walking n in order (an ieee dot
    continues the accumulator with one rounding per term), read off the diagonal of a·bᵀ seeded
    with diag(acc_rows). Costs BLOCK_M² extra MACs per column; it buys the emulator's exact order."""
    eye = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]  # (BLOCK_M, BLOCK_M)
    seed = tl.where(eye, acc_rows[:, None], 0.0)
    full = tl.dot(a, tl.trans(b), seed, input_precision="ieee")  # (BLOCK_M, BLOCK_M) fp32
    return tl.sum(tl.where(eye, full, 0.0), 1)  # adding exact zeros: the diagonal, unchanged


@triton.jit
def _recompute_s(q, k, lse, offs_m, offs_n, T, scale, CAUSAL: tl.constexpr, S_DTYPE: tl.constexpr):
    """s as the forward forms it (_scores: S_DTYPE casts, −inf where masked) and the shift to
    subtract (lse; 0 for an empty row)."""
    s = _scores(q, k, scale, S_DTYPE)  # (BLOCK_M, BLOCK_N)
    valid = (offs_m[:, None] < T) & (offs_n[None, :] < T)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    s = tl.where(valid, s, float("-inf"))
    lse_sub = tl.where(lse == float("-inf"), 0.0, lse)
    return s, lse_sub


# ---------------------------------------------------------------------------------------------
# δ preprocess.
# Numerics contract (DELTA constexpr):
#   Every row sum below is one fp32 dot walking its index in order (_row_dot), as the emulator's
#   row_dot does: acc ← fp32(acc + a·b), one rounding per term.
#   "o"       δ = Σ_d dO·O with O as given (the stored low-precision O for "o-lowp", an all-fp32
#             forward's O for "o-highp"), both upcast to fp32.
#   "dp-p"    δ = Σ_t dP·P over keys 0..T-1 (the accumulator continues across KV blocks),
#             P = exp2(fp32(s − lse)·log2 e), s recomputed as the forward forms it (_scores:
#             rounded to S_DTYPE after the dot and after × α), dP = fp32(dO Vᵀ).
#   "o-recomputed"  O_r = P V in fp32 (P is fp32 and already holds 1/ℓ; one accumulator continued
#             over KV blocks), δ = Σ_d dO·O_r.
# dO is in IN_DTYPE (the adapter casts it), every elementwise op is fp32.
# ---------------------------------------------------------------------------------------------
@triton.jit
def attn_delta(
    O, DO, Q, K, V, LSE, DELTA,
    T, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DELTA_SOURCE: tl.constexpr, S_DTYPE: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    md = row_ok[:, None] & (offs_d[None, :] < D)
    do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
    zero_rows = tl.zeros([BLOCK_M], tl.float32)
    if DELTA_SOURCE == "o":
        o = tl.load(O + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
        delta = _row_dot(do.to(tl.float32), o.to(tl.float32), zero_rows, BLOCK_M)
    else:
        q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
        lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
        hi = T
        if CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M, T)
        delta = zero_rows
        o_r = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            nd = (offs_n[:, None] < T) & (offs_d[None, :] < D)
            k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=nd, other=0.0)
            v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=nd, other=0.0)
            s, lse_sub = _recompute_s(q, k, lse, offs_m, offs_n, T, scale, CAUSAL, S_DTYPE)
            p = tl.exp2((s - lse_sub[:, None]) * _LOG2E)  # (BLOCK_M, BLOCK_N) fp32
            if DELTA_SOURCE == "dp-p":
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
                delta = _row_dot(dp, p, delta, BLOCK_M)
            else:
                o_r = tl.dot(p, v.to(tl.float32), o_r, input_precision="ieee")
        if DELTA_SOURCE == "o-recomputed":
            delta = _row_dot(do.to(tl.float32), o_r, zero_rows, BLOCK_M)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, delta, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Backward, dK and dV of one KV block (loops over query blocks in increasing order; no atomics).
# Numerics contract:
#   s  = recomputed as the forward forms it (_scores: cast(fp32(cast(QKᵀ → S_DTYPE)·α) → S_DTYPE)),
#        −inf where masked;  P = exp2(fp32(s − lse)·log2 e) fp32 (lse natural, from the forward,
#        no S_DTYPE/STATS_DTYPE rounding of s − lse: the emulator's backward), 0 where masked.
#   dV = Σ_i P̄ᵢᵀ dOᵢ, P̄ = cast(S_p·P → P_DTYPE) (fp32 multiply by the P scale whatever its mode),
#        one fp32 accumulator continued over query blocks (operands in DOT_DV_DTYPE), then / S_p.
#   dP = fp32(dO Vᵀ);  dS = cast(P ∘ (dP − δ) → DS_DTYPE);
#   dK = α · Σ_i dSᵢᵀ Qᵢ (fp32 accumulator over query blocks, α applied once at the end).
#   dK, dV stored fp32.
# ---------------------------------------------------------------------------------------------
@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    T, scale, p_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, P_DTYPE: tl.constexpr, DOT_DV_DTYPE: tl.constexpr, P_SCALED: tl.constexpr,
    DS_DTYPE: tl.constexpr, DOT_DS_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    nd = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=nd, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=nd, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # first query block that sees this KV block
    for start_m in range(lo, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        md = row_ok[:, None] & (offs_d[None, :] < D)
        q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
        do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
        lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
        s, lse_sub = _recompute_s(q, k, lse, offs_m, offs_n, T, scale, CAUSAL, S_DTYPE)  # (BLOCK_M, BLOCK_N)
        p = tl.exp2((s - lse_sub[:, None]) * _LOG2E)
        if P_SCALED:
            p_bar = (p * p_scale).to(P_DTYPE).to(DOT_DV_DTYPE)
        else:
            p_bar = p.to(P_DTYPE).to(DOT_DV_DTYPE)
        dv = tl.dot(tl.trans(p_bar), do.to(DOT_DV_DTYPE), dv, input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = (p * (dp - delta[:, None])).to(DS_DTYPE).to(DOT_DS_DTYPE)
        dk = tl.dot(tl.trans(ds), q.to(DOT_DS_DTYPE), dk, input_precision="ieee")
    dk = dk * scale
    if P_SCALED:
        dv = dv / p_scale
    tl.store(DK + base + offs_n[:, None] * D + offs_d[None, :], dk, mask=nd)
    tl.store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv, mask=nd)


# ---------------------------------------------------------------------------------------------
# Backward, dQ of one query block (loops over KV blocks in increasing order; no atomics).
# Numerics contract: s (S_DTYPE casts), P, dP, dS exactly as in attn_bwd_dkdv;
#   dQ = α · Σ_j dSⱼ Kⱼ (one fp32 accumulator continued over KV blocks, α applied at the end), fp32.
# ---------------------------------------------------------------------------------------------
@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    T, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DS_DTYPE: tl.constexpr, DOT_DS_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    md = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=md, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, T)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nd = (offs_n[:, None] < T) & (offs_d[None, :] < D)
        k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=nd, other=0.0)
        v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=nd, other=0.0)
        s, lse_sub = _recompute_s(q, k, lse, offs_m, offs_n, T, scale, CAUSAL, S_DTYPE)
        p = tl.exp2((s - lse_sub[:, None]) * _LOG2E)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = (p * (dp - delta[:, None])).to(DS_DTYPE).to(DOT_DS_DTYPE)
        dq = tl.dot(ds, k.to(DOT_DS_DTYPE), dq, input_precision="ieee")
    dq = dq * scale
    tl.store(DQ + base + offs_m[:, None] * D + offs_d[None, :], dq, mask=md)
