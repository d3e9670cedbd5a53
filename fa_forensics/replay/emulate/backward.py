"""FlashAttention-2 backward pass with explicit rounding.

Inputs q, k, v, dO (B, H, T, D) are fp32 tensors holding values of config.input_dtype; lse is
the forward's. Every accumulation below walks its reduction dimension in order 0..K-1, which is
what FA2's block loop does with a chained fp32 accumulator (for the tensor-core model: as long
as block sizes are multiples of the group size F). Query rows are processed in blocks (block_m)
only to bound memory; the result does not depend on the block size.

 1. s = fp32(α · q kᵀ) (mm, causal mask -inf); P = exp(fp32(s - lse))  fp32, 0 where masked
 2. dP = cast(dO Vᵀ, dp_dtype) (mm, in_format = input_dtype)
 3. δ per config.delta, a row-wise dot product on CUDA cores (ieee model, order 0..D-1 / 0..T-1):
      o-lowp:        rowsum(cast(dO ∘ O_lp, delta_dtype)), O_lp the forward's O in o_dtype
      o-highp:       rowsum(cast(dO ∘ O_hp, delta_dtype)), O_hp from the same forward with p/pv/o casts in fp32
      o-recomputed:  rowsum(dO ∘ O_rec), O_rec = P V in fp32 (P already holds 1/ℓ)
      dp-p:          rowsum(dP ∘ P)
 4. dS = cast(fp32(P · fp32(dP - δ)), ds_dtype)  (nearest-even);
    ds_alpha: dS = cast(fp32(fp32(P · α) · fp32(dP - δ)), ds_dtype) (the reference code's order)
 5. dQ = fp32(α · mm(dS, K)); dK = fp32(α · mm(dSᵀ, Q))   (ds_alpha: no α here)
 6. dV = mm(P̄ᵀ, dO) with P̄ = cast(fp32(P · S), p_dtype) (nearest-even, as FA2's p.to(dtype));
    divided by the P scale S when S ≠ 1.
grad_dtype below fp32 (the reference code's bf16 buffers): steps 5-6 run per (query block i,
KV block j) of config.block_m × block_n, i outer and j inner as the reference loops; each block
product is cast to grad_dtype and added into the dQ_i, dK_j, dV_j buffers with one grad_dtype
rounding. Query rows then go in the config's blocks (not the memory plan's). Blocks a causal mask
hides entirely add ±0 and are skipped (exactly a no-op).

config.backward_kernel other than "reference": the named kernel's backward instead
(`backward_kernels.kernel_backward`, on the forward's stored O), none of the steps above.

Steps 1, 4 and (for dp-p) 3 run as compiled passes per row (`fused.backward_probs`,
`fused.backward_ds`) where `fused.eligible` says so, bit for bit the torch code's.

The code follows these steps: `backward` runs, per block of query rows, steps 1-4 (`_row_block` in torch,
`_compiled_row_block` compiled; step 3 is `_delta`), then steps 5-6 (`_accumulate_grads`, or
`_add_block_products` for grad_dtype below fp32); `_finish` applies α and 1/S once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fa_forensics.numerics import exp_fp32
from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import Accumulation, BackwardKernel, DeltaSource, Precision, ReplayConfig
from fa_forensics.replay.emulate import fused
from fa_forensics.replay.emulate.backward_kernels import kernel_backward
from fa_forensics.replay.emulate import softcap
from fa_forensics.replay.emulate.forward import scaled_scores
from fa_forensics.replay.emulate.ops import Band, cast, mm, wider


@dataclass(frozen=True)
class Backward:
    """Gradients and δ of one backward pass, all fp32."""

    delta: torch.Tensor  # (B, H, T)
    dq: torch.Tensor  # (B, H, T, D)
    dk: torch.Tensor  # (B, H, T, D)
    dv: torch.Tensor  # (B, H, T, D)


def row_dot(a: torch.Tensor, b: torch.Tensor, config: ReplayConfig) -> torch.Tensor:
    """Σ_n a[..., n] b[..., n] per row in fp32 (ieee, order 0..N-1); (B, H, T, N) x2 -> (B, H, T)."""
    out = mm(a.unsqueeze(-2), b.unsqueeze(-1), Accumulation.IEEE, config.gpu, Precision.FP32)  # (B, H, T, 1, 1)
    return out[..., 0, 0]


def query_blocks(n_rows: int, block_m: int | None) -> list[tuple[int, int]]:
    """[start, stop) of each block of query rows (None = one block)."""
    size = block_m or max(n_rows, 1)
    return [(i0, min(i0 + size, n_rows)) for i0 in range(0, n_rows, size)]


@dataclass
class _BackwardState:
    """One backward call: its inputs and the gradients the query blocks fill (dQ, δ per row) or carry
    from block to block (dK, dV: Σ over the rows so far of dSᵀ Q and P̄ᵀ dO, before α and 1/S)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    lse: torch.Tensor
    config: ReplayConfig
    causal: bool
    scale: float
    o_for_delta: torch.Tensor | None
    mask: torch.Tensor | None
    use_fused: bool  # steps 1, 4 (and 3 for dp-p) compiled
    reference_blocks: bool  # grad_dtype below fp32: per (query block, KV block) products in grad_dtype buffers
    delta: torch.Tensor  # (B, H, T)
    dq: torch.Tensor  # (B, H, T, D)
    dk: torch.Tensor | None = None  # (B, H, T, D)
    dv: torch.Tensor | None = None

    @property
    def alpha(self) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float32)

    @property
    def p_scale(self) -> torch.Tensor:
        return torch.tensor(float(self.config.p_scale), dtype=torch.float32)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             config: ReplayConfig, *, causal: bool, scale: float, o_for_delta: torch.Tensor | None,
             block_m: int | None = None, mask: torch.Tensor | None = None) -> Backward:
    """The FA2 backward of the module docstring.

    o_for_delta (B, H, T, D) fp32: the O that δ uses for o-lowp / o-highp (None for the others).
    mask: SDPA's attn_mask broadcastable to (B, H, T, Tk), or None.
    block_m: query rows per block (None = all): the (B, H, block_m, T) temporaries bound the
    memory. dQ and δ are per row; dK and dV sum over rows, so their accumulators are carried
    from block to block in row order (`mm(..., acc=)`), which is the same chain of roundings as
    one pass as long as block_m is a multiple of the tensor-core group size F (checked).
    A named config.backward_kernel reads o_for_delta as the forward's stored O and ignores block_m.
    """
    if config.backward_kernel is not BackwardKernel.REFERENCE:
        if config.softcap is not None:
            raise ConfigError(f"ReplayConfig.backward_kernel={config.backward_kernel.value} has no soft-cap model; "
                              "replay a soft-capped layer's backward with backward_kernel=reference")
        if o_for_delta is None:
            raise ConfigError(f"ReplayConfig.backward_kernel={config.backward_kernel.value} needs the forward's O")
        delta, dq, dk, dv = kernel_backward(q, k, v, do, o_for_delta, lse, config, causal=causal, scale=scale,
                                            mask=mask)
        return Backward(delta=delta, dq=dq, dk=dk, dv=dv)
    reference_blocks = config.grad_dtype is not Precision.FP32
    if reference_blocks:  # the bf16 buffers are added to per (query block, KV block) of the config
        block_m = config.block_m
    elif block_m is not None and block_m % _MAX_GROUP:
        raise ValueError(f"block_m={block_m} must be a multiple of {_MAX_GROUP} (the tensor-core groups)")
    st = _BackwardState(q=q, k=k, v=v, do=do, lse=lse, config=config, causal=causal, scale=scale,
                        o_for_delta=o_for_delta, mask=mask, reference_blocks=reference_blocks,
                        use_fused=fused.eligible(config, q, k, v, do, scale=scale, mask=mask),
                        delta=torch.empty(lse.shape), dq=torch.empty(q.shape))
    if reference_blocks:
        st.dk, st.dv = torch.zeros(k.shape), torch.zeros(v.shape)  # grad_dtype buffers
    for i0, i1 in query_blocks(q.shape[-2], block_m):
        if st.use_fused:
            dS, p_bar = _compiled_row_block(st, i0, i1)
        else:
            dS, p_bar = _row_block(st, i0, i1)
        if reference_blocks:
            st.dq[..., i0:i1, :] = _add_block_products(q, k, do[..., i0:i1, :], dS, p_bar, st.dk, st.dv, config,
                                                       i0, i1, causal=causal, qk_fmt=_qk_format(config),
                                                       pv_fmt=_pv_format(config))
        else:
            _accumulate_grads(st, i0, i1, dS, p_bar)
    return _finish(st)


def _qk_format(config: ReplayConfig) -> Precision:
    """The in_format of dS K and dSᵀ Q."""
    return wider(config.ds_dtype, config.input_dtype)


def _pv_format(config: ReplayConfig) -> Precision:
    """The in_format of P̄ᵀ dO."""
    return wider(config.p_dtype, config.input_dtype)


def _rows_mask(st: _BackwardState, i0: int, i1: int) -> torch.Tensor | None:
    """The attn_mask of query rows i0:i1 over every key, or None."""
    if st.mask is None:
        return None
    return st.mask.expand(*st.q.shape[:3], st.k.shape[-2])[..., i0:i1, :]


def _sees(st: _BackwardState, i0: int) -> int | None:
    """Row i of the block at i0 sees keys j < i + sees (None: not causal); P, P̄ and dS are ±0 beyond."""
    return i0 + 1 if st.causal else None


def _row_block(st: _BackwardState, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 and step 6's P̄ in torch for query rows i0:i1: P, dP, δ (stored), dS -> (dS, P̄)."""
    config, rows = st.config, slice(i0, i1)
    do_r = st.do[..., rows, :]
    s = scaled_scores(st.q[..., rows, :], st.k, config, st.scale, st.causal, i0, 0, _rows_mask(st, i0, i1))
    P = exp_fp32(s - st.lse[..., rows].unsqueeze(-1))  # step 1: (B, H, R, T) fp32, normalized
    if st.mask is not None:  # rows with no allowed key (lse -inf): no probability, no gradient
        P = torch.where(torch.isneginf(st.lse[..., rows]).unsqueeze(-1), torch.zeros_like(P), P)
    dP = cast(mm(do_r, st.v.transpose(-1, -2), config.accumulation, config.gpu, config.input_dtype,
                 mma_k=config.mma_k), config.dp_dtype)  # step 2: (B, H, R, T)
    delta_r = _delta(P, do_r, st.v, st.o_for_delta, rows, config, dP)  # step 3
    P_ds = P * st.alpha if config.ds_alpha else P
    if config.softcap is not None:  # the gradient of cap·tanh(x / cap) on its way to the scaled scores x
        unmasked = scaled_scores(st.q[..., rows, :], st.k, config, st.scale, False, i0, 0, None)
        P_ds = P_ds * softcap.derivative(unmasked, config.softcap)
    dS = cast(P_ds * (dP - delta_r.unsqueeze(-1)), config.ds_dtype)  # step 4: (B, H, R, T)
    st.delta[..., rows] = delta_r
    return dS, cast(P * st.p_scale if config.p_scale != 1.0 else P, config.p_dtype)


def _compiled_row_block(st: _BackwardState, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1 and 4 (and 3 for dp-p) as compiled passes per row (`fused.backward_probs`, `fused.backward_ds`:
    the same operations, bit for bit) for query rows i0:i1 -> (dS, P̄); δ stored."""
    config, rows = st.config, slice(i0, i1)
    acc_model, gpu, x_fmt = config.accumulation, config.gpu, config.input_dtype
    do_r = st.do[..., rows, :]
    S = mm(st.q[..., rows, :], st.k.transpose(-1, -2), acc_model, gpu, x_fmt, band=Band(n_hi=_sees(st, i0)),
           finite_operands=True, mma_k=config.mma_k)  # (B, H, R, T) raw q kᵀ, 0 for unseen keys
    P = fused.backward_probs(S, st.lse[..., rows], _rows_mask(st, i0, i1), config, scale=st.scale, row0=i0,
                             causal=st.causal)
    delta_r = None if config.delta is DeltaSource.DP_P else _delta(P, do_r, st.v, st.o_for_delta, rows, config,
                                                                   None)
    # dP in full: the sign of a zero dS (P · (dP − δ) with P = +0) is dP's, and the chains of
    # dQ and dK read it where they end at ±0
    dP_raw = mm(do_r, st.v.transpose(-1, -2), acc_model, gpu, x_fmt, finite_operands=True,
                mma_k=config.mma_k)  # (B, H, R, T)
    dS, p_bar, delta_r = fused.backward_ds(P, dP_raw, delta_r, config, scale=st.scale)
    st.delta[..., rows] = delta_r
    return dS, p_bar


def _accumulate_grads(st: _BackwardState, i0: int, i1: int, dS: torch.Tensor, p_bar: torch.Tensor) -> None:
    """Steps 5-6 with fp32 gradients for query rows i0:i1: dQ rows = mm(dS, K); dK += mm(dSᵀ, Q) and
    dV += mm(P̄ᵀ, dO) carried in row order (α and 1/S applied at the end). With the compiled stages, dS and
    P̄ are 0 for the keys a row cannot see: those terms are skipped (the same bits)."""
    config, rows = st.config, slice(i0, i1)
    acc_model, gpu, mk = config.accumulation, config.gpu, config.mma_k
    sees, use_fused = _sees(st, i0), st.use_fused
    row_band = Band(k_hi=sees) if use_fused else None  # dQ row i: keys k < i + sees
    key_band = Band(k_lo=None if sees is None else 1 - sees) if use_fused else None  # dK, dV row j: rows ≥ j − i0
    ds_finite = use_fused and config.ds_dtype in _FP32_RANGE  # |dS| ≤ |dP − δ| < 2^101 (`fused.eligible`)
    qk_fmt = _qk_format(config)
    st.dq[..., rows, :] = mm(dS, st.k, acc_model, gpu, qk_fmt, band=row_band, finite_operands=ds_finite, mma_k=mk)
    st.dk = mm(dS.transpose(-1, -2), st.q[..., rows, :], acc_model, gpu, qk_fmt, acc=st.dk, band=key_band,
               finite_operands=ds_finite, mma_k=mk)
    st.dv = mm(p_bar.transpose(-1, -2), st.do[..., rows, :], acc_model, gpu, _pv_format(config), acc=st.dv,
               band=key_band, finite_operands=use_fused, mma_k=mk)


def _finish(st: _BackwardState) -> Backward:
    """Step 5's α (unless ds_alpha put it in dS) and step 6's 1/S, applied once to the summed gradients."""
    dq, dk, dv = st.dq, st.dk, st.dv
    if dk is None:  # no query rows
        dk, dv = torch.zeros(st.k.shape), torch.zeros(st.v.shape)
    if not st.config.ds_alpha:
        dq, dk = dq * st.alpha, dk * st.alpha
    if st.config.p_scale != 1.0:
        dv = dv / st.p_scale
    return Backward(delta=st.delta, dq=dq, dk=dk, dv=dv)


def _delta(P: torch.Tensor, do_r: torch.Tensor, v: torch.Tensor, o_for_delta: torch.Tensor | None, rows: slice,
           config: ReplayConfig, dP: torch.Tensor | None) -> torch.Tensor:
    """δ (B, H, R) of step 3 for the query rows `rows`; dP (the cast dO Vᵀ) only for dp-p."""
    if config.delta is DeltaSource.DP_P:
        return row_dot(dP, P, config)
    if config.delta is DeltaSource.O_RECOMPUTED:
        o_rec = mm(P, v, config.accumulation, config.gpu, Precision.FP32)  # (B, H, R, D) fp32
        return row_dot(do_r, o_rec, config)
    if o_for_delta is None:
        raise ValueError("o_for_delta is required for delta sources o-lowp and o-highp")
    o_r = o_for_delta[..., rows, :]
    if config.delta_dtype is Precision.FP32:  # fused multiply-adds of the exact products
        return row_dot(do_r, o_r, config)
    return row_dot(cast(do_r * o_r, config.delta_dtype), torch.ones_like(do_r), config)  # the product rounded first


_MAX_GROUP = 32  # the largest tensor-core group F (fp8 on H100)
_FP32_RANGE = (Precision.FP32, Precision.BF16)  # formats that cannot overflow on values below 2^127


def _add_block_products(q, k, do_r, dS, p_bar, dk, dv, config: ReplayConfig, i0: int, i1: int, *,
                        causal: bool, qk_fmt: Precision, pv_fmt: Precision) -> torch.Tensor:
    """One query block i (rows i0:i1) of the grad_dtype path: for each KV block j in order, the
    block products cast to grad_dtype and added into dQ_i (returned), dK_j, dV_j (in place)."""
    acc_model, gpu, fmt, mk = config.accumulation, config.gpu, config.grad_dtype, config.mma_k
    n_keys = k.shape[-2]
    bn = config.block_n or n_keys
    dq_i = torch.zeros(dS.shape[:-1] + (k.shape[-1],))  # (B, H, R, D)
    for j0 in range(0, n_keys, bn):
        if causal and j0 > i1 - 1:
            break  # every later block is hidden from every row of this query block
        j1 = min(j0 + bn, n_keys)
        ds_ij, p_ij = dS[..., j0:j1], p_bar[..., j0:j1]  # (B, H, R, bn)
        dq_i = cast(dq_i + cast(mm(ds_ij, k[..., j0:j1, :], acc_model, gpu, qk_fmt, mma_k=mk), fmt), fmt)
        dk_ij = mm(ds_ij.transpose(-1, -2), q[..., i0:i1, :], acc_model, gpu, qk_fmt, mma_k=mk)
        dv_ij = mm(p_ij.transpose(-1, -2), do_r, acc_model, gpu, pv_fmt, mma_k=mk)
        dk[..., j0:j1, :] = cast(dk[..., j0:j1, :] + cast(dk_ij, fmt), fmt)
        dv[..., j0:j1, :] = cast(dv[..., j0:j1, :] + cast(dv_ij, fmt), fmt)
    return dq_i
