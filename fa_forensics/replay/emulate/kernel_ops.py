"""The arithmetic of hardware flash-attention kernels that differs from the emulator's default reading.

- `exp2_block`: P̄ and the rescale factor from raw scores S = q kᵀ in the base-2 forms of ReplayConfig.exp_form
  (FlashAttention-2's softmax.h: the row max is taken on raw S, c = α·log2 e folds the softmax scale into the
  exponent's argument; the memory-efficient kernel scales the scores once or, as PyTorch builds it, twice:
  `log2_scaled`);
- `lane_row_sums` / `reduce_lanes`: FlashAttention-2's row sum ℓ, kept as four per-thread fp32 partials in the
  MMA accumulator's register layout and all-reduced once in the epilogue;
- `lane_block_sums` / `fold_lane_sums` / `reduce_lane_pairs`: cuDNN's row sum ℓ on sm_90, per-thread block sums
  fused into the rescaled per-thread partials, the partials reduced in pairs;
- `warp_row_sums`: the memory-efficient (CUTLASS) kernel's row sum ℓ, each block's P̄ summed per thread, per quad
  and per warp column, then added warp by warp to the rescaled ℓ;
- `reciprocal`: the epilogue's 1/ℓ (1 where ℓ is 0 or NaN, as the kernels guard it).

All values are fp32 tensors; every named operation rounds once to fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable

import torch

from fa_forensics.numerics import exp2_fp32, exp_fp32, fma_fp32, libdevice, log_fp32, sfu
from fa_forensics.numerics.elementary import LOG2E
from fa_forensics.enums import ExpForm, ExpUnit, LseForm

LANES = 4  # threads of an MMA quad that share one accumulator row
_PAIR = 2  # adjacent columns a thread holds in each 8-column MMA tile


def scale_log2(scale: float) -> torch.Tensor:
    """c = fp32(α · log2 e), formed in double on the host as FlashAttention-2 sets `scale_softmax_log2`."""
    alpha = float(torch.tensor(scale, dtype=torch.float32))
    return torch.tensor(alpha * LOG2E, dtype=torch.float64).float()


@dataclass(frozen=True)
class UnitFunctions:
    """The exponentials and logs a kernel model evaluates (fp32 tensors in and out): `exp2` (exp2f, ex2.approx),
    `fast_log` (the __logf of an lse), and `exp`, `log` (expf, logf of code built without fast math)."""

    exp2: Callable[[torch.Tensor], torch.Tensor]
    fast_log: Callable[[torch.Tensor], torch.Tensor]
    exp: Callable[[torch.Tensor], torch.Tensor]
    log: Callable[[torch.Tensor], torch.Tensor]


_UNIT_FUNCTIONS = {
    ExpUnit.CORRECTLY_ROUNDED: UnitFunctions(exp2_fp32, log_fp32, exp_fp32, log_fp32),
    # the GPU: its special function unit and CUDA's accurate expf / logf (numerics/sfu.py, libdevice.py)
    ExpUnit.SFU_SM90: UnitFunctions(sfu.ex2_approx, sfu.logf_fast, libdevice.expf, libdevice.logf),
}


def unit_functions(unit: ExpUnit) -> UnitFunctions:
    """The functions `unit` names: each rounded once, or as the sm_90 GPU computes them."""
    return _UNIT_FUNCTIONS[unit]


_LOG2E = torch.tensor(LOG2E, dtype=torch.float32)  # fp32(log2 e), the kernels' kLog2e
_SCALED_FORMS = (ExpForm.EXP2_SCALED, ExpForm.EXP2_SCALED_TWICE)
_LN2 = torch.tensor(math.log(2.0), dtype=torch.float32)  # fp32(ln 2)


def log2_scaled(x: torch.Tensor, scale: torch.Tensor, c: torch.Tensor, form: ExpForm) -> torch.Tensor:
    """Raw scores (or their max) in the scaled base-2 domain of the exp2-scaled forms: fp32(x·c) (exp2-scaled) or
    fp32(fp32(x·α)·fp32(log2 e)) (exp2-scaled-twice). Both roundings are monotone, so the max of the scaled
    scores is the scaled max."""
    if form is ExpForm.EXP2_SCALED_TWICE:
        return (x * scale) * _LOG2E
    return x * c


def kernel_lse(m: torch.Tensor, l: torch.Tensor, scale: torch.Tensor, c: torch.Tensor, form: ExpForm,
               lse_form: LseForm, unit: ExpUnit) -> torch.Tensor:
    """The lse (natural log) a base-2 kernel writes from its raw row max m and row sum ℓ, m_s = `log2_scaled(m)`
    the max as its exp form scales it:
    - fma-natural: FlashAttention-2's fma(m, α, __logf(ℓ)) (softmax.h; the compiler contracts the multiply-add);
    - scaled-div: the memory-efficient kernel's epilogue fp32(fp32(m_s / fp32(log2 e)) + logf(ℓ))
      (accum_t(mi / kLog2e) + cutlass::fast_log(s_prime), fast_log being logf);
    - scaled-fma: cuDNN's fma(m_s, fp32(ln 2), __logf(ℓ)) (closed source: the form that reproduces its recorded
      lse, every row with ℓ summed as row_sum lanes-fma)."""
    functions = unit_functions(unit)
    if lse_form is LseForm.SCALED_DIV:
        return log2_scaled(m, scale, c, form) / _LOG2E + functions.log(l)
    if lse_form is LseForm.SCALED_FMA:
        return fma_fp32(log2_scaled(m, scale, c, form), _LN2, functions.fast_log(l))
    return fma_fp32(m, scale, functions.fast_log(l))


def exp2_block(S: torch.Tensor, m_prev: torch.Tensor, m_use: torch.Tensor, c: torch.Tensor, scale: torch.Tensor,
               form: ExpForm, unit: ExpUnit = ExpUnit.CORRECTLY_ROUNDED) -> tuple[torch.Tensor, torch.Tensor]:
    """(rescale (B, H, R, 1), P̄ (B, H, R, N)) for raw scores S (−inf = masked), the previous and new running
    maxima of raw S (m_use: 0 where nothing is visible yet). rescale = exp2(fp32(fp32(m_prev − m_use)·c));
    P̄ = exp2(fma(S, c, −fp32(m_use·c))) (exp2-fma) or exp2(fp32(fp32(S·c) − fp32(m_use·c))) (exp2-mul).
    The exp2-scaled forms work in the scaled domain (`log2_scaled`, which exp2-scaled-twice forms with the
    fp32 softmax scale α, `scale`): rescale exp2(fp32(s(m_prev) − s(m_use))), P̄ = exp2(fp32(s(S) − s(m_use))).
    2^x as `unit` computes it."""
    exp2 = unit_functions(unit).exp2
    if form in _SCALED_FORMS:
        m_s = log2_scaled(m_use, scale, c, form)
        alpha = exp2(log2_scaled(m_prev, scale, c, form) - m_s).unsqueeze(-1)
        return alpha, exp2(log2_scaled(S, scale, c, form) - m_s.unsqueeze(-1))
    max_scaled = (m_use * c).unsqueeze(-1)  # fp32 product
    if form is ExpForm.EXP2_FMA:
        x = fma_fp32(S, c, -max_scaled)
    else:
        x = (S * c) - max_scaled  # two fp32 roundings
    alpha = exp2((m_prev - m_use) * c).unsqueeze(-1)
    return alpha, exp2(x)


def lane_row_sums(p: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    """Add one block's P̄ (B, H, R, N) into the per-thread partials (B, H, R, 4): thread q takes the block's
    columns 8t + 2q and 8t + 2q + 1 for t = 0, 1, ... in that order, one fp32 addition each."""
    *lead, n = p.shape
    pad = (-n) % (LANES * _PAIR)
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    tiles = p.reshape(*lead, -1, LANES, _PAIR).movedim(-2, -3).reshape(*lead, LANES, -1)  # (..., 4, columns in order)
    out = partials.clone()
    for i in range(tiles.shape[-1]):
        out = out + tiles[..., i]
    return out


def lane_block_sums(p: torch.Tensor) -> torch.Tensor:
    """One block's P̄ (B, H, R, N) summed per thread (B, H, R, 4): thread q adds the block's columns 8t + 2q and
    8t + 2q + 1 for t = 0, 1, ... in that order into a partial from 0, one fp32 addition each."""
    return lane_row_sums(p, torch.zeros((*p.shape[:-1], LANES)))


def fold_lane_sums(partials: torch.Tensor, alpha: torch.Tensor, block_sums: torch.Tensor) -> torch.Tensor:
    """The per-thread partials (B, H, R, 4) after one block: fma(α, ℓ_q, s_q), the rescale and the block's sum in
    one rounding (alpha (B, H, R, 1), block_sums from `lane_block_sums`)."""
    return fma_fp32(alpha.expand_as(partials), partials, block_sums)


def reduce_lane_pairs(partials: torch.Tensor) -> torch.Tensor:
    """The quad reduction of the partials (..., 4) in neighbouring pairs: (ℓ₀ + ℓ₁) + (ℓ₂ + ℓ₃)."""
    return (partials[..., 0] + partials[..., 1]) + (partials[..., 2] + partials[..., 3])


WARP_KEYS = 32  # keys of one warp tile of the memory-efficient kernel's Q Kᵀ (WarpShape 32 x 32)
_MMA_N = 8  # keys of one m16n8 MMA tile


def warp_row_sums(p: torch.Tensor, l_scaled: torch.Tensor) -> torch.Tensor:
    """ℓ (B, H, R) after one block of the memory-efficient kernel (iterative_softmax), from its P̄ (B, H, R, N) and
    the rescaled running ℓ: the block's keys are cut into warp tiles of 32; in each, thread q of the row's quad
    adds keys 8t + 2q and 8t + 2q + 1 for t = 0..3 in that order into a partial from 0; the quad reduces
    (shuffle-xor 1, then 2) to (s₀ + s₁) + (s₂ + s₃); ℓ then adds the warp tiles' sums one by one, in key order.
    Keys past N add 0, as the kernel's columns past the last key do."""
    *lead, n = p.shape
    pad = (-n) % WARP_KEYS
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    # (..., warp, mma tile t, lane q, column) -> (..., warp, q, t·2 + column): each thread's values in its order
    per_thread = p.reshape(*lead, -1, WARP_KEYS // _MMA_N, LANES, _PAIR).movedim(-2, -3).reshape(*lead, -1, LANES,
                                                                                                  WARP_KEYS // LANES)
    partial = per_thread[..., 0]
    for i in range(1, per_thread.shape[-1]):
        partial = partial + per_thread[..., i]
    quad = (partial[..., 0] + partial[..., 1]) + (partial[..., 2] + partial[..., 3])  # (..., warp)
    out = l_scaled
    for w in range(quad.shape[-1]):
        out = out + quad[..., w]
    return out


def reduce_lanes(partials: torch.Tensor) -> torch.Tensor:
    """The quad all-reduce (shuffle-xor 2, then 1) of the partials (..., 4): (ℓ₀ + ℓ₂) + (ℓ₁ + ℓ₃)."""
    return (partials[..., 0] + partials[..., 2]) + (partials[..., 1] + partials[..., 3])


def reciprocal(l: torch.Tensor) -> torch.Tensor:
    """fp32(1 / ℓ), and 1 where ℓ is 0 or NaN (the kernels' guard: such a row's accumulator is 0)."""
    inv = (1.0 / l.double()).float()
    return torch.where((l == 0) | torch.isnan(l), torch.ones_like(inv), inv)
