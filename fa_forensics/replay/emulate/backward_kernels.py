"""The backward passes of the attention kernels users train with, modelled from their sources.

Each model is the order of operations of one kernel's backward, read from its published source (or, for
the closed-source cuDNN, measured against recorded bits), written with the emulator's two primitives:
`cast` (one rounding) and `mm` (a matrix product in the config's accumulation model; a product that
continues an accumulator across tiles is `mm(..., acc=)`). Common to all three: S = Q Kᵀ and dP = dO Vᵀ
as fp32 products of the input-dtype operands; P recomputed from S and the forward's lse (natural log);
δ = rowsum(dO ∘ O) over the forward's stored O in fp32, in the kernel's reduction order; dS rounded to the
input dtype before the dQ and dK products; dQ, dK, dV written in the input dtype. Where they differ:

flash-attention-2 (Dao-AILab/flash-attention csrc/flash_attn/src: flash_bwd_kernel.h,
flash_bwd_preprocess_kernel.h, flash_bwd_launch_template.h; the sm80 kernels SDPA runs on sm_90):
  tiles (kBlockM × kBlockN) 128 × 128 for head dim ≤ 64, 64 × 128 for 96 and 128, 64 × 64 above.
  δ (preprocess dot_do_o): each row is read by kBlockKSmem/8 threads (8 for head dims that are multiples of
    64, else 4), thread t holding columns [8t + 64c, +8) for c = 0, 1, ..; each sums its products in order,
    then a butterfly across the threads with xor offsets n/2, .., 2, 1.
  P = exp2(fma(S, α·log2 e, −fp32(lse·log2 e))) (scale_apply_exp2 with the scale folded in: one rounding
    of the exponent argument).
  dS = cast(P · fp32(dP − δ)); P̄ = cast(P) for dV.
  dK, dV: one CTA per key block walks the query blocks from the LAST to the first (m_block = m_block_max − 1
    down to m_block_min), its fp32 accumulators continued from tile to tile; at the end dK ← fp32(dK · α).
  dQ: each (query block, key block) tile's dS Kⱼ is formed from zero and atomically added to an fp32 dQ
    buffer (the seqk-parallel kernel); then dQ ← fp32(dQ · α) (convert_dQ). The order of the atomic adds is
    the hardware's: modelled as ascending key blocks. It is not deterministic (see docs/gpu-fidelity.md).
sdpa-efficient (pytorch/pytorch aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_backward.h and
  gemm_kernel_utils.h, the xformers kernel):
  MMA: `DefaultGemmType` for 16-bit inputs on sm75+ issues mma.sync m16n8k8, so each instruction sums 8 products
    into the accumulator: the tensor-core model's groups are 8 long (mma_k = 8) with the GPU's alignment width.
  tiles (kBlockSizeI × kBlockSizeJ): the backward dispatch's, 64 × 64 for head dim ≤ 64, 128 × 128 up to 128
    (kNumThreads = I·J/32; efficient_schedule.backward_tile).
  δ (computeDelta): kNumThreads / kBlockSizeI threads per row (2, or 4 above head dim 64), thread t holding
    columns [8t + 8n·c, +8); each sums in order, then an xor butterfly with offsets 1, 2, ...
  P = exp(fp32(fp32(S · α) − lse)) (the scale multiplies the accumulator, the epilogue subtracts the lse
    and exponentiates), stored to shared memory in the input dtype: P̄ = cast(P) is what dS reads.
  dS = cast(fp32(fp32(fp32(dP − δ) · P̄) · α)): the scale is folded into dS, so dQ and dK are not scaled.
  schedule (efficient_schedule.py): the keys are split over num_splits_key CTAs per head (PyTorch's heuristic
    from batch, heads and keys, or config.bwd_key_splits); CTA s takes key blocks s, s + splits, .. and walks
    the query blocks of each from the first it sees, shifted by s blocks and wrapped around without a mask.
  dK, dV: each key block's accumulators continued over its CTA's walk.
  dQ: one fp32 accumulator per query block in a workspace, continued by each CTA under a lock: over the key
    blocks in the order the CTAs reach the query block (all of a head's CTAs in lockstep; under a causal mask
    that is descending, without one from the query block's own index down, wrapping around).
sdpa-cudnn (cuDNN 9 fused flash attention on sm_90; no source: the order below is the one that reproduces
  the recorded bits, among the FlashAttention-family alternatives tried, documented in docs/gpu-fidelity.md):
  δ: as flash-attention-2's. P = exp2(fp32(fma(S, α, −lse) · log2 e)): the scale and the lse in one fused
    multiply-add (measured: with fp32(fp32(S · α) − lse) instead, head dim 128, where α is not a power of two,
    loses 0.01-0.13 % of dV).
  dS = cast(fp32(fp32(P · fp32(dP − δ)) · α)): the scale folded into dS, as in sdpa-efficient.
  dK, dV: accumulators continued over the query blocks in ascending order.
  dQ: per (query block, key block of 128) tile from zero, added in fp32 in ascending key order.

2^x and e^x follow the config's exp_unit: for the kernel presets, 2^x is the special function unit's ex2.approx
(numerics/sfu.py, what exp2f compiles to) and e^x CUDA's accurate expf (numerics/libdevice.py: the
memory-efficient kernel's P, which it forms with expf; with a correctly rounded exp its gradients lose up to 0.03 %).
A causal mask is top-left aligned (key j > query i is masked), as SDPA's is_causal; SDPA's attn_mask is not
modelled.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.numerics import exp2_fp32, exp_fp32
from fa_forensics.numerics.elementary import LOG2E, fma_fp32
from fa_forensics.replay.config import BackwardKernel, ExpForm, Precision, ReplayConfig
from fa_forensics.replay.emulate import efficient_schedule, kernel_ops
from fa_forensics.replay.emulate.ops import cast, mm

_LOG2E = torch.tensor(LOG2E, dtype=torch.float32)  # M_LOG2E as an fp32 constant


@dataclass(frozen=True)
class KernelModel:
    """The order of operations of one kernel's backward (see the module docstring)."""

    tiles: Callable[[int], tuple[int, int]]  # head dim -> (query rows, keys) per tile
    delta_threads: Callable[[int], int]  # head dim -> threads sharing one row of δ (8 columns per load)
    butterfly_descending: bool  # xor offsets n/2 .. 1 (True) or 1 .. n/2
    exp_form: str  # "exp2-folded" | "exp2-natural" | "exp2-natural-fma" | "exp"
    scale_in_ds: bool  # α multiplies dS before its cast (dQ, dK then unscaled)
    ds_reads_p_bar: bool  # dS is formed from the input-dtype P̄ rather than the fp32 P
    query_blocks_descending: bool  # the dK / dV accumulators walk the query blocks last to first
    dq_chained: bool  # dQ: one accumulator continued over the key blocks (else per-tile partials added in fp32)
    dq_keys_descending: bool  # the key-block order of the dQ sum
    mma_k: Optional[int] = None  # the MMA instruction's K where smaller than the tensor core's group
    # the tiles run in the memory-efficient kernel's CTA order (efficient_schedule.py), which then sets the
    # order of the dK, dV and dQ sums in place of the three order fields above
    cta_schedule: bool = False


def _fa2_tiles(d: int) -> tuple[int, int]:
    return (128, 128) if d <= 64 else (64, 128) if d <= 128 else (64, 64)


def _efficient_tiles(d: int) -> tuple[int, int]:
    tile = efficient_schedule.backward_tile(d)
    return tile.queries, tile.keys


MODELS = {
    BackwardKernel.FLASH_ATTENTION_2: KernelModel(
        tiles=_fa2_tiles, delta_threads=lambda d: 8 if d % 64 == 0 else 4, butterfly_descending=True,
        exp_form="exp2-folded", scale_in_ds=False, ds_reads_p_bar=False, query_blocks_descending=True,
        dq_chained=False, dq_keys_descending=False),
    BackwardKernel.SDPA_EFFICIENT: KernelModel(
        tiles=_efficient_tiles, delta_threads=lambda d: 2 if d <= 64 else 4,
        butterfly_descending=False, exp_form="exp", scale_in_ds=True, ds_reads_p_bar=True,
        query_blocks_descending=False, dq_chained=True, dq_keys_descending=True, mma_k=8, cta_schedule=True),
    BackwardKernel.SDPA_CUDNN: KernelModel(
        tiles=lambda d: (128, 128), delta_threads=lambda d: 8 if d % 64 == 0 else 4, butterfly_descending=True,
        exp_form="exp2-natural-fma", scale_in_ds=True, ds_reads_p_bar=False, query_blocks_descending=False,
        dq_chained=False, dq_keys_descending=False),
}


def row_delta(do: torch.Tensor, o: torch.Tensor, threads: int, descending: bool) -> torch.Tensor:
    """δ = Σ_d dO·O per row (B, H, T) as `threads` threads reduce it: thread t sums the columns
    [8t + 8·threads·c, +8), c = 0, 1, .. in order (exact products, one fp32 rounding per addition),
    then the threads' partial sums meet in an xor butterfly (offsets n/2 .. 1 or 1 .. n/2)."""
    D = do.shape[-1]
    prod = do * o  # exact: products of 16-bit inputs fit in fp32
    parts = []
    for t in range(threads):
        acc = torch.zeros(do.shape[:-1])
        for c0 in range(8 * t, D, 8 * threads):
            for col in range(c0, min(c0 + 8, D)):
                acc = acc + prod[..., col]
        parts.append(acc)
    offsets = []
    off = 1
    while off < threads:
        offsets.append(off)
        off *= 2
    for off in (offsets[::-1] if descending else offsets):
        parts = [parts[i] + parts[i ^ off] for i in range(threads)]
    return parts[0]


def _probs(S: torch.Tensor, lse: torch.Tensor, scale: float, form: str, exp2=exp2_fp32, exp=exp_fp32) -> torch.Tensor:
    """P (B, H, R, N) fp32 from the raw scores S and the lse (B, H, R) of these rows; 2^x by `exp2`, e^x by `exp`."""
    alpha = torch.tensor(scale, dtype=torch.float32)
    c = kernel_ops.scale_log2(scale)  # fp32(fp32(α)·log2 e), formed as the forward's (scale_softmax_log2)
    if form == "exp2-folded":  # exp2(fma(S, α·log2 e, −lse·log2 e)): S·c is exact in fp64, one rounding after
        c = c.double()
        shift = (lse * _LOG2E).double().unsqueeze(-1)
        return exp2((S.double() * c - shift).float())
    if form == "exp2-folded-mul":  # the same without the FMA: exp2(fp32(fp32(S·c) − fp32(lse·log2 e)))
        return exp2(S * c - (lse * _LOG2E).unsqueeze(-1))
    if form == "exp2-natural-fma":  # exp2(fp32(fma(S, α, −lse)·log2 e))
        return exp2(fma_fp32(S, alpha, -lse.unsqueeze(-1)) * _LOG2E)
    x = S * alpha - lse.unsqueeze(-1)  # fp32(fp32(S·α) − lse)
    if form == "exp2-natural":
        return exp2(x * _LOG2E)
    return exp(x)


def _blocks(start: int, stop: int, size: int, descending: bool) -> list[tuple[int, int]]:
    """[i0, i1) of the tiles of `size` (aligned at multiples of size) that cover [start, stop), in order."""
    blocks = [(max(i0, start), min(i0 + size, stop)) for i0 in range(start // size * size, stop, size)]
    return blocks[::-1] if descending else blocks


def kernel_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, config: ReplayConfig, *, causal: bool, scale: float,
                    mask: Optional[torch.Tensor] = None, row0: int = 0, num_queries: Optional[int] = None):
    """The backward of config.backward_kernel; q, k, v, do, o (B, H, T|N, D) fp32 holding input-dtype values,
    o the forward's stored O, lse (B, H, T) its lse. Returns (δ, dQ, dK, dV), the gradients as fp32 tensors
    holding input-dtype values (what the kernel writes).
    row0: the query rows are rows row0 .. row0 + T − 1 of the attention (the causal mask and the tiles are
    placed by it); dK and dV are then these rows' contributions only, δ and dQ those of these rows.
    num_queries: the query rows of the launch (default row0 + T), which place the memory-efficient kernel's
    walk over the query blocks."""
    _check_supported(config, mask)
    model = MODELS[config.backward_kernel]
    exp_form = model.exp_form
    if exp_form == "exp2-folded" and config.exp_form is ExpForm.EXP2_MUL:
        exp_form = "exp2-folded-mul"  # a build with the FMA unfused (PyTorch's) unfuses it here too
    fmt = config.input_dtype
    mma_k = config.mma_k if config.mma_k is not None else model.mma_k  # the config's, else the kernel's own
    T, D = q.shape[-2:]
    alpha = torch.tensor(scale, dtype=torch.float32)
    delta = row_delta(do, o, model.delta_threads(D), model.butterfly_descending)  # (B, H, T)
    if model.cta_schedule:
        launch = row0 + T if num_queries is None else num_queries
        dq, dk, dv = _scheduled_gradients(q, k, v, do, lse, delta, config, model, exp_form, mma_k, causal=causal,
                                          scale=scale, row0=row0, num_queries=launch)
        return delta, cast(dq, fmt), cast(dk, fmt), cast(dv, fmt)
    dq = torch.zeros(q.shape)
    grads = [torch.zeros(k.shape), torch.zeros(v.shape)]  # dK, dV (B, H, N, D) fp32 accumulators
    for a0, a1 in _blocks(row0, row0 + T, model.tiles(D)[0], model.query_blocks_descending):  # one tile's rows
        tile = _QueryTile(a0, a1, row0)
        dq[..., tile.rows, :] = _query_tile_gradients(tile, q, k, v, do, lse, delta, grads, config, model,
                                                      exp_form, mma_k, causal=causal, scale=scale)
    dk, dv = grads
    if not model.scale_in_ds:
        dq, dk = dq * alpha, dk * alpha
    return delta, cast(dq, fmt), cast(dk, fmt), cast(dv, fmt)


def _check_supported(config: ReplayConfig, mask: Optional[torch.Tensor]) -> None:
    """Refuse, in one line, what the kernel backward models do not model: a mask, inputs other than bf16/fp16."""
    if mask is not None:
        raise ConfigError(f"ReplayConfig.backward_kernel={config.backward_kernel.value} does not model SDPA's "
                          "attn_mask; use backward_kernel=reference (on the command line: a --preset without a "
                          "kernel backward, such as bf16-hw)")
    if config.input_dtype not in (Precision.BF16, Precision.FP16):
        raise ConfigError(f"ReplayConfig.backward_kernel={config.backward_kernel.value} models a kernel of bf16 or "
                          f"fp16 inputs, not input_dtype={config.input_dtype.value}")


@dataclass(frozen=True)
class _QueryTile:
    """One tile of query rows: absolute rows [a0, a1) of the attention, rows a0 − row0 .. of this call."""

    a0: int
    a1: int
    row0: int

    @property
    def rows(self) -> slice:
        return slice(self.a0 - self.row0, self.a1 - self.row0)


def _query_tile_gradients(tile: _QueryTile, q, k, v, do, lse, delta, grads: list, config: ReplayConfig,
                          model, exp_form: str, mma_k: Optional[int], *, causal: bool, scale: float) -> torch.Tensor:
    """One query tile: P, dP, P̄ and dS of its rows; dV and dK (grads, in place) accumulate P̄ᵀ dO and dSᵀ Q;
    returns the tile's dQ rows, dS K over the key tiles in the kernel's order (chained or added)."""
    fmt, acc_model, gpu = config.input_dtype, config.accumulation, config.gpu
    rows, N = tile.rows, k.shape[-2]
    alpha = torch.tensor(scale, dtype=torch.float32)
    unit = kernel_ops.unit_functions(config.exp_unit)
    S = mm(q[..., rows, :], k.transpose(-1, -2), acc_model, gpu, fmt, mma_k=mma_k)  # (B, H, R, N)
    P = _probs(S, lse[..., rows], scale, exp_form, unit.exp2, unit.exp)
    if causal:
        hidden = torch.arange(N).unsqueeze(0) > torch.arange(tile.a0, tile.a1).unsqueeze(-1)  # (R, N)
        P = P.masked_fill(hidden, 0.0)
    P = torch.where(torch.isneginf(lse[..., rows]).unsqueeze(-1), torch.zeros_like(P), P)  # rows that see no key
    dP = mm(do[..., rows, :], v.transpose(-1, -2), acc_model, gpu, fmt, mma_k=mma_k)  # (B, H, R, N)
    p_bar = cast(P, fmt)
    diff = dP - delta[..., rows].unsqueeze(-1)
    ds = diff * p_bar if model.ds_reads_p_bar else P * diff
    dS = cast(ds * alpha if model.scale_in_ds else ds, fmt)  # (B, H, R, N)
    grads[1] = mm(p_bar.transpose(-1, -2), do[..., rows, :], acc_model, gpu, fmt, acc=grads[1], mma_k=mma_k)
    grads[0] = mm(dS.transpose(-1, -2), q[..., rows, :], acc_model, gpu, fmt, acc=grads[0], mma_k=mma_k)
    dq_r = torch.zeros(*dS.shape[:-1], k.shape[-1])
    for j0, j1 in _blocks(0, N, model.tiles(k.shape[-1])[1], model.dq_keys_descending):
        if causal and j0 >= tile.a1:
            continue  # a tile the mask hides entirely: the kernels skip it
        if model.dq_chained:
            dq_r = mm(dS[..., j0:j1], k[..., j0:j1, :], acc_model, gpu, fmt, acc=dq_r, mma_k=mma_k)
        else:
            dq_r = dq_r + mm(dS[..., j0:j1], k[..., j0:j1, :], acc_model, gpu, fmt, mma_k=mma_k)
    return dq_r


def _blocked(x: torch.Tensor, row0: int, rows: int, size: int) -> torch.Tensor:
    """x (B, H, T, ...) placed at rows row0.. of `rows` zero rows, viewed as (B, H, rows // size, size, ...)."""
    out = x.new_zeros(x.shape[:2] + (rows,) + x.shape[3:])
    out[:, :, row0:row0 + x.shape[2]] = x
    return out.reshape(x.shape[:2] + (rows // size, size) + x.shape[3:])


def _waves(order: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`order` cut into runs with no query block and no key block twice: each run is one batched step."""
    waves, rows, cols = [], set(), set()
    for i, j in order:
        if not waves or i in rows or j in cols:
            waves.append([])
            rows, cols = set(), set()
        waves[-1].append((i, j))
        rows.add(i)
        cols.add(j)
    return waves


def _scheduled_gradients(q, k, v, do, lse, delta, config: ReplayConfig, model: KernelModel, exp_form: str,
                         mma_k: Optional[int], *, causal: bool, scale: float, row0: int, num_queries: int):
    """dQ, dK, dV (fp32 accumulators) with the tiles run in the kernel's CTA order (efficient_schedule): each key
    block's dK, dV continued over its CTA's walk, each query block's dQ continued over the key blocks in the
    order the CTAs reach it. Rows outside row0 .. row0 + T − 1 and keys past N are absent: P̄ = dS = 0 there."""
    fmt, acc_model, gpu = config.input_dtype, config.accumulation, config.gpu
    unit = kernel_ops.unit_functions(config.exp_unit)
    (B, H, T, D), N = q.shape, k.shape[-2]
    tile = efficient_schedule.backward_tile(D)
    bi, bj = tile.queries, tile.keys
    splits = config.bwd_key_splits or efficient_schedule.key_splits(B, H, N, tile)
    n_i, n_j = math.ceil(num_queries / bi), math.ceil(N / bj)
    rows, keys = n_i * bi, n_j * bj
    qb, dob = _blocked(q, row0, rows, bi), _blocked(do, row0, rows, bi)  # (B, H, n_i, bi, D)
    lseb = _blocked(lse, row0, rows, bi)
    deltab = _blocked(delta, row0, rows, bi)
    present = _blocked(torch.ones(1, 1, T, dtype=torch.bool), row0, rows, bi)[0, 0]  # (n_i, bi)
    kb, vb = _blocked(k, 0, keys, bj), _blocked(v, 0, keys, bj)  # (B, H, n_j, bj, D)
    dqb, dkb, dvb = torch.zeros(qb.shape), torch.zeros(kb.shape), torch.zeros(vb.shape)
    alpha = torch.tensor(scale, dtype=torch.float32)
    order = [(i, j) for i, j in efficient_schedule.tile_order(num_queries, N, tile, splits, causal)
             if present[i].any()]
    for wave in _waves(order):
        ii, jj = torch.tensor([i for i, _ in wave]), torch.tensor([j for _, j in wave])
        qt, dot, kt, vt = qb[:, :, ii], dob[:, :, ii], kb[:, :, jj], vb[:, :, jj]  # (B, H, W, bi|bj, D)
        row_idx = (ii * bi).unsqueeze(-1) + torch.arange(bi)  # (W, bi) absolute rows
        key_idx = (jj * bj).unsqueeze(-1) + torch.arange(bj)  # (W, bj)
        seen = present[ii].unsqueeze(-1) & (key_idx < N).unsqueeze(-2)  # (W, bi, bj)
        if causal:
            seen = seen & (key_idx.unsqueeze(-2) <= row_idx.unsqueeze(-1))
        S = mm(qt, kt.transpose(-1, -2), acc_model, gpu, fmt, mma_k=mma_k)  # (B, H, W, bi, bj)
        lse_t = lseb[:, :, ii]
        P = _probs(S, lse_t, scale, exp_form, unit.exp2, unit.exp)
        P = torch.where(seen & ~torch.isneginf(lse_t).unsqueeze(-1), P, torch.zeros_like(P))
        dP = mm(dot, vt.transpose(-1, -2), acc_model, gpu, fmt, mma_k=mma_k)
        p_bar = cast(P, fmt)
        diff = dP - deltab[:, :, ii].unsqueeze(-1)
        ds = diff * p_bar if model.ds_reads_p_bar else P * diff
        dS = cast(ds * alpha if model.scale_in_ds else ds, fmt)
        dS = torch.where(seen, dS, torch.zeros_like(dS))
        dvb[:, :, jj] = mm(p_bar.transpose(-1, -2), dot, acc_model, gpu, fmt, acc=dvb[:, :, jj], mma_k=mma_k)
        dkb[:, :, jj] = mm(dS.transpose(-1, -2), qt, acc_model, gpu, fmt, acc=dkb[:, :, jj], mma_k=mma_k)
        dqb[:, :, ii] = mm(dS, kt, acc_model, gpu, fmt, acc=dqb[:, :, ii], mma_k=mma_k)
    dq = dqb.reshape(B, H, rows, D)[:, :, row0:row0 + T]
    dk, dv = dkb.reshape(B, H, keys, D)[:, :, :N], dvb.reshape(B, H, keys, D)[:, :, :N]
    if not model.scale_in_ds:
        dq, dk = dq * alpha, dk * alpha
    return dq, dk, dv
