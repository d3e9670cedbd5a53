"""FlashAttention-2 forward pass with explicit rounding (the emulator's numerics contract).

Inputs q, k, v (B, H, T, D) are fp32 tensors already holding values of config.input_dtype.
Rows are independent, so all rows are processed together; the loop runs over KV blocks of
block_n keys (None = one block), in forward or reverse order. Per block j, in this order:

 1. S = cast(q kᵀ, s_dtype) (mm, in_format = input_dtype) ; s = cast(fp32(S · α), s_dtype) ;
    causal: s[i, t] = -inf for t > i. (s_dtype fp32: no rounding beyond the mm's.)
    mask (SDPA's attn_mask): bool: s = -inf where False; additive: s = cast(fp32(s + mask), s_dtype).
    masked_blocks skip: rows that see no key of the block (all t > i) are skipped, as a kernel
    skips masked blocks (this is exactly a no-op for them). masked_blocks visit (the reference
    code's loop): every row visits every block; masked scores and the initial m are
    -finfo(s_dtype).max instead of -inf, so a fully masked block has row max -finfo.max, every
    entry "within ε" of it, and under the stabilized rule the shift 0 (m = max(m, 0)).
 2. m_new = cast(shift rule, stats_dtype) (softmax.py: standard / stabilized Algorithm 3 / fixed
    offset); m_use = m_new, or 0 where m_new = -inf (nothing visible yet) so that exp never sees
    -inf - -inf.
 3. alpha = exp(cast(m_prev - m_use, stats_dtype))   (0 on the first block, where m_prev = -inf)
 4. P̄ = exp(cast(s - m_use, promote(s_dtype, stats_dtype)))   fp32, the pre-cast P̄
    exp_dtype below fp32 (CPU autocast): alpha and P̄ rounded to it after exp, and in step 5
    ℓ = cast(cast(alpha · ℓ) + cast(rowsum(P̄)), exp_dtype), every term rounded (no fused pass)
 5. ℓ = cast(fp32(fp32(alpha · ℓ) + max(rowsum(P̄), row_sum_floor)), stats_dtype)   rowsum of
    the pre-cast, unscaled fp32 P̄, summed exactly and rounded once (the kernel's tree order is not
    modelled), clamped from below at row_sum_floor (0: no clamp)
 6. P scale S (if ≠ 1): exponent-offset: P̄_S = exp(fp32(fp32(s - m_use) + ln S));
    multiply: P̄_S = fp32(P̄ · S)
 7. P̄_c = cast(P̄_S, p_dtype, rounding)        (fp8 e4m3 saturates at ±448)
 8. acc_r = cast(fp32(alpha · acc), rescale_dtype)   (fp32: no rounding)
    pv_dtype fp32 (hardware accumulator): acc = mm(P̄_c, V_j, acc=acc_r)
    pv_dtype lower (autocast reference code): acc = cast(fp32(acc_r + cast(mm(P̄_c, V_j))))
    i.e. rounded after the block product and after the rescale-and-add; in_format = wider(p, input)
Epilogue: O = cast(fp32(acc / fp32(S · ℓ)), o_dtype, rounding); lse = fp32(m_use + fp32(log ℓ)).
A row whose mask allows no key has ℓ = 0: its O is 0 and its lse -inf (as SDPA on the CPU: O = 0,
gradients 0).

`rounding` (nearest-even or seeded stochastic) governs the P̄ cast, the P̄V casts (the rescaled
accumulator's included) and the O cast; the S, m and ℓ casts round to nearest-even. Every exp is
`numerics.exp_fp32` (exp rounded once to fp32), so the bits do not depend on the host's vector exp.

Kernel models (config.exp_form, row_sum, normalize, kv_splits; emulate/kernel_ops.py, split_kv.py):
exp_form exp2-*: the running max m is that of the raw scores S = q kᵀ, P̄ and the rescale are base-2
exponentials of S·c (c = fp32(α·log2 e)) as kernel_ops.exp2_block says (exp2-scaled-twice: of fp32(fp32(S·α)·
log2 e)), and the lse as kernel_ops.kernel_lse forms it;
row_sum mma-lanes: ℓ is four per-thread partials carried across blocks and reduced in the epilogue;
row_sum lanes-fma: the same partials, each block's per-thread sum fused into the rescale, fma(α, ℓ_q, s_q), and
reduced in neighbouring pairs (kernel_ops.fold_lane_sums, reduce_lane_pairs);
row_sum cutlass-warps: each block's P̄ is summed per thread, per quad and per 32-key warp tile, and the tiles'
sums are added to fp32(α·ℓ) in key order (kernel_ops.warp_row_sums);
normalize reciprocal: O = fp32(acc · fp32(1/ℓ)); kv_splits > 1: FlashAttention-2's split-KV forward
and combine (split_kv.py). These run on the torch path only.

Steps 1-7 run as one compiled pass per row (`fused.ForwardBlock`) where `fused.eligible` says so
(the same operations, bit for bit); the torch code below is the reference and the fallback.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.numerics import exp_fp32
from fa_forensics.replay.config import (
    ExpForm, KVOrder, MaskedBlocks, Normalize, Precision, PScaleMode, ReplayConfig, RowSum,
)
from fa_forensics.replay.emulate import fused, kernel_ops, split_kv
from fa_forensics.replay.emulate.ops import Band, cast, finfo_max, mm, promote, wider
from fa_forensics.replay.emulate.softmax import block_shift
from fa_forensics.replay.out import PBarStats

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Forward:
    """Forward results: O (fp32 holding o_dtype values), lse and the P̄ statistics."""

    o: torch.Tensor  # (B, H, T, D) fp32 values of o_dtype
    lse: torch.Tensor  # (B, H, T) fp32
    stats: PBarStats


def kv_blocks(n_keys: int, block_n: Optional[int], order: KVOrder,
              keys: Optional[tuple[int, int]] = None) -> list[tuple[int, int]]:
    """[start, stop) of each KV block in the order the kernel visits them (within `keys`, default all)."""
    lo, hi = keys if keys is not None else (0, n_keys)
    size = block_n or max(hi - lo, 1)
    blocks = [(j0, min(j0 + size, hi)) for j0 in range(lo, hi, size)]
    return blocks[::-1] if order is KVOrder.REVERSE else blocks


def raw_scores(q: torch.Tensor, k: torch.Tensor, config: ReplayConfig, causal: bool, row0: int, col0: int,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S = q kᵀ (the MMA's fp32 output, unscaled) with masked scores −inf: the exp2 kernels' scores.
    An additive mask is added to S·α's equivalent, S + mask/α, in fp32."""
    S = mm(q, k.transpose(-1, -2), config.accumulation, config.gpu, config.input_dtype,
           mma_k=config.mma_k)
    if causal:
        rows = torch.arange(row0, row0 + q.shape[-2]).unsqueeze(-1)
        cols = torch.arange(col0, col0 + k.shape[-2]).unsqueeze(0)
        S = S.masked_fill(cols > rows, _NEG_INF)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ConfigError("the exp2 kernel models (exp_form exp2-fma / exp2-mul) take a boolean attn_mask, not an "
                              "additive one; replay this layer with exp_form exp")
        S = S.masked_fill(~mask, _NEG_INF)
    return S


def scaled_scores(q: torch.Tensor, k: torch.Tensor, config: ReplayConfig, scale: float,
                  causal: bool, row0: int, col0: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s = cast(α · cast(q kᵀ, s_dtype), s_dtype) with the causal mask (-inf); q rows start at
    row0, k rows at col0. mask: the attn_mask block of these rows and keys (bool or additive)."""
    S = mm(q, k.transpose(-1, -2), config.accumulation, config.gpu, config.input_dtype,
           mma_k=config.mma_k)  # (B, H, R, N)
    S = cast(S, config.s_dtype)  # the autocast matmul's output dtype
    s = cast(S * torch.tensor(scale, dtype=torch.float32), config.s_dtype)
    if causal:
        rows = torch.arange(row0, row0 + q.shape[-2]).unsqueeze(-1)
        cols = torch.arange(col0, col0 + k.shape[-2]).unsqueeze(0)
        s = s.masked_fill(cols > rows, _NEG_INF)
    if mask is not None:
        s = s.masked_fill(~mask, _NEG_INF) if mask.dtype == torch.bool else cast(s + mask.float(), config.s_dtype)
    return s


@dataclass(frozen=True)
class BlockCast:
    """What one KV block did to rows row0 + r0 onward (given to `forward`'s observer).

    keys [j0, j1); alpha (B, H, R, 1) the rescale of the running ℓ and O; p_scaled (B, H, R, N)
    the pre-cast P̄·S (P̄ when S = 1); p_cast (B, H, R, N) after the P̄ cast; visible (B, H, R, N).
    """

    r0: int
    j0: int
    j1: int
    alpha: torch.Tensor
    p_scaled: torch.Tensor
    p_cast: torch.Tensor
    visible: torch.Tensor


class _RowMaxTracker:
    """Running fp32 row maximum of s over all blocks and how many times it is attained."""

    def __init__(self, shape: torch.Size):
        self.max = torch.full(shape, _NEG_INF)  # (B, H, T)
        self.count = torch.zeros(shape, dtype=torch.int64)

    def update(self, s: torch.Tensor, row0: int) -> None:
        b_max = s.amax(dim=-1)  # (B, H, R)
        b_count = (s == b_max.unsqueeze(-1)).sum(dim=-1)
        b_count = torch.where(torch.isinf(b_max) & (b_max < 0), torch.zeros_like(b_count), b_count)
        old_max, old_count = self.max[..., row0:], self.count[..., row0:]
        new_count = torch.where(b_max > old_max, b_count, torch.where(b_max == old_max, old_count + b_count, old_count))
        self.count[..., row0:] = new_count
        self.max[..., row0:] = torch.maximum(old_max, b_max)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig, *,
            causal: bool, scale: float, generator: Optional[torch.Generator], row0: int = 0,
            mask: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None,
            observe: Optional[Callable[[BlockCast], None]] = None, keys: Optional[tuple[int, int]] = None,
            split_part: bool = False) -> Forward:
    """Run the FA2 forward of the module docstring; q (B, H, T, D), k, v (B, H, N, D) fp32
    input_dtype values. q may be a block of query rows starting at row `row0` (rows are
    independent: a block's results are bit for bit those rows of the whole). mask: SDPA's
    attn_mask for these rows, broadcastable to (B, H, T, N), or None.
    scores: given scaled scores s (B, H, T, N) fp32 (-inf = masked) used instead of step 1 (q and
    k are then ignored; pass None): a study of the softmax and P̄ cast on synthetic scores.
    observe: called with every block's BlockCast (what the P̄ cast did), in visiting order.
    keys, split_part: one split of the split-KV forward (its keys; O left fp32, lse in the split form)."""
    if config.kv_splits > 1 and not split_part:
        return _forward_split_kv(q, k, v, config, causal=causal, scale=scale, generator=generator, row0=row0,
                                 mask=mask, scores=scores, observe=observe)
    if scores is not None:
        (B, H, T), D, n_keys = scores.shape[:3], v.shape[-1], scores.shape[-1]
    else:
        (B, H, T, D), n_keys = q.shape, k.shape[-2]
    if mask is not None:
        mask = mask.expand(B, H, T, n_keys)
    S_scale = float(config.p_scale)
    ln_S = torch.tensor(math.log(S_scale), dtype=torch.float32)
    S_t = torch.tensor(S_scale, dtype=torch.float32)
    pv_format = wider(config.p_dtype, config.input_dtype)
    sub_dtype = promote(config.s_dtype, config.stats_dtype)  # dtype of s − m

    visit = config.masked_blocks is MaskedBlocks.VISIT
    mask_value = -finfo_max(config.s_dtype) if visit else _NEG_INF  # masked scores and the initial m
    row_sum_floor = torch.tensor(config.row_sum_floor, dtype=torch.float32)
    m = torch.full((B, H, T), mask_value)  # running shift m_i
    lanes = config.row_sum in (RowSum.MMA_LANES, RowSum.LANES_FMA)
    l = torch.zeros((B, H, T, kernel_ops.LANES) if lanes else (B, H, T))  # running ℓ_i (per-thread partials)
    base2 = config.exp_form is not ExpForm.EXP
    c_log2 = kernel_ops.scale_log2(scale)
    scale_f = torch.tensor(scale, dtype=torch.float32)
    acc = torch.zeros((B, H, T, D))  # running unnormalized O (pv_dtype values)
    tracker = _RowMaxTracker(m.shape)
    p_one = torch.zeros((B, H), dtype=torch.int64)
    p_zeroed = torch.zeros((B, H), dtype=torch.int64)
    fired_any = torch.zeros((B, H, T), dtype=torch.bool)

    fused_block = None
    low_exp = config.exp_dtype is not Precision.FP32
    if (scores is None and observe is None and not low_exp and not config.is_kernel_model
            and fused.eligible(config, q, k, v, scale=scale, mask=mask)):
        fused_block = fused.ForwardBlock(config, scale, mask_value, m.shape)
    for j0, j1 in kv_blocks(n_keys, config.block_n, config.kv_order, keys):
        r0 = max(j0 - row0, 0) if causal and not visit else 0  # rows before j0 see nothing of this block
        if r0 >= T:
            continue
        mask_block = None if mask is None else mask[..., r0:, j0:j1]
        if fused_block is not None:  # steps 1-7 compiled: the same operations, one pass per row
            sees = row0 + r0 - j0 + 1 if causal and not visit else None  # row i sees keys j < i + sees
            S = mm(q[..., r0:, :], k[..., j0:j1, :].transpose(-1, -2), config.accumulation, config.gpu,
                   config.input_dtype, band=Band(n_hi=sees), finite_operands=True)
            p, p_bar, alpha = fused_block.run(S, mask_block, row0=row0, j0=j0, causal=causal, m=m, r0=r0,
                                              tracker_max=tracker.max, tracker_count=tracker.count, fired=fired_any)
            row_sum = p.double().sum(dim=-1).float()  # (B, H, R)
            if config.row_sum_floor > 0:
                row_sum = torch.maximum(row_sum, row_sum_floor)
            l[..., r0:] = cast(alpha.squeeze(-1) * l[..., r0:] + row_sum, config.stats_dtype)
        elif base2:  # the exp2 kernels: max of raw S, P̄ and the rescale as kernel_ops.exp2_block
            S_raw = raw_scores(q[..., r0:, :], k[..., j0:j1, :], config, causal, row0 + r0, j0, mask_block)
            tracker.update(S_raw, r0)
            visible = ~torch.isneginf(S_raw)
            m_prev = m[..., r0:]
            m_new = torch.maximum(m_prev, S_raw.amax(dim=-1))
            m_use = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha, p = kernel_ops.exp2_block(S_raw, m_prev, m_use, c_log2, scale_f, config.exp_form,
                                             config.exp_unit)
            _add_row_sum(l, r0, alpha, p, config)
            p_bar = cast(p, config.p_dtype, config.rounding, generator)
            p_one += ((p_bar == 1.0) & visible).sum(dim=(-1, -2))
            p_zeroed += ((p > 0) & (p_bar == 0) & visible).sum(dim=(-1, -2))
            if observe is not None:
                observe(BlockCast(r0=r0, j0=j0, j1=j1, alpha=alpha, p_scaled=p, p_cast=p_bar, visible=visible))
        else:
            if scores is not None:
                s = scores[..., r0:, j0:j1]  # (B, H, R, N)
            else:
                s = scaled_scores(q[..., r0:, :], k[..., j0:j1, :], config, scale, causal, row0 + r0, j0, mask_block)
            tracker.update(s, r0)
            visible = ~torch.isneginf(s)  # (B, H, R, N)
            sees_key = visible.any(dim=-1)  # (B, H, R)
            if visit:
                s = s.masked_fill(~visible, mask_value)
            m_prev = m[..., r0:]
            shift = block_shift(m_prev, s, config)
            fired_any[..., r0:] |= shift.fired & sees_key
            m_new = cast(shift.m, config.stats_dtype)  # (B, H, R)
            m_use = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)  # (B, H, R)
            alpha = exp_fp32(cast(m_prev - m_use, config.stats_dtype)).unsqueeze(-1)  # (B, H, R, 1)
            s_minus_m = cast(s - m_use.unsqueeze(-1), sub_dtype)  # (B, H, R, N)
            p = exp_fp32(s_minus_m)  # pre-cast fp32 P̄
            if low_exp:
                alpha, p = cast(alpha, config.exp_dtype), cast(p, config.exp_dtype)
            if config.row_sum is not RowSum.EXACT:
                _add_row_sum(l, r0, alpha, p, config)
            else:
                row_sum = p.double().sum(dim=-1).float()  # (B, H, R)
                if low_exp:
                    row_sum = cast(row_sum, config.exp_dtype)
                if config.row_sum_floor > 0:
                    row_sum = torch.maximum(row_sum, row_sum_floor)
                l_new = alpha.squeeze(-1) * l[..., r0:]
                l_new = cast(l_new, config.exp_dtype) + row_sum if low_exp else l_new + row_sum
                l[..., r0:] = cast(l_new, config.stats_dtype)
            if S_scale == 1.0:
                p_scaled = p
            elif config.p_scale_mode is PScaleMode.EXPONENT_OFFSET:
                p_scaled = exp_fp32(s_minus_m + ln_S)
            else:
                p_scaled = p * S_t
            p_bar = cast(p_scaled, config.p_dtype, config.rounding, generator)  # (B, H, R, N)
            p_one += ((p_bar == S_t) & visible).sum(dim=(-1, -2))
            p_zeroed += ((p_scaled > 0) & (p_bar == 0) & visible).sum(dim=(-1, -2))
            if observe is not None:
                observe(BlockCast(r0=r0, j0=j0, j1=j1, alpha=alpha, p_scaled=p_scaled, p_cast=p_bar, visible=visible))
        acc_scaled = cast(alpha * acc[..., r0:, :], config.rescale_dtype, config.rounding, generator)  # (B, H, R, D)
        v_j = v[..., j0:j1, :]
        compiled = fused_block is not None
        pv_band = Band(k_hi=sees) if compiled else None  # P̄ of a key the row cannot see is 0
        finite = compiled and fused.p_bar_bounded(config)
        if config.pv_dtype is Precision.FP32:
            acc[..., r0:, :] = mm(p_bar, v_j, config.accumulation, config.gpu, pv_format, acc=acc_scaled, band=pv_band,
                                  finite_operands=finite, mma_k=config.mma_k)
        else:
            pv = cast(mm(p_bar, v_j, config.accumulation, config.gpu, pv_format, band=pv_band, finite_operands=finite,
                         mma_k=config.mma_k),
                      config.pv_dtype, config.rounding, generator)
            acc[..., r0:, :] = cast(acc_scaled + pv, config.pv_dtype, config.rounding, generator)
        if fused_block is None:
            m[..., r0:] = m_new

    m_use = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    if config.row_sum is RowSum.LANES_FMA:
        l = kernel_ops.reduce_lane_pairs(l)
    elif lanes:
        l = kernel_ops.reduce_lanes(l)
    if config.normalize is Normalize.RECIPROCAL:
        o32 = acc * kernel_ops.reciprocal(l).unsqueeze(-1)
    else:
        o32 = acc / (S_t * l).unsqueeze(-1)
    if mask is not None or split_part:
        o32 = torch.where((l == 0).unsqueeze(-1), torch.zeros_like(o32), o32)  # rows with no allowed key
    if base2:
        lse = kernel_ops.kernel_lse(m_use, l, scale_f, c_log2, config.exp_form, config.lse_form,
                                    config.exp_unit)
    else:
        lse = m_use + torch.log(l)
    if split_part:
        lse = torch.where(l == 0, torch.full_like(lse, _NEG_INF), lse)
    o = o32 if split_part else cast(o32, config.o_dtype, config.rounding, generator)
    stats = PBarStats(
        repeated_max_rows=(tracker.count > 1).sum(dim=-1),
        p_one_count=p_one if fused_block is None else fused_block.p_one.sum(dim=-1),
        stabilized_rows=fired_any.sum(dim=-1),
        p_zeroed=p_zeroed if fused_block is None else fused_block.p_zeroed.sum(dim=-1),
        rows=torch.full((B, H), T, dtype=torch.int64),
    )
    return Forward(o=o, lse=lse, stats=stats)


def _add_row_sum(l: torch.Tensor, r0: int, alpha: torch.Tensor, p: torch.Tensor, config: ReplayConfig) -> None:
    """ℓ of rows r0.. after one block (in place): exact (fp32(fp32(α·ℓ) + ΣP̄)), per-thread partials (mma-lanes;
    lanes-fma: the block's per-thread sums fused into the rescale) or the memory-efficient kernel's threads, quads
    and warp tiles (cutlass-warps)."""
    if config.row_sum is RowSum.MMA_LANES:
        l[..., r0:, :] = kernel_ops.lane_row_sums(p, l[..., r0:, :] * alpha)
    elif config.row_sum is RowSum.LANES_FMA:
        l[..., r0:, :] = kernel_ops.fold_lane_sums(l[..., r0:, :], alpha, kernel_ops.lane_block_sums(p))
    elif config.row_sum is RowSum.CUTLASS_WARPS:
        l[..., r0:] = kernel_ops.warp_row_sums(p, alpha.squeeze(-1) * l[..., r0:])
    else:
        l[..., r0:] = alpha.squeeze(-1) * l[..., r0:] + p.double().sum(dim=-1).float()


def _forward_split_kv(q, k, v, config: ReplayConfig, *, causal: bool, scale: float, generator, row0: int,
                      mask, scores, observe) -> Forward:
    """FlashAttention-2's split-KV forward: every split's fp32 O and lse (`forward` over its keys), then the
    combine kernel (split_kv.combine) and one cast to o_dtype. P̄ statistics add up over the splits (repeated
    maxima are counted within each split)."""
    n_keys = (scores if scores is not None else k).shape[-2]

    def run(keys):
        part = forward(q, k, v, config, causal=causal, scale=scale, generator=generator, row0=row0, mask=mask,
                       scores=scores, observe=observe, keys=keys, split_part=True)
        return part.o, part.lse, part.stats

    unit = kernel_ops.unit_functions(config.exp_unit)
    o32, lse, stats = split_kv.forward_splits(run, n_keys, config.block_n, config.kv_splits, v.shape[-1], unit.exp,
                                              unit.log)
    total = PBarStats(
        repeated_max_rows=torch.stack([s.repeated_max_rows for s in stats]).amax(dim=0),
        p_one_count=sum(s.p_one_count for s in stats),
        stabilized_rows=sum(s.stabilized_rows for s in stats),
        p_zeroed=sum(s.p_zeroed for s in stats),
        rows=stats[0].rows,
    )
    return Forward(o=cast(o32, config.o_dtype, config.rounding, generator), lse=lse, stats=total)
