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

The code follows these steps: `forward` sets up the running state (`_start`) and, per KV block, runs steps 1-7
on one of three paths (`_exp_block`: the torch reference, one function per step: `_block_scores` 1,
`_shift` 2, 3-4 inline, `_exact_row_sum` 5, `_apply_p_scale` 6, `_cast_p_bar` 7; `_exp2_block`: the exp2
kernel models; `_compiled_block`: the compiled pass), then step 8 (`_accumulate_pv`); `_epilogue` last.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.numerics import exp_fp32
from fa_forensics.replay.config import (
    ExpForm, KVOrder, MaskedBlocks, Normalize, Precision, PScaleMode, ReplayConfig, RowSum,
)
from fa_forensics.replay.emulate import fused, kernel_ops, softcap, split_kv
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
               mask: Optional[torch.Tensor] = None, scale: float = 1.0) -> torch.Tensor:
    """S = q kᵀ (the MMA's fp32 output, unscaled) with masked scores −inf: the exp2 kernels' scores.
    An additive mask (a bias such as ALiBi) goes where each kernel adds it: FlashAttention-2's forms
    (exp2-fma, exp2-mul) add it to the raw scores divided by the softmax scale, as they apply their ALiBi
    slopes: S = fp32(S + fp32(mask / α)); the exp2-scaled forms (the memory-efficient kernel, cuDNN) add it
    to the scaled scores, S = fp32(fp32(S·α) + mask), and then scale by 1 (`exp2_scale` says which)."""
    S = mm(q, k.transpose(-1, -2), config.accumulation, config.gpu, config.input_dtype,
           mma_k=config.mma_k)
    if config.softcap is not None:
        S = softcap.capped_raw(S, scale, config.softcap)
        scale = config.softcap  # the softmax reads cap where it read α
    if causal:
        rows = torch.arange(row0, row0 + q.shape[-2]).unsqueeze(-1)
        cols = torch.arange(col0, col0 + k.shape[-2]).unsqueeze(0)
        S = S.masked_fill(cols > rows, _NEG_INF)
    if mask is not None:
        if mask.dtype == torch.bool:
            S = S.masked_fill(~mask, _NEG_INF)
        elif _bias_prescaled(config):
            S = S * torch.tensor(scale, dtype=torch.float32) + mask.float()
        else:
            S = S + mask.float() / torch.tensor(scale, dtype=torch.float32)
    return S


def _bias_prescaled(config: ReplayConfig) -> bool:
    """An additive mask is added to the scaled scores, which are then scaled by 1 (the exp2-scaled forms)."""
    return config.softcap is None and config.exp_form in (ExpForm.EXP2_SCALED, ExpForm.EXP2_SCALED_TWICE)


def exp2_scale(config: ReplayConfig, scale: float, mask: Optional[torch.Tensor]) -> float:
    """The softmax scale the exp2 kernel models apply to `raw_scores`: the soft-cap where there is one (the
    capped scores are tanh(·), the cap reads as α), 1 where an additive mask was added to scaled scores, else α."""
    if config.softcap is not None:
        return config.softcap
    if mask is not None and mask.is_floating_point() and _bias_prescaled(config):
        return 1.0
    return scale


def scaled_scores(q: torch.Tensor, k: torch.Tensor, config: ReplayConfig, scale: float,
                  causal: bool, row0: int, col0: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s = cast(α · cast(q kᵀ, s_dtype), s_dtype), soft-capped where config.softcap says (softcap.capped), with the
    causal mask (-inf); q rows start at row0, k rows at col0. mask: the attn_mask block of these rows and keys
    (bool or additive)."""
    S = mm(q, k.transpose(-1, -2), config.accumulation, config.gpu, config.input_dtype,
           mma_k=config.mma_k)  # (B, H, R, N)
    S = cast(S, config.s_dtype)  # the autocast matmul's output dtype
    s = cast(S * torch.tensor(scale, dtype=torch.float32), config.s_dtype)
    if config.softcap is not None:
        s = softcap.capped(s, config.softcap, config.s_dtype)
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


@dataclass
class _ForwardState:
    """One forward call: its inputs, the constants the steps share, and the running per-row state
    (m, ℓ, the accumulator, the P̄ statistics) that each KV block updates in place."""

    q: Optional[torch.Tensor]
    k: Optional[torch.Tensor]
    v: torch.Tensor
    config: ReplayConfig
    causal: bool
    scale: float
    generator: Optional[torch.Generator]
    row0: int
    mask: Optional[torch.Tensor]  # (B, H, T, N) or None
    scores: Optional[torch.Tensor]
    observe: Optional[Callable[[BlockCast], None]]
    n_keys: int
    visit: bool  # masked_blocks visit: every row visits every block
    mask_value: float  # masked scores and the initial m
    m: torch.Tensor  # (B, H, T) running shift m_i
    l: torch.Tensor  # (B, H, T) running ℓ_i, or (B, H, T, LANES) per-thread partials
    acc: torch.Tensor  # (B, H, T, D) running unnormalized O (pv_dtype values)
    tracker: _RowMaxTracker
    p_one: torch.Tensor  # (B, H)
    p_zeroed: torch.Tensor  # (B, H)
    fired: torch.Tensor  # (B, H, T) the stabilized rule fired on a row that sees a key
    compiled: Optional[fused.ForwardBlock]  # steps 1-7 compiled, when fused.eligible

    @property
    def rows(self) -> int:
        return self.m.shape[-1]

    @property
    def base2(self) -> bool:
        return self.config.exp_form is not ExpForm.EXP

    @property
    def low_exp(self) -> bool:
        return self.config.exp_dtype is not Precision.FP32

    @property
    def lanes(self) -> bool:
        return self.config.row_sum in (RowSum.MMA_LANES, RowSum.LANES_FMA)

    @property
    def p_scale(self) -> torch.Tensor:
        return torch.tensor(float(self.config.p_scale), dtype=torch.float32)


@dataclass(frozen=True)
class _Block:
    """What steps 1-7 of one KV block hand to step 8: rows r0.. and keys [j0, j1), the rescale alpha
    (B, H, R, 1), the cast P̄ (B, H, R, N), the new shift (None where the compiled stage stored it) and the
    causal band of the compiled path (row i sees keys j < i + sees; None: no band)."""

    r0: int
    j0: int
    j1: int
    alpha: torch.Tensor
    p_bar: torch.Tensor
    m_new: Optional[torch.Tensor]
    sees: Optional[int] = None


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
    if config.plain is not None and scores is None:  # attention written in torch ops (replay/eager.py)
        from fa_forensics.replay.eager import plain_forward

        fwd = plain_forward(q, k, v, config, causal=causal, scale=scale, mask=mask, row0=row0)
        return Forward(o=fwd.o, lse=fwd.lse, stats=fwd.stats)
    if config.kv_splits > 1 and not split_part:
        return _forward_split_kv(q, k, v, config, causal=causal, scale=scale, generator=generator, row0=row0,
                                 mask=mask, scores=scores, observe=observe)
    st = _start(q, k, v, config, causal=causal, scale=scale, generator=generator, row0=row0, mask=mask,
                scores=scores, observe=observe)
    for j0, j1 in kv_blocks(st.n_keys, config.block_n, config.kv_order, keys):
        r0 = max(j0 - row0, 0) if causal and not st.visit else 0  # rows before j0 see nothing of this block
        if r0 >= st.rows:
            continue  # masked_blocks skip: no row of this call sees a key of the block
        if st.compiled is not None:
            block = _compiled_block(st, j0, j1, r0)
        elif st.base2:
            block = _exp2_block(st, j0, j1, r0)
        else:
            block = _exp_block(st, j0, j1, r0)
        _accumulate_pv(st, block)
    return _epilogue(st, split_part)


def _start(q, k, v, config: ReplayConfig, *, causal: bool, scale: float, generator, row0: int, mask, scores,
           observe) -> _ForwardState:
    """The state before the first block: m = mask_value (-inf, or -finfo.max when visiting), ℓ = 0, acc = 0;
    the compiled stage where `fused.eligible` says the inputs allow it."""
    if scores is not None:
        (B, H, T), D, n_keys = scores.shape[:3], v.shape[-1], scores.shape[-1]
    else:
        (B, H, T, D), n_keys = q.shape, k.shape[-2]
    if mask is not None:
        mask = mask.expand(B, H, T, n_keys)
    visit = config.masked_blocks is MaskedBlocks.VISIT
    mask_value = -finfo_max(config.s_dtype) if visit else _NEG_INF
    lanes = config.row_sum in (RowSum.MMA_LANES, RowSum.LANES_FMA)
    compiled = None
    if (scores is None and observe is None and config.exp_dtype is Precision.FP32 and not config.is_kernel_model
            and fused.eligible(config, q, k, v, scale=scale, mask=mask)):
        compiled = fused.ForwardBlock(config, scale, mask_value, torch.Size((B, H, T)))
    return _ForwardState(
        q=q, k=k, v=v, config=config, causal=causal, scale=scale, generator=generator, row0=row0, mask=mask,
        scores=scores, observe=observe, n_keys=n_keys, visit=visit, mask_value=mask_value,
        m=torch.full((B, H, T), mask_value),
        l=torch.zeros((B, H, T, kernel_ops.LANES) if lanes else (B, H, T)),
        acc=torch.zeros((B, H, T, D)), tracker=_RowMaxTracker(torch.Size((B, H, T))),
        p_one=torch.zeros((B, H), dtype=torch.int64), p_zeroed=torch.zeros((B, H), dtype=torch.int64),
        fired=torch.zeros((B, H, T), dtype=torch.bool), compiled=compiled)


def _mask_block(st: _ForwardState, j0: int, j1: int, r0: int) -> Optional[torch.Tensor]:
    """The attn_mask of rows r0.. and keys [j0, j1), or None."""
    return None if st.mask is None else st.mask[..., r0:, j0:j1]


def _compiled_block(st: _ForwardState, j0: int, j1: int, r0: int) -> _Block:
    """Steps 1-7 as one compiled pass per row (`fused.ForwardBlock`: the same operations, bit for bit), then
    step 5's ℓ update on the pre-cast P̄ it returns. The product S = q kᵀ skips the causally hidden keys."""
    config = st.config
    sees = st.row0 + r0 - j0 + 1 if st.causal and not st.visit else None  # row i sees keys j < i + sees
    S = mm(st.q[..., r0:, :], st.k[..., j0:j1, :].transpose(-1, -2), config.accumulation, config.gpu,
           config.input_dtype, band=Band(n_hi=sees), finite_operands=True)
    p, p_bar, alpha = st.compiled.run(S, _mask_block(st, j0, j1, r0), row0=st.row0, j0=j0, causal=st.causal,
                                      m=st.m, r0=r0, tracker_max=st.tracker.max,
                                      tracker_count=st.tracker.count, fired=st.fired)
    _exact_row_sum(st, r0, alpha, p)
    return _Block(r0=r0, j0=j0, j1=j1, alpha=alpha, p_bar=p_bar, m_new=None, sees=sees)


def _exp2_block(st: _ForwardState, j0: int, j1: int, r0: int) -> _Block:
    """Steps 1-7 of the exp2 kernels: the running max of the raw scores S, P̄ and the rescale as
    `kernel_ops.exp2_block` forms them, ℓ per the row_sum model, P̄ cast (no P scale)."""
    config = st.config
    S_raw = raw_scores(st.q[..., r0:, :], st.k[..., j0:j1, :], config, st.causal, st.row0 + r0, j0,
                       _mask_block(st, j0, j1, r0), scale=st.scale)
    st.tracker.update(S_raw, r0)
    m_prev = st.m[..., r0:]
    m_new = torch.maximum(m_prev, S_raw.amax(dim=-1))
    alpha_eff = exp2_scale(config, st.scale, st.mask)
    alpha, p = kernel_ops.exp2_block(S_raw, m_prev, _shift_in_use(m_new), kernel_ops.scale_log2(alpha_eff),
                                     torch.tensor(alpha_eff, dtype=torch.float32), config.exp_form, config.exp_unit)
    _add_row_sum(st.l, r0, alpha, p, config)
    p_bar = _cast_p_bar(st, r0, j0, j1, alpha, p, ~torch.isneginf(S_raw), one=torch.tensor(1.0))
    return _Block(r0=r0, j0=j0, j1=j1, alpha=alpha, p_bar=p_bar, m_new=m_new)


def _exp_block(st: _ForwardState, j0: int, j1: int, r0: int) -> _Block:
    """Steps 1-7 of the module docstring in torch: the specification of the reference path."""
    config = st.config
    s = _block_scores(st, j0, j1, r0)  # step 1
    st.tracker.update(s, r0)
    visible = ~torch.isneginf(s)  # (B, H, R, N)
    if st.visit:
        s = s.masked_fill(~visible, st.mask_value)
    m_prev = st.m[..., r0:]
    m_new = _shift(st, r0, m_prev, s, visible.any(dim=-1))  # step 2
    m_use = _shift_in_use(m_new)
    alpha = exp_fp32(cast(m_prev - m_use, config.stats_dtype)).unsqueeze(-1)  # step 3, (B, H, R, 1)
    s_minus_m = cast(s - m_use.unsqueeze(-1), promote(config.s_dtype, config.stats_dtype))  # (B, H, R, N)
    p = exp_fp32(s_minus_m)  # step 4: the pre-cast fp32 P̄
    if st.low_exp:
        alpha, p = cast(alpha, config.exp_dtype), cast(p, config.exp_dtype)
    if config.row_sum is RowSum.EXACT:  # step 5
        _exact_row_sum(st, r0, alpha, p)
    else:
        _add_row_sum(st.l, r0, alpha, p, config)
    p_scaled = _apply_p_scale(st, p, s_minus_m)  # step 6
    p_bar = _cast_p_bar(st, r0, j0, j1, alpha, p_scaled, visible, one=st.p_scale)  # step 7
    return _Block(r0=r0, j0=j0, j1=j1, alpha=alpha, p_bar=p_bar, m_new=m_new)


def _block_scores(st: _ForwardState, j0: int, j1: int, r0: int) -> torch.Tensor:
    """Step 1: the scaled, masked scores s (B, H, R, N) of rows r0.. and keys [j0, j1) (given, or formed)."""
    if st.scores is not None:
        return st.scores[..., r0:, j0:j1]
    return scaled_scores(st.q[..., r0:, :], st.k[..., j0:j1, :], st.config, st.scale, st.causal, st.row0 + r0, j0,
                         _mask_block(st, j0, j1, r0))


def _shift(st: _ForwardState, r0: int, m_prev: torch.Tensor, s: torch.Tensor, sees_key: torch.Tensor) -> torch.Tensor:
    """Step 2: m_new = cast(shift rule, stats_dtype) (softmax.block_shift); records the rows where the
    stabilized rule fired."""
    shift = block_shift(m_prev, s, st.config)
    st.fired[..., r0:] |= shift.fired & sees_key
    return cast(shift.m, st.config.stats_dtype)  # (B, H, R)


def _shift_in_use(m_new: torch.Tensor) -> torch.Tensor:
    """m_use: m_new, or 0 where it is -inf (nothing visible yet) so that exp never sees -inf - -inf."""
    return torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)


def _exact_row_sum(st: _ForwardState, r0: int, alpha: torch.Tensor, p: torch.Tensor) -> None:
    """Step 5 (row_sum exact): ℓ = cast(fp32(fp32(α·ℓ) + max(ΣP̄, floor)), stats_dtype), ΣP̄ summed exactly
    and rounded once; exp_dtype below fp32: ΣP̄ and α·ℓ rounded to it first."""
    config = st.config
    row_sum = p.double().sum(dim=-1).float()  # (B, H, R)
    if st.low_exp:
        row_sum = cast(row_sum, config.exp_dtype)
    if config.row_sum_floor > 0:
        row_sum = torch.maximum(row_sum, torch.tensor(config.row_sum_floor, dtype=torch.float32))
    l_new = alpha.squeeze(-1) * st.l[..., r0:]
    l_new = cast(l_new, config.exp_dtype) + row_sum if st.low_exp else l_new + row_sum
    st.l[..., r0:] = cast(l_new, config.stats_dtype)


def _apply_p_scale(st: _ForwardState, p: torch.Tensor, s_minus_m: torch.Tensor) -> torch.Tensor:
    """Step 6: P̄·S, by an exponent offset exp(fp32(s − m) + ln S) or a multiply (P̄ itself when S = 1)."""
    config = st.config
    if float(config.p_scale) == 1.0:
        return p
    if config.p_scale_mode is PScaleMode.EXPONENT_OFFSET:
        return exp_fp32(s_minus_m + torch.tensor(math.log(float(config.p_scale)), dtype=torch.float32))
    return p * st.p_scale


def _cast_p_bar(st: _ForwardState, r0: int, j0: int, j1: int, alpha: torch.Tensor, p_scaled: torch.Tensor,
                visible: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """Step 7: P̄_c = cast(P̄·S, p_dtype, rounding); counts the visible entries cast to exactly `one` (S) and
    those flushed to 0, and shows the block to the observer."""
    p_bar = cast(p_scaled, st.config.p_dtype, st.config.rounding, st.generator)  # (B, H, R, N)
    st.p_one += ((p_bar == one) & visible).sum(dim=(-1, -2))
    st.p_zeroed += ((p_scaled > 0) & (p_bar == 0) & visible).sum(dim=(-1, -2))
    if st.observe is not None:
        st.observe(BlockCast(r0=r0, j0=j0, j1=j1, alpha=alpha, p_scaled=p_scaled, p_cast=p_bar, visible=visible))
    return p_bar


def _accumulate_pv(st: _ForwardState, block: _Block) -> None:
    """Step 8: acc = mm(P̄_c, V_j, acc=cast(α·acc, rescale_dtype)) with an fp32 accumulator, or
    cast(cast(α·acc) + cast(P̄_c V_j, pv_dtype), pv_dtype) for a lower pv_dtype; then m = m_new."""
    config, r0 = st.config, block.r0
    acc_scaled = cast(block.alpha * st.acc[..., r0:, :], config.rescale_dtype, config.rounding, st.generator)
    compiled = st.compiled is not None
    pv = dict(band=Band(k_hi=block.sees) if compiled else None,  # P̄ of a key the row cannot see is 0
              finite_operands=compiled and fused.p_bar_bounded(config), mma_k=config.mma_k)
    args = (block.p_bar, st.v[..., block.j0:block.j1, :], config.accumulation, config.gpu,
            wider(config.p_dtype, config.input_dtype))
    if config.pv_dtype is Precision.FP32:
        st.acc[..., r0:, :] = mm(*args, acc=acc_scaled, **pv)
    else:
        product = cast(mm(*args, **pv), config.pv_dtype, config.rounding, st.generator)
        st.acc[..., r0:, :] = cast(acc_scaled + product, config.pv_dtype, config.rounding, st.generator)
    if block.m_new is not None:
        st.m[..., r0:] = block.m_new


def _epilogue(st: _ForwardState, split_part: bool) -> Forward:
    """O = cast(acc / fp32(S·ℓ), o_dtype) (or acc · fp32(1/ℓ)), lse = m + log ℓ (the kernels' forms for exp2),
    the lane partials of ℓ reduced first; rows with no allowed key get O = 0. A split part keeps O in fp32
    and its lse -inf where ℓ = 0."""
    config = st.config
    if config.row_sum is RowSum.LANES_FMA:
        l = kernel_ops.reduce_lane_pairs(st.l)
    elif st.lanes:
        l = kernel_ops.reduce_lanes(st.l)
    else:
        l = st.l
    if config.normalize is Normalize.RECIPROCAL:
        o32 = st.acc * kernel_ops.reciprocal(l).unsqueeze(-1)
    else:
        o32 = st.acc / (st.p_scale * l).unsqueeze(-1)
    if st.mask is not None or split_part:
        o32 = torch.where((l == 0).unsqueeze(-1), torch.zeros_like(o32), o32)  # rows with no allowed key
    lse = _lse(st, l)
    if split_part:
        lse = torch.where(l == 0, torch.full_like(lse, _NEG_INF), lse)
    o = o32 if split_part else cast(o32, config.o_dtype, config.rounding, st.generator)
    return Forward(o=o, lse=lse, stats=_stats(st))


def _lse(st: _ForwardState, l: torch.Tensor) -> torch.Tensor:
    """lse = fp32(m_use + fp32(log ℓ)), or as the exp2 kernels form it (kernel_ops.kernel_lse)."""
    m_use = _shift_in_use(st.m)
    if not st.base2:
        return m_use + torch.log(l)
    config = st.config
    alpha = exp2_scale(config, st.scale, st.mask)
    return kernel_ops.kernel_lse(m_use, l, torch.tensor(alpha, dtype=torch.float32),
                                 kernel_ops.scale_log2(alpha), config.exp_form, config.lse_form, config.exp_unit)


def _stats(st: _ForwardState) -> PBarStats:
    """The P̄ statistics per (B, H): rows whose maximum is attained more than once, P̄ cast to exactly S,
    rows where the stabilized rule fired, P̄ flushed to 0."""
    B, H, T = st.m.shape
    compiled = st.compiled
    return PBarStats(
        repeated_max_rows=(st.tracker.count > 1).sum(dim=-1),
        p_one_count=st.p_one if compiled is None else compiled.p_one.sum(dim=-1),
        stabilized_rows=st.fired.sum(dim=-1),
        p_zeroed=st.p_zeroed if compiled is None else compiled.p_zeroed.sum(dim=-1),
        rows=torch.full((B, H), T, dtype=torch.int64),
    )


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
