"""Accumulation models of a matrix product: `ieee` and `tensor-core`.

Both take a (..., M, K) and b (..., K, N) holding exact values of low-precision inputs and
return fp32. Products are exact (a 24-bit × 24-bit product fits in fp64's 53 bits).

- `ieee`: acc_k = fp32(acc_{k-1} + a_k b_k) for k = 0 .. K−1 in order: a fused multiply-add,
  one round-to-nearest-even per term. When every product is exact in fp32 (inputs of at most 12
  significant bits, exponents in range: bf16, fp16, fp8) this is `addcmul_` in fp32; otherwise
  the sum is formed in fp64 with TwoSum and rounded to odd, then to fp32, which is one correct
  rounding (53 ≥ 24 + 2 bits).
- `tensor-core`: the model of Khattak & Mikaitis, "Accurate Models of NVIDIA Tensor Cores"
  (arXiv 2512.07004). K is walked in groups of F. In each group the F exact products and the
  running accumulator are aligned to the largest exponent e_max among them (exponent =
  floor(log2|term|)), keeping 24 + neab significand bits, i.e. bits of weight ≥
  2^(e_max − 23 − neab); bits shifted out are truncated (toward zero, no sticky bit); the
  aligned integers are summed exactly; the sum is normalized and rounded toward zero to fp32,
  which becomes the accumulator of the next group. fp32 inputs fall back to `ieee`.

Python loops run only over K (ieee) or over groups of K (tensor-core); rows are processed in
chunks so the working set stays around `_CHUNK_BYTES`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.numerics.formats import FormatLike, get_format
from fa_forensics.numerics.rounding import round_to

ACCUMULATIONS = ("ieee", "tensor-core")
_CHUNK_BYTES = 256 * 2**20  # target size of the largest temporary per row chunk


@dataclass(frozen=True)
class TensorCoreParams:
    """F: products summed per alignment group; neab: extra accumulator bits beyond fp32's 24."""

    gpu: str
    in_format: str
    F: int
    neab: int


_TC_PARAMS = {
    ("a100", "bf16"): (8, 1),
    ("a100", "fp16"): (8, 1),
    ("h100", "bf16"): (16, 2),
    ("h100", "fp16"): (16, 2),
    ("h100", "fp8_e4m3"): (32, -10),
    ("h100", "fp8_e5m2"): (32, -10),
}


def _name(x) -> str:
    return (x.value if isinstance(x, enum.Enum) else str(x)).strip().lower()


def normalize_accumulation(accumulation) -> str:
    """Resolve "ieee" / "tensor-core" (or an `Accumulation` enum)."""
    name = _name(accumulation).replace("_", "-")
    if name == "tensorcore":
        name = "tensor-core"
    if name not in ACCUMULATIONS:
        raise ConfigError(f"unknown accumulation model {accumulation!r}; use one of {', '.join(ACCUMULATIONS)}")
    return name


def tensor_core_params(gpu="h100", in_format: FormatLike = "bf16") -> Optional[TensorCoreParams]:
    """(F, neab) of the tensor-core model for (gpu, input format); None for fp32 inputs (ieee fallback)."""
    fmt = get_format(in_format).name
    if fmt == "fp32":
        return None
    key = (_name(gpu), fmt)
    if key not in _TC_PARAMS:
        known = ", ".join(f"{g}/{f}" for g, f in _TC_PARAMS)
        raise ConfigError(f"no tensor-core model for gpu={key[0]} with {fmt} inputs; known: {known}")
    F, neab = _TC_PARAMS[key]
    return TensorCoreParams(key[0], fmt, F, neab)


# ---------------------------------------------------------------------------------------------
# one step of each model (shared by matmul and dot_trace)


def ieee_fma_step(acc: torch.Tensor, prod: torch.Tensor) -> torch.Tensor:
    """fp32(acc + prod) with one rounding, for fp64 tensors holding an fp32 acc and an exact product; returns fp64."""
    s = acc + prod
    bb = s - acc
    err = (acc - (s - bb)) + (prod - bb)  # TwoSum: s + err == acc + prod exactly
    bits = s.view(torch.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0)
    away = (err > 0) == (s > 0)  # true value lies farther from zero than s
    bits = torch.where(inexact_even, bits + torch.where(away, 1, -1), bits)  # round to odd
    return bits.view(torch.float64).to(torch.float32).to(torch.float64)


def tensor_core_group(acc: torch.Tensor, prods: torch.Tensor, neab: int) -> torch.Tensor:
    """One group of the tensor-core model.

    acc (...) the fp32 accumulator (any float dtype holding fp32 values); prods (F, ...) the
    group's exact products, stacked in dim 0 (fp32 or fp64, exact; overwritten in place).
    Returns the new accumulator (...) as fp64 holding an fp32 value.
    """
    acc = acc.to(torch.float64)
    top = torch.maximum(prods.amax(dim=0).abs(), prods.amin(dim=0).abs()).to(torch.float64)
    top = torch.maximum(top, acc.abs())  # (...) the largest |term|
    e_max = ((top.view(torch.int64) >> 52) & 2047) - 1023  # floor(log2 top); zeros give -1023
    q_exp = e_max.clamp(min=-900) - (23 + neab)  # weight of the last kept bit: 2^q_exp
    scale = ((1023 - q_exp) << 52).view(torch.float64)  # 2^-q_exp, built from its bit pattern
    # exact power-of-two scaling, then truncation of the shifted-out bits (toward zero, no sticky):
    # float -> int conversion truncates toward zero; the sum of F integers < 2^(24 + neab) fits int32
    if prods.dtype == torch.float32:  # products >= 2^-80 when nonzero: a clamped scale only meets zeros
        aligned = prods.mul_(scale.clamp(max=2.0**126).to(torch.float32)).to(torch.int32)
        total = aligned.sum(dim=0, dtype=torch.int32).to(torch.float64)
    else:
        total = prods.mul_(scale).to(torch.int64).sum(dim=0).to(torch.float64)
    total = total + torch.trunc(acc * scale)  # the accumulator, aligned the same way; exact in fp64
    return _rz_fp32(total * (1.0 / scale))


_RZ_MASK = ~((1 << 29) - 1)  # fp64 keeps 52 fraction bits, fp32 23: clear the low 29


def _rz_fp32(x: torch.Tensor) -> torch.Tensor:
    """Round fp64 values toward zero to fp32 (fp64 result): clear the low 29 fraction bits;
    values outside fp32's normal range take the general path."""
    y = (x.view(torch.int64) & _RZ_MASK).view(torch.float64)
    ay = y.abs()
    if bool(((ay > _FP32_MAX) | ((ay < 2.0**-126) & (ay > 0))).any()):
        return round_to(x, "fp32", "toward-zero")
    return y


_FP32_MAX = (2 - 2.0**-23) * 2.0**127


# ---------------------------------------------------------------------------------------------
# matmul


def _products_exact_in_fp32(*xs: torch.Tensor) -> bool:
    """True when every value is an fp32 number with at most 12 significant bits and |x| in
    [2^-40, 2^40] (or 0), so every product is exact in fp32, normal, and scalable by the
    tensor-core model's alignment factor without leaving fp32's range."""
    for x in xs:
        x32 = x.to(torch.float32)
        if x.dtype != torch.float32 and not torch.equal(x32.to(x.dtype), x):
            return False
        if bool(((x32.view(torch.int32) & 0xFFF) != 0).any()):  # more than 12 significant bits
            return False
        ax = x32.abs()
        if x32.numel() and not (bool(ax.max() <= 2.0**40) and bool(torch.where(ax > 0, ax, 1.0).min() >= 2.0**-40)):
            return False
    return True


def _row_chunk(rows: int, bytes_per_row: int) -> int:
    return max(1, min(rows, _CHUNK_BYTES // max(1, bytes_per_row)))


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    accumulation="ieee",
    *,
    gpu="h100",
    in_format: FormatLike = "bf16",
    acc: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N) under an accumulation model; returns fp32 (..., M, N).

    a and b hold exact values of `in_format` inputs (any float dtype). `acc` (..., M, N) is an
    optional starting fp32 accumulator (the running O of flash attention, say).
    """
    model = normalize_accumulation(accumulation)
    if a.shape[-1] != b.shape[-2]:
        raise ConfigError(f"matmul: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    a = a.expand(*lead, M, K)
    b = b.expand(*lead, K, N)
    if acc is None:
        acc = torch.zeros(*lead, M, N, dtype=torch.float32)
    else:
        acc = acc.to(torch.float32).expand(*lead, M, N)
    params = tensor_core_params(gpu, in_format) if model == "tensor-core" else None
    exact32 = _products_exact_in_fp32(a, b)
    lead_n = 1
    for d in lead:
        lead_n *= d

    out = torch.empty(*lead, M, N, dtype=torch.float32)
    if params is None:  # ieee (or fp32 inputs under tensor-core)
        chunk = _row_chunk(M, lead_n * N * 8 * 4)
        for m0 in range(0, M, chunk):
            rows = slice(m0, m0 + chunk)
            out[..., rows, :] = _ieee_rows(a[..., rows, :], b, acc[..., rows, :], exact32)
    else:
        work = torch.float32 if exact32 else torch.float64
        per_row = lead_n * N * (params.F * (4 if exact32 else 8) + 8 * 8)
        chunk = _row_chunk(M, per_row)
        for m0 in range(0, M, chunk):
            rows = slice(m0, m0 + chunk)
            out[..., rows, :] = _tensor_core_rows(a[..., rows, :], b, acc[..., rows, :], params, work)
    return out


def _ieee_rows(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, exact32: bool) -> torch.Tensor:
    """ieee model on a row chunk: a (..., m, K), b (..., K, N), acc (..., m, N) → fp32 (..., m, N)."""
    K = a.shape[-1]
    if exact32:
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        at = a32.transpose(-1, -2).contiguous()  # (..., K, m): column k is contiguous
        out = acc.to(torch.float32).clone()
        for k in range(K):  # products exact in fp32: one rounding per add, FMA or not
            out.addcmul_(at[..., k, :].unsqueeze(-1), b32[..., k : k + 1, :])
        return out
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    out = acc.to(torch.float64).clone()
    for k in range(K):
        out = ieee_fma_step(out, a64[..., :, k : k + 1] * b64[..., k : k + 1, :])
    return out.to(torch.float32)


def _tensor_core_rows(a, b, acc, params: TensorCoreParams, work: torch.dtype) -> torch.Tensor:
    """tensor-core model on a row chunk: a (..., m, K), b (..., K, N), acc (..., m, N) → fp32 (..., m, N)."""
    K = a.shape[-1]
    at = a.to(work).transpose(-1, -2).contiguous()  # (..., K, m): column k is contiguous
    bw = b.to(work)  # (..., K, N)
    out = acc.to(torch.float64)
    buf = torch.empty(params.F, *out.shape, dtype=work)  # (F, ..., m, N) the group's products
    for k0 in range(0, K, params.F):
        n = min(params.F, K - k0)
        for i in range(n):  # outer product of column k of a and row k of b: exact in `work`
            torch.mul(at[..., k0 + i, :].unsqueeze(-1), bw[..., k0 + i : k0 + i + 1, :], out=buf[i])
        out = tensor_core_group(out, buf[:n], params.neab)
    return out.to(torch.float32)


def dot_trace(
    p: torch.Tensor,
    v: torch.Tensor,
    accumulation="ieee",
    *,
    gpu="h100",
    in_format: FormatLike = "bf16",
) -> torch.Tensor:
    """The accumulator of Σ_k p_k v_k after every term, fp32 (K,).

    ieee: the value after term k. tensor-core: the value after each group of F terms, repeated
    over the group's positions (the hardware exposes nothing in between).
    """
    model = normalize_accumulation(accumulation)
    if p.dim() != 1 or p.shape != v.shape:
        raise ConfigError(f"dot_trace needs two vectors of one length K; got {tuple(p.shape)} and {tuple(v.shape)}")
    prods = p.to(torch.float64) * v.to(torch.float64)  # (K,) exact
    K = prods.shape[0]
    trace = torch.empty(K, dtype=torch.float64)
    params = tensor_core_params(gpu, in_format) if model == "tensor-core" else None
    acc = torch.zeros((), dtype=torch.float64)
    if params is None:
        for k in range(K):
            acc = ieee_fma_step(acc, prods[k])
            trace[k] = acc
    else:
        for k0 in range(0, K, params.F):
            acc = tensor_core_group(acc, prods[k0 : k0 + params.F].clone(), params.neab)
            trace[k0 : k0 + params.F] = acc
    return trace.to(torch.float32)
