"""Compiled (numba) elementwise stages of the emulator: the same arithmetic as forward.py and
backward.py, one pass per row instead of some forty torch passes over the (rows × keys) scores.

Each kernel takes the raw fp32 matrix product (from `ops.mm`, so the accumulation model is
unchanged) and performs, per row and in the same order, the casts, masks, shift rule, exps,
P̄ cast and statistics the torch code performs: every operation is the same IEEE fp32 (or
float64-then-fp32) operation on the same operands, casts go through `numerics.scalar_jit`
(bit-identical to `round_to` nearest-even and `exp_fp32`, tested), so the bits are the torch
path's. What stays in torch: the matrix products, ℓ's row sum of P̄ (torch's float64 sum, whose
order a kernel cannot reproduce), and the small per-row (B, H, T) and (B, H, T, D) updates.

These stages are half of `Engine.COMPILED` (numerics/engines.py). The torch path is the specification
and runs instead (`eligible` says when) under `Engine.SPEC`, for stochastic rounding, given scores, a
per-block observer, non-finite inputs, or inputs so large that a score could overflow.
"""
from __future__ import annotations

import math
from typing import Optional

import numba
import numpy as np
import torch
from numba import prange

from fa_forensics.numerics.accumulate_jit import _fma32 as _fma  # one fma: the ieee model's step
from fa_forensics.numerics.engines import runs_compiled
from fa_forensics.numerics.scalar_jit import exp32, format_code, round_ne
from fa_forensics.replay.config import PScaleMode, Precision, ReplayConfig, Rounding, Softmax

_JIT = dict(nogil=True, cache=True, parallel=True)
_SAFE = 2.0**100  # bound on |scores| (and dP) below which no intermediate can overflow fp32
_STANDARD, _STABILIZED, _FIXED = 0, 1, 2
_SOFTMAX_CODE = {Softmax.STANDARD: _STANDARD, Softmax.STABILIZED: _STABILIZED, Softmax.FIXED_OFFSET: _FIXED}


def eligible(config: ReplayConfig, *tensors: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None) -> bool:
    """True when the compiled stages apply: the current engine is `Engine.COMPILED`, nearest-even rounding,
    no soft-cap, finite inputs whose products (q kᵀ · α, dO Vᵀ) stay far inside fp32's range, and no NaN or +inf in an
    additive mask (where the torch path's −inf + inf gives NaN, the compiled stages skip a causally masked
    key). tensors: q, k (and v, dO), fp32."""
    if not runs_compiled() or config.rounding is not Rounding.NEAREST_EVEN or config.softcap is not None:
        return False
    if mask is not None and mask.is_floating_point() and bool((torch.isnan(mask) | (mask == math.inf)).any()):
        return False
    tops = []
    for t in tensors:
        if t.numel() == 0:
            return False
        top = float(t.abs().max())
        if not math.isfinite(top):
            return False
        tops.append(top)
    D = tensors[0].shape[-1]
    bound = max(scale, 1.0) * 2 * D
    return all(bound * tops[0] * t < _SAFE for t in tops[1:]) and bound * max(tops) ** 2 < _SAFE


def p_bar_bounded(config: ReplayConfig) -> bool:
    """True when the forward's shift m is at least the row maximum, so that P̄ ≤ S (about, after
    low-precision casts of m) and finite: the standard softmax, the stabilized one with β ≥ 1, a
    fixed offset ≥ 0. (A shift below the maximum can overflow exp on large scores.)"""
    if config.softmax is Softmax.STABILIZED:
        return config.beta >= 1.0
    return config.softmax is Softmax.STANDARD or config.offset >= 0.0


def _code_of(p: Precision):
    """The compiled kernels' arguments that name a precision (its format code)."""
    return format_code(p.value)


def _np(x: torch.Tensor) -> np.ndarray:
    return x.numpy()


def _mask_array(mk: torch.Tensor, mask_bool: bool) -> np.ndarray:
    """A mask block (L, R, N) as a C-contiguous uint8 (bool) or float32 (additive) array. A broadcast fp32
    mask is a strided view: passed as is, it would make numba compile (for minutes) and cache a second
    specialization of each kernel for non-contiguous arrays; contiguous, it reuses the one every replay uses."""
    return np.ascontiguousarray(_np(mk.to(torch.uint8) if mask_bool else mk.float()))


# ---------------------------------------------------------------------------------------------
# forward: one KV block


@numba.njit(**_JIT)
def _forward_block(buf, mask, has_mask, mask_bool, scale, row_base, j0, causal,
                   s_man, s_emin, s_max, s_sat, st_man, st_emin, st_max, st_sat,
                   sub_man, sub_emin, sub_max, sub_sat, p_man, p_emin, p_max, p_sat,
                   visit, mask_value, softmax, beta, eps, offset, p_scale, exponent_offset, ln_s,
                   m, trk_max, trk_count, fired, alpha, pbar, p_one, p_zeroed):
    """buf (L, R, N): the raw q kᵀ of rows row_base.. and keys j0.., overwritten with the pre-cast
    P̄; pbar (L, R, N) gets P̄ cast; m, trk_max, trk_count, fired (L, R) updated in place; alpha
    (L, R) written; p_one, p_zeroed (L, R) incremented."""
    L, R, N = buf.shape
    neg_inf = np.float32(-np.inf)
    for r in prange(L * R):
        l = r // R
        i = r % R
        row = buf[l, i]
        n_vis = min(max(row_base + i - j0 + 1, 0), N) if causal else N  # keys j ≥ n_vis are causally masked
        b_max, b_count = _row_scores(row, mask[l, i] if has_mask else mask[0, 0], n_vis, has_mask, mask_bool,
                                     scale, s_man, s_emin, s_max, s_sat)
        old_max = trk_max[l, i]
        if b_max > old_max:
            trk_count[l, i] = b_count
        elif b_max == old_max:
            trk_count[l, i] += b_count
        trk_max[l, i] = max(old_max, b_max)
        sees_key = b_max > neg_inf
        r_m = b_max if sees_key else (mask_value if visit else neg_inf)  # the row max as the loop sees it
        m_prev = m[l, i]
        m_rule, repeated = _row_shift(row, r_m, m_prev, visit, mask_value, softmax, beta, eps, offset,
                                      s_man, s_emin, s_max, s_sat)
        if repeated and r_m != 0 and abs(r_m) < np.inf and sees_key:
            fired[l, i] = True
        m_new = round_ne(m_rule, st_man, st_emin, st_max, st_sat)
        m_use = np.float32(0.0) if m_new == neg_inf else m_new
        alpha[l, i] = exp32(round_ne(np.float32(m_prev - m_use), st_man, st_emin, st_max, st_sat))
        m[l, i] = m_new
        n_one, n_zeroed = _row_p_bar(row, pbar[l, i], N if visit else n_vis, m_use, visit, mask_value, p_scale,
                                     exponent_offset, ln_s, sub_man, sub_emin, sub_max, sub_sat,
                                     p_man, p_emin, p_max, p_sat)
        p_one[l, i] += n_one
        p_zeroed[l, i] += n_zeroed


@numba.njit(nogil=True, cache=True)
def _row_scores(row, mask_row, n_vis, has_mask, mask_bool, scale, s_man, s_emin, s_max, s_sat):
    """Step 1 of one row: s = cast(fp32(cast(S) · α)), masked (-inf beyond n_vis, bool mask; additive: cast(s +
    mask)), written over the raw S; returns the row max and how often it is attained (0 when all masked)."""
    neg_inf = np.float32(-np.inf)
    b_max = neg_inf
    b_count = 0
    for j in range(n_vis, row.shape[0]):
        row[j] = neg_inf
    for j in range(n_vis):
        x = round_ne(row[j], s_man, s_emin, s_max, s_sat)
        x = round_ne(np.float32(x * scale), s_man, s_emin, s_max, s_sat)
        if has_mask:
            if mask_bool:
                if mask_row[j] == 0:
                    x = neg_inf
            else:
                x = round_ne(np.float32(x + mask_row[j]), s_man, s_emin, s_max, s_sat)
        row[j] = x
        if x > b_max:
            b_max = x
            b_count = 1
        elif x == b_max:
            b_count += 1
    if b_max == neg_inf:
        b_count = 0
    return b_max, b_count


@numba.njit(nogil=True, cache=True)
def _row_shift(row, r_m, m_prev, visit, mask_value, softmax, beta, eps, offset, s_man, s_emin, s_max, s_sat):
    """Step 2 of one row (softmax.block_shift): the shift rule on the scores as the loop sees them (masked =
    mask_value when visiting); returns (max(m_prev, shift), whether the block's max is repeated within ε)."""
    if softmax == _STANDARD:
        return max(m_prev, r_m), False
    if softmax == _FIXED:
        return max(m_prev, np.float32(r_m + offset)), False
    neg_inf = np.float32(-np.inf)
    r_s = 0
    if s_man >= 23:
        for j in range(row.shape[0]):
            s = row[j]
            if visit and s == neg_inf:
                s = mask_value
            if np.float32(r_m - s) <= eps:
                r_s += 1
    else:
        threshold = round_ne(np.float32(r_m - eps), s_man, s_emin, s_max, s_sat)
        for j in range(row.shape[0]):
            s = row[j]
            if visit and s == neg_inf:
                s = mask_value
            if s >= threshold:
                r_s += 1
    repeated = r_s > 1
    m_1 = np.float32(beta * r_m) if (r_m > 0 and repeated) else r_m
    m_2 = np.float32(0.0) if (r_m < 0 and repeated) else m_1
    return max(m_prev, m_2), repeated


@numba.njit(nogil=True, cache=True)
def _row_p_bar(row, pb_row, n_exp, m_use, visit, mask_value, p_scale, exponent_offset, ln_s,
               sub_man, sub_emin, sub_max, sub_sat, p_man, p_emin, p_max, p_sat):
    """Steps 4, 6 and 7 of one row: P̄ = exp(cast(s − m)) over row (in place), P̄·S and its cast into pb_row;
    returns the counts of visible P̄ cast to exactly S and flushed to 0. A −inf score gives P̄ = 0 whatever
    the finite m and format; keys from n_exp on are written as such."""
    neg_inf = np.float32(-np.inf)
    n_one = 0
    n_zeroed = 0
    if p_scale == 1.0 and not visit:  # the common case, in loops without branches (they vectorize)
        for j in range(n_exp):
            p = exp32(round_ne(np.float32(row[j] - m_use), sub_man, sub_emin, sub_max, sub_sat))
            row[j] = p
            pb_row[j] = round_ne(p, p_man, p_emin, p_max, p_sat)
        for j in range(n_exp):  # a masked key has P̄ = 0 here, so the counts need no mask
            n_one += np.int64(pb_row[j] == 1.0)
            n_zeroed += np.int64((row[j] > 0) & (pb_row[j] == 0))
    else:
        for j in range(n_exp):
            s = row[j]
            visible = s != neg_inf
            if visit and not visible:
                s = mask_value
            sm = round_ne(np.float32(s - m_use), sub_man, sub_emin, sub_max, sub_sat)
            p = exp32(sm)
            if p_scale == 1.0:
                ps = p
            elif exponent_offset:
                ps = exp32(np.float32(sm + ln_s))
            else:
                ps = np.float32(p * p_scale)
            pb = round_ne(ps, p_man, p_emin, p_max, p_sat)
            row[j] = p
            pb_row[j] = pb
            n_one += np.int64(visible & (pb == p_scale))
            n_zeroed += np.int64(visible & (ps > 0) & (pb == 0))
    for j in range(n_exp, row.shape[0]):
        row[j] = 0.0
        pb_row[j] = 0.0
    return n_one, n_zeroed


class ForwardBlock:
    """The compiled stage of one forward KV block for a (B, H, T) state of one forward call."""

    def __init__(self, config: ReplayConfig, scale: float, mask_value: float, shape: torch.Size):
        self.config = config
        self.scale = np.float32(scale)
        self.mask_value = np.float32(mask_value)
        sub = config.s_dtype if config.s_dtype is config.stats_dtype else Precision.FP32
        self.formats = (*_code_of(config.s_dtype), *_code_of(config.stats_dtype), *_code_of(sub),
                        *_code_of(config.p_dtype))
        self.p_one = torch.zeros(shape, dtype=torch.int64)  # (B, H, T) per row, summed at the end
        self.p_zeroed = torch.zeros(shape, dtype=torch.int64)

    def run(self, S: torch.Tensor, mask_block: Optional[torch.Tensor], *, row0: int, j0: int, causal: bool,
            m: torch.Tensor, tracker_max: torch.Tensor, tracker_count: torch.Tensor, fired: torch.Tensor,
            r0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """S (B, H, R, N) raw q kᵀ of rows r0.. (overwritten) -> (pre-cast P̄, P̄ cast, alpha (B, H, R, 1)).
        m, tracker_max/count, fired: the (B, H, T) running state, updated for rows r0.."""
        cfg = self.config
        B, H, R, N = S.shape
        L = B * H
        buf = S.reshape(L, R, N)
        pbar = torch.empty_like(buf)
        alpha = torch.empty(L, R)
        if mask_block is None:
            mask_np, has_mask, mask_bool = np.zeros((1, 1, 1), np.float32), False, False
        else:
            mask_bool = mask_block.dtype == torch.bool
            mk = mask_block.expand(B, H, R, N).reshape(L, R, N)
            mask_np = _mask_array(mk, mask_bool)
            has_mask = True
        state = [x[..., r0:].view(L, R) for x in (m, tracker_max, tracker_count, fired, self.p_one, self.p_zeroed)]
        _forward_block(_np(buf), mask_np, has_mask, mask_bool, self.scale, row0 + r0, j0, causal, *self.formats,
                       cfg.masked_blocks.value == "visit", self.mask_value, _SOFTMAX_CODE[cfg.softmax],
                       np.float32(cfg.beta), np.float32(cfg.eps), np.float32(cfg.offset), np.float32(cfg.p_scale),
                       cfg.p_scale_mode is PScaleMode.EXPONENT_OFFSET, np.float32(math.log(cfg.p_scale)),
                       *(_np(x) for x in state[:4]), _np(alpha), _np(pbar), _np(state[4]), _np(state[5]))
        return buf.view(B, H, R, N), pbar.view(B, H, R, N), alpha.view(B, H, R, 1)


# ---------------------------------------------------------------------------------------------
# backward: one block of query rows


@numba.njit(**_JIT)
def _backward_probs(buf, mask, has_mask, mask_bool, scale, row_base, causal, s_man, s_emin, s_max, s_sat, lse):
    """buf (L, R, N): raw q kᵀ of rows row_base.., overwritten with P = exp(fp32(s − lse)) (0 where
    masked; rows with lse = −inf: 0 when a mask is given)."""
    L, R, N = buf.shape
    neg_inf = np.float32(-np.inf)
    for r in prange(L * R):
        l = r // R
        i = r % R
        row = buf[l, i]
        gi = row_base + i
        lse_i = lse[l, i]
        zero_row = has_mask and lse_i == neg_inf
        n_vis = min(gi + 1, N) if causal else N  # keys j ≥ n_vis are causally masked
        p_masked = np.float32(0.0) if zero_row else exp32(np.float32(neg_inf - lse_i))
        for j in range(n_vis, N):
            row[j] = p_masked
        for j in range(n_vis):  # without a mask a loop without branches (it vectorizes)
            x = round_ne(row[j], s_man, s_emin, s_max, s_sat)
            row[j] = round_ne(np.float32(x * scale), s_man, s_emin, s_max, s_sat)
        if has_mask:
            for j in range(n_vis):
                if mask_bool:
                    if mask[l, i, j] == 0:
                        row[j] = neg_inf
                else:
                    row[j] = round_ne(np.float32(row[j] + mask[l, i, j]), s_man, s_emin, s_max, s_sat)
        for j in range(n_vis):
            p = exp32(np.float32(row[j] - lse_i))
            row[j] = np.float32(0.0) if zero_row else p


@numba.njit(**_JIT)
def _backward_ds(P, buf, delta, compute_delta, dp_man, dp_emin, dp_max, dp_sat, ds_man, ds_emin, ds_max, ds_sat,
                 ds_alpha, alpha, p_scale, p_man, p_emin, p_max, p_sat):
    """buf (L, R, N): raw dO Vᵀ, overwritten with dS; P (L, R, N) overwritten with P̄ (its cast for
    dV); delta (L, R): δ, computed here as rowsum(dP ∘ P) by fmas in key order if compute_delta."""
    L, R, N = buf.shape
    for r in prange(L * R):
        l = r // R
        i = r % R
        row = buf[l, i]
        p_row = P[l, i]
        for j in range(N):
            row[j] = round_ne(row[j], dp_man, dp_emin, dp_max, dp_sat)
        if compute_delta:
            acc = np.float32(0.0)
            for j in range(N):
                acc = _fma(row[j], p_row[j], acc)
            delta[l, i] = acc
        d = delta[l, i]
        for j in range(N):
            p = p_row[j]
            p_ds = np.float32(p * alpha) if ds_alpha else p
            row[j] = round_ne(np.float32(p_ds * np.float32(row[j] - d)), ds_man, ds_emin, ds_max, ds_sat)
            ps = np.float32(p * p_scale) if p_scale != 1.0 else p
            p_row[j] = round_ne(ps, p_man, p_emin, p_max, p_sat)


def backward_probs(S: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], config: ReplayConfig, *,
                   scale: float, row0: int, causal: bool) -> torch.Tensor:
    """P (B, H, R, N) from the raw q kᵀ S of rows row0.. (overwritten); lse (B, H, R)."""
    B, H, R, N = S.shape
    L = B * H
    buf = S.reshape(L, R, N)
    if mask is None:
        mask_np, mask_bool = np.zeros((1, 1, 1), np.float32), False
    else:
        mask_bool = mask.dtype == torch.bool
        mk = mask.expand(B, H, R, N).reshape(L, R, N)
        mask_np = _mask_array(mk, mask_bool)
    lse2 = lse.reshape(L, R).contiguous()
    _backward_probs(_np(buf), mask_np, mask is not None, mask_bool, np.float32(scale), row0, causal,
                    *_code_of(config.s_dtype), _np(lse2))
    return buf.view(B, H, R, N)


def backward_ds(P: torch.Tensor, dP_raw: torch.Tensor, delta: Optional[torch.Tensor], config: ReplayConfig, *,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dS, P̄ cast, δ (B, H, R)) from P and the raw dO Vᵀ (both overwritten); δ computed as
    rowsum(dP ∘ P) when delta is None (config.delta dp-p)."""
    B, H, R, N = P.shape
    L = B * H
    buf, p = dP_raw.reshape(L, R, N), P.reshape(L, R, N)
    compute = delta is None
    d = torch.empty(L, R) if compute else delta.reshape(L, R).contiguous().clone()
    _backward_ds(_np(p), _np(buf), _np(d), compute, *_code_of(config.dp_dtype), *_code_of(config.ds_dtype),
                 config.ds_alpha, np.float32(scale), np.float32(config.p_scale), *_code_of(config.p_dtype))
    return buf.view(B, H, R, N), p.view(B, H, R, N), d.view(B, H, R)
