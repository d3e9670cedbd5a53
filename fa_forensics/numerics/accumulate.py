"""Accumulation models of a matrix product: `ieee` and `tensor-core`.

Both take a (..., M, K) and b (..., K, N) holding exact values of low-precision inputs and
return fp32. Products are exact (a 24-bit × 24-bit product fits in fp64's 53 bits).

- `ieee`: acc_k = fp32(acc_{k-1} + a_k b_k) for k = 0 .. K−1 in order: a fused multiply-add,
  one round-to-nearest-even per term. When every product is exact in fp32 (inputs of at most 12
  significant bits, exponents in range: bf16, fp16, fp8) this is `addcmul_` in fp32; when the
  operands are fp32 numbers (fp32 × bf16 or fp32 × fp32: products exact in fp64) the sum is
  formed in fp64 and converted to fp32, with TwoSum and round-to-odd only where the fp64 sum is
  an fp32 midpoint (accumulate_tiles.ieee_tile_fp64_exact); that is one correct rounding
  (53 ≥ 24 + 2 bits). Anything else (fp64 values outside fp32) takes the fp64 reference step.
- `tensor-core`: the model of Khattak & Mikaitis, "Accurate Models of NVIDIA Tensor Cores"
  (arXiv 2512.07004). K is walked in groups of F. In each group the F exact products and the
  running accumulator are aligned to the largest exponent e_max among them, keeping 24 + neab
  significand bits, i.e. bits of weight ≥ 2^(e_max − 23 − neab); bits shifted out are truncated
  (toward zero, no sticky bit); the aligned integers are summed exactly; the sum is normalized
  and rounded toward zero to fp32 (to 24 + neab significant bits where neab < 0: the H100's fp8 MMA keeps 14),
  which becomes the accumulator of the next group. The exponent
  of a product a·b is the sum of its factors' exponents, floor(log2|a|) + floor(log2|b|), as the
  hardware forms it before normalizing (the significand product in [1, 4) is not renormalized:
  the authors' models, `denorm_prd`), which is one less than floor(log2|a·b|) when the
  significands multiply to 2 or more; the accumulator's is floor(log2|acc|). With that rule the
  model reproduces every published instruction-level output of bf16 and fp16 MMAs on the A100,
  H100 and H200 and of fp8 (E4M3, E5M2) MMAs on the H100 (docs/gpu-fidelity.md). fp32 inputs fall back to `ieee`.

Engines (numerics/engines.py): under `Engine.COMPILED` (the default), where every operand and the
starting accumulator are finite fp32 numbers (what the emulator always passes), the compiled kernels of
`accumulate_jit` run (numba: one hardware fma per term for ieee, the group alignment in fp64 for
tensor-core); anything else (NaN, inf, fp64 values that are not fp32 numbers) and `Engine.SPEC` run the
torch kernels below, the specification the compiled ones are tested against bit for bit.

Speed of the torch kernels (accumulate_tiles): the output is cut into tiles of rows whose temporaries are about
`_CHUNK_BYTES` (cache-sized); Python loops run over tiles and K (ieee) or groups of K
(tensor-core). Where products are exact in fp32 (bf16 / fp16 / fp8 values) the kernels work in
fp32 / int32 (ieee: one `addcmul_` per k; tensor-core: exponents and scales from bit patterns,
int32 sums); elsewhere (fp32 inputs, terms below 2^-100, inputs near overflow) the fp64
reference steps below run, tile by tile. Both give the same bits (tested). The kernels run on
one intra-op thread (`_one_thread`): more threads only slow these many small ops down.
"""
from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.enums import ACCUMULATIONS, Accumulation, Engine
from fa_forensics.numerics.engines import EngineLike, available, resolve_engine
from fa_forensics.numerics.formats import FormatLike, get_format
from fa_forensics.numerics.rounding import round_to
from fa_forensics.numerics.accumulate_tiles import (
    _ABS_MASK,
    ieee_exact64_needs_tiny_check,
    ieee_tile_fp32,
    ieee_tile_fp64_exact,
    min_nonzero_abs,
    no_tiny_terms,
    result_bits,
    rz_mask,
    sum_round_to_odd,
    tensor_core_tile_fp32,
)


@dataclass(frozen=True)
class Band:
    """The causal structure of one of attention's products, for `matmul` to skip work it implies.

    Offsets relative to the output row i (None: no limit): a[i, k] is zero for k outside
    [i + k_lo, i + k_hi) (the caller vouches for it), and outputs [i, j] with j ≥ i + n_hi are not
    wanted: they are returned as 0. Skipping zero terms changes no bit (a zero product is a no-op
    of the ieee fma chain and of a tensor-core group, but for the sign of a zero accumulator,
    which the compiled kernels settle as the full product does), so every engine gives the same
    result; the compiled kernels skip them, the torch kernels compute the whole product and zero
    the outputs. Under a tensor-core model that keeps fewer than 24 bits (fp8 on the H100: 14) a group
    of zeros still cuts a starting accumulator to those bits, so with one given nothing is skipped."""

    k_lo: Optional[int] = None
    k_hi: Optional[int] = None
    n_hi: Optional[int] = None


_CHUNK_BYTES = 8 * 2**20  # target size of the largest temporary of one tile (measured best at 4-16 MiB)
_IEEE_TILE_FACTOR = 1  # the ieee kernel's temporary is one fp32 (m, N) accumulator
_EXACT64_TILE_BYTES = 512 * 2**10  # fp64 (m, N) sum of the fp32-operand ieee kernel: ~5 passes per k, keep it in L2


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


def normalize_accumulation(accumulation) -> Accumulation:
    """The `Accumulation` a name ("ieee", "tensor-core", "tensor_core", "tensorcore") or an enum stands for."""
    name = _name(accumulation).replace("_", "-")
    if name == "tensorcore":
        name = "tensor-core"
    if name not in ACCUMULATIONS:
        raise ConfigError(f"unknown accumulation model {accumulation!r}; use one of {', '.join(ACCUMULATIONS)}")
    return Accumulation(name)


def tensor_core_params(gpu="h100", in_format: FormatLike = "bf16",
                       mma_k: Optional[int] = None) -> Optional[TensorCoreParams]:
    """(F, neab) of the tensor-core model for (gpu, input format); None for fp32 inputs (ieee fallback).

    mma_k: the K of the MMA instruction a kernel issues, where it is smaller than the tensor core's F (an
    m16n8k8 MMA sums 8 products into the accumulator per instruction): the groups are then mma_k long."""
    fmt = get_format(in_format).name
    if fmt == "fp32":
        return None
    key = (_name(gpu), fmt)
    if key not in _TC_PARAMS:
        known = ", ".join(f"{g}/{f}" for g, f in _TC_PARAMS)
        raise ConfigError(f"no tensor-core model for gpu={key[0]} with {fmt} inputs; known: {known}")
    F, neab = _TC_PARAMS[key]
    if mma_k is not None:
        if mma_k < 1:
            raise ConfigError(f"mma_k={mma_k} must be a positive instruction K")
        F = min(F, mma_k)
    return TensorCoreParams(key[0], fmt, F, neab)


# ---------------------------------------------------------------------------------------------
# one step of each model (shared by matmul and dot_trace)


def ieee_fma_step(acc: torch.Tensor, prod: torch.Tensor) -> torch.Tensor:
    """fp32(acc + prod) with one rounding, for fp64 tensors holding an fp32 acc and an exact product; returns fp64."""
    return sum_round_to_odd(acc, prod).to(torch.float32).to(torch.float64)


_EXPONENT_BITS = -(1 << 52)  # fp64 sign and exponent bits: x & this = ±2^floor(log2|x|) (0 for 0)


def lead_pow2(x: torch.Tensor) -> torch.Tensor:
    """±2^floor(log2|x|) elementwise (0 for 0) as fp64; every fp32 value, subnormals included, is a
    normal fp64 number, so clearing the fraction bits gives its exponent exactly."""
    return (x.to(torch.float64).view(torch.int64) & _EXPONENT_BITS).view(torch.float64)


def tensor_core_group(acc: torch.Tensor, prods: torch.Tensor, neab: int, leads: torch.Tensor) -> torch.Tensor:
    """One group of the tensor-core model.

    acc (...) the fp32 accumulator (any float dtype holding fp32 values); prods (F, ...) the
    group's exact products, stacked in dim 0 (fp32 or fp64, exact; overwritten in place); leads
    (F, ...) the products of the factors' `lead_pow2` (2^(e_a + e_b): the exponents e_max is
    taken from). Returns the new accumulator (...) as fp64 holding an fp32 value.
    """
    acc = acc.to(torch.float64)
    top = leads.abs().amax(dim=0).to(torch.float64)
    top = torch.maximum(top, acc.abs())  # (...) the largest aligned exponent, as a power of two or |acc|
    e_max = ((top.view(torch.int64) >> 52) & 2047) - 1023  # floor(log2 top); zeros give -1023
    q_exp = e_max.clamp(min=-900) - (23 + neab)  # weight of the last kept bit: 2^q_exp
    scale = ((1023 - q_exp) << 52).view(torch.float64)  # 2^-q_exp, built from its bit pattern
    # exact power-of-two scaling, then truncation of the shifted-out bits (toward zero, no sticky):
    # float -> int conversion truncates toward zero; |product| < 4·2^e_max, so each aligned term is
    # below 2^(25 + neab) and the sum of F + 1 of them is summed in int64
    if prods.dtype == torch.float32:  # products >= 2^-80 when nonzero: a clamped scale only meets zeros
        aligned = prods.mul_(scale.clamp(max=2.0**126).to(torch.float32)).to(torch.int32)
        total = aligned.sum(dim=0, dtype=torch.int64).to(torch.float64)
    else:
        total = prods.mul_(scale).to(torch.int64).sum(dim=0).to(torch.float64)
    total = total + torch.trunc(acc * scale)  # the accumulator, aligned the same way; exact in fp64
    return _rz_fp32(total * (1.0 / scale), rz_mask(neab))


def _rz_fp32(x: torch.Tensor, mask: int) -> torch.Tensor:
    """Round fp64 values toward zero to fp32 (fp64 result) keeping the significant bits `mask` keeps
    (accumulate_tiles.rz_mask: fp32's 24, fewer for fp8); values outside fp32's normal range take the general
    path."""
    y = (x.view(torch.int64) & mask).view(torch.float64)
    ay = y.abs()
    if bool(((ay > _FP32_MAX) | ((ay < 2.0**-126) & (ay > 0))).any()):
        return round_to(x, "fp32", "toward-zero")
    return y


_FP32_MAX = (2 - 2.0**-23) * 2.0**127


# ---------------------------------------------------------------------------------------------
# matmul


def _fp32_profile(x: torch.Tensor) -> tuple[bool, float]:
    """(every value is a finite fp32 number with at most 12 significant bits, max |x|).

    12 bits each make every product exact in fp32 unless it under- or overflows."""
    x32 = x.to(torch.float32)
    if x.dtype != torch.float32 and not torch.equal(x32.to(x.dtype), x):
        return False, math.inf
    if not x32.numel():
        return True, 0.0
    bits = x32.view(torch.int32)
    top = int((bits & _ABS_MASK).amax())  # the bit pattern of max |x|; >= 0x7F800000: inf or NaN
    if top >= 0x7F800000 or bool((bits & 0xFFF).any()):  # low 12 fraction bits must be clear
        return False, math.inf
    return True, float(torch.tensor(top, dtype=torch.int32).view(torch.float32))


def _ieee_fp32_leads(a3: torch.Tensor, b3: torch.Tensor) -> list[bool]:
    """Per lead entry of a3 (L, M, K) @ b3 (L, K, N): True where every product is exact and
    normal in fp32 (12 significant bits per input; nonzero |products| in [2^-126, 2^126]), so
    the fp32 kernel (one rounding per add) is the exact fma chain."""
    ok_a, top_a = _fp32_profile(a3)
    ok_b, top_b = _fp32_profile(b3)
    L = a3.shape[0]
    if not (ok_a and ok_b) or top_a * top_b > 2.0**126:
        return [False] * L
    low = min_nonzero_abs(a3, (1, 2)).double() * min_nonzero_abs(b3, (1, 2)).double()  # (L,)
    return (low >= 2.0**-126).tolist()


def _tensor_core_fast_ok(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> bool:
    """The fp32 tensor-core kernel's global conditions: products exact in fp32 wherever they
    are normal, nothing near overflow (|a|·|b| and |acc| at most 2^100), operands normal fp32
    numbers (their exponents read from their bit patterns). Terms below 2^-100 are handled per
    tile (`no_tiny_terms`, or the kernel's own check)."""
    ok_a, top_a = _fp32_profile(a)
    ok_b, top_b = _fp32_profile(b)
    if not (ok_a and ok_b) or top_a * top_b > 2.0**100:
        return False
    if min(float(min_nonzero_abs(x, tuple(range(x.dim()))).min()) if x.numel() else 1.0 for x in (a, b)) < 2.0**-126:
        return False
    acc_max = float(acc.abs().max()) if acc.numel() else 0.0
    return acc_max <= 2.0**100  # False for inf / NaN too


def _tiles(L: int, M: int, row_bytes: int):
    """(lead slice, row slice) blocks whose largest temporary is about `_CHUNK_BYTES`:
    whole matrices of several lead entries when one matrix fits, else row chunks of one."""
    budget = max(1, _CHUNK_BYTES)
    if M * row_bytes <= budget:
        step = max(1, budget // max(1, M * row_bytes))
        for l0 in range(0, L, step):
            yield slice(l0, l0 + step), slice(0, M)
    else:
        m = max(1, budget // max(1, row_bytes))
        for l0 in range(L):
            for m0 in range(0, M, m):
                yield slice(l0, l0 + 1), slice(m0, m0 + m)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    accumulation="ieee",
    *,
    gpu="h100",
    in_format: FormatLike = "bf16",
    acc: Optional[torch.Tensor] = None,
    engine: EngineLike = None,
    band: Optional[Band] = None,
    assume_finite: bool = False,
    mma_k: Optional[int] = None,
) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N) under an accumulation model; returns fp32 (..., M, N).

    a and b hold exact values of `in_format` inputs (any float dtype). `acc` (..., M, N) is an
    optional starting fp32 accumulator (the running O of flash attention, say).
    engine: `Engine.COMPILED` (or "auto") runs the compiled kernels (accumulate_jit) where every operand is
    a finite fp32 number and the torch kernels elsewhere; `Engine.SPEC` (or "torch") always runs the torch
    kernels (the specification); None: the current engine (`numerics.engines.use_engine`). Same bits.
    band: the product's causal structure (`Band`): zero terms skipped, unwanted outputs 0.
    assume_finite: the caller vouches that a and b are finite fp32 numbers, so the compiled
    kernels skip their check (which routes other values to the torch kernels); acc is checked.
    mma_k: the kernel's MMA instruction K where smaller than the tensor core's group (`tensor_core_params`).
    """
    model = normalize_accumulation(accumulation)
    engine = resolve_engine(engine)
    if a.shape[-1] != b.shape[-2]:
        raise ConfigError(f"matmul: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    params = tensor_core_params(gpu, in_format, mma_k) if model is Accumulation.TENSOR_CORE else None
    lead, a3, b3, acc3 = _batched(a, b, acc)
    L, M, N = a3.shape[0], a3.shape[1], b3.shape[-1]
    if band is not None and params is not None and result_bits(params.neab) < 24 and acc3 is not None:
        band = Band(n_hi=band.n_hi)  # a group of zero terms still cuts the starting accumulator: run every group
    if engine is Engine.COMPILED:
        out = _compiled(a3, b3, acc3, params, band, assume_finite)
        if out is not None:
            return out.reshape(*lead, M, N)
    acc3 = torch.zeros(L, M, N, dtype=torch.float32) if acc3 is None else acc3.to(torch.float32)
    with _one_thread():
        if params is None:  # ieee (or fp32 inputs under tensor-core)
            out = _ieee(a3, b3, acc3)
        else:
            out = _tensor_core(a3, b3, acc3, params)
    if band is not None and band.n_hi is not None:
        out = _zero_unwanted(out, band.n_hi)
    return out.reshape(*lead, M, N)


def _batched(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor]):
    """The broadcast leading shape of a and b, and a (L, M, K), b (L, K, N), acc (L, M, N) (or None) with the
    leading dimensions broadcast and flattened into one of L entries."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    L = 1
    for d in lead:
        L *= d
    a3 = a.expand(*lead, M, K).reshape(L, M, K)
    b3 = b.expand(*lead, K, N).reshape(L, K, N)
    acc3 = None if acc is None else acc.expand(*lead, M, N).reshape(L, M, N)
    return lead, a3, b3, acc3


def _zero_unwanted(out: torch.Tensor, n_hi: int) -> torch.Tensor:
    """out (L, M, N) with the outputs [i, j], j ≥ i + n_hi, set to 0 (a band's unwanted outputs)."""
    M, N = out.shape[-2:]
    wanted = torch.arange(N).unsqueeze(0) < torch.arange(M).unsqueeze(-1) + n_hi  # (M, N)
    return out.masked_fill(~wanted, 0.0)


def _as_fp32_array(x: torch.Tensor, strided: bool = False, assume_finite: bool = False) -> Optional[torch.Tensor]:
    """x (3-d) as an fp32 tensor when every value is a finite fp32 number, else None: contiguous,
    or with `strided` an fp32 x as it is (a transposed view is read in place, not copied).
    assume_finite: the caller vouches for finite fp32 values; only the layout is handled."""
    if not x.dtype.is_floating_point or x.dtype.itemsize > 8:
        return None
    if strided and x.dtype == torch.float32 and x.transpose(1, 2).is_contiguous():  # a transposed view
        return x if assume_finite or _jit().all_finite(x.transpose(1, 2).reshape(-1).numpy()) else None
    x32 = x.to(torch.float32).contiguous()
    if assume_finite and x.dtype == torch.float32:
        return x32
    if x.dtype == torch.float64 and not bool((x32.to(torch.float64) == x).all()):
        return None  # a value that is not an fp32 number (or NaN)
    return x32 if _jit().all_finite(x32.view(-1).numpy()) else None


def _jit():
    """The compiled kernels' module (numba compiles or loads them on first use)."""
    from fa_forensics.numerics import accumulate_jit

    return accumulate_jit


def _compiled(a3: torch.Tensor, b3: torch.Tensor, acc3: Optional[torch.Tensor],
              params: Optional[TensorCoreParams], band: Optional[Band] = None,
              assume_finite: bool = False) -> Optional[torch.Tensor]:
    """The model on the compiled kernels: a3 (L, M, K) @ b3 (L, K, N) from acc3 (L, M, N), or from
    zeros when acc3 is None -> fp32 (L, M, N); None when an operand is outside their domain
    (not a finite fp32 number). band: the zero terms and unwanted outputs both kernels skip."""
    if not available(Engine.COMPILED):  # numba missing: the torch kernels give the same bits, slower
        return None
    accumulate_jit = _jit()
    a, b = _as_fp32_array(a3, strided=True, assume_finite=assume_finite), _as_fp32_array(b3,
                                                                                         assume_finite=assume_finite)
    if a is None or b is None:
        return None
    zero = acc3 is None
    if zero:
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)
    else:
        out = _as_fp32_array(acc3)
        if out is None:
            return None
        if out.data_ptr() == acc3.data_ptr():
            out = out.clone()  # the kernels write in place; never into the caller's tensor
    with accumulate_jit.threads(accumulate_jit.wanted_threads(torch.get_num_threads())):
        limits = _band_limits(band, accumulate_jit.NO_LIMIT)
        if params is None:
            accumulate_jit.ieee_matmul(a.numpy(), b.numpy(), out.numpy(), zero, *limits)
        else:
            accumulate_jit.tensor_core_matmul(a.numpy(), b.numpy(), out.numpy(), params.F, params.neab, zero, *limits)
    return out


def _band_limits(band: Optional[Band], no_limit: int) -> tuple[int, int, int]:
    """(k_lo, k_hi, n_hi) of the compiled kernels; ±no_limit where the band sets none."""
    band = band or Band()
    return (-no_limit if band.k_lo is None else band.k_lo, no_limit if band.k_hi is None else band.k_hi,
            no_limit if band.n_hi is None else band.n_hi)


@contextlib.contextmanager
def _one_thread():
    """Run the kernels on one intra-op thread, then restore the caller's setting: they issue
    many cache-sized ops, which intra-op threads slow down (measured: 2 threads took 6-16x the
    CPU time and 2-13x the wall time of 1 on a 2-core machine; benchmarks/numerics_matmul.py)."""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def _fp32_valued(x: torch.Tensor) -> bool:
    """Every value of x is an fp32 number (NaN and ±inf included)."""
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16) or "float8" in str(x.dtype):
        return True
    x32 = x.to(torch.float32)
    return bool(((x32.to(x.dtype) == x) | torch.isnan(x)).all())


def _ieee(a3: torch.Tensor, b3: torch.Tensor, acc3: torch.Tensor) -> torch.Tensor:
    """ieee model: a3 (L, M, K) @ b3 (L, K, N) from acc3 (L, M, N), tile by tile -> fp32 (L, M, N).

    Three kernels, fastest first: products exact in fp32 (`ieee_tile_fp32`), operands that are
    fp32 numbers (`ieee_tile_fp64_exact`), anything else (`_ieee_tile_fp64`, the reference)."""
    L, M, N = a3.shape[0], a3.shape[1], b3.shape[-1]
    fp32_ok = _ieee_fp32_leads(a3, b3)  # (L,)
    if all(fp32_ok):
        exact64 = False
    else:
        exact64 = _fp32_valued(a3) and _fp32_valued(b3)
        if exact64:
            tiny = ieee_exact64_needs_tiny_check(min_nonzero_abs(a3, (1, 2)), min_nonzero_abs(b3, (1, 2))).tolist()
    out = torch.empty(L, M, N, dtype=torch.float32)
    for ls, rows in _tiles(L, M, N * 4 * _IEEE_TILE_FACTOR):
        if all(fp32_ok[ls]):
            at = a3[ls, rows].transpose(-1, -2)  # (Lt, K, m) a view
            bw = b3[ls].to(torch.float32).contiguous()  # (Lt, K, N): row k of b is contiguous
            out[ls, rows] = ieee_tile_fp32(at.to(torch.float32), bw, acc3[ls, rows])
            continue
        for ls2, rows2 in _sub_tiles(range(L)[ls], range(M)[rows], N * 8,
                                     _EXACT64_TILE_BYTES if exact64 else _CHUNK_BYTES):
            at = a3[ls2, rows2].transpose(-1, -2)  # (Lt, K, m) a view
            if exact64:
                out[ls2, rows2] = ieee_tile_fp64_exact(at, b3[ls2], acc3[ls2, rows2], tiny_check=any(tiny[ls2]))
            else:
                out[ls2, rows2] = _ieee_tile_fp64(at.to(torch.float64), b3[ls2].to(torch.float64), acc3[ls2, rows2])
    return out


def _sub_tiles(leads: range, rows: range, row_bytes: int, budget: int):
    """Split the block (leads, rows) into (lead slice, row slice) blocks whose (m, N) temporaries
    take about `budget` bytes."""
    step = max(1, budget // max(1, row_bytes))
    if len(rows) <= step:  # whole row ranges: group lead entries
        per = max(1, budget // max(1, len(rows) * row_bytes))
        for l0 in range(leads.start, leads.stop, per):
            yield slice(l0, min(l0 + per, leads.stop)), slice(rows.start, rows.stop)
    else:
        for l0 in leads:
            for m0 in range(rows.start, rows.stop, step):
                yield slice(l0, l0 + 1), slice(m0, min(m0 + step, rows.stop))


def _ieee_tile_fp64(at: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """ieee model on one tile with fp64 products (any fp32 inputs): at (Lt, K, m), b (Lt, K, N), acc (Lt, m, N)."""
    out = acc.to(torch.float64).clone()
    for k in range(at.shape[1]):
        out = ieee_fma_step(out, at[:, k, :, None] * b[:, k, None, :])
    return out.to(torch.float32)


def _tensor_core(a3: torch.Tensor, b3: torch.Tensor, acc3: torch.Tensor, params: TensorCoreParams) -> torch.Tensor:
    """tensor-core model: a3 (L, M, K) @ b3 (L, K, N) from acc3 (L, M, N), tile by tile -> fp32 (L, M, N).

    The fp32 kernel runs where its conditions hold; a tile it rejects (a nonzero term below
    2^-100) and inputs outside its domain take the fp64 reference (`tensor_core_group`)."""
    (L, M, K), N = a3.shape, b3.shape[-1]
    F, neab = params.F, params.neab
    fast = _tensor_core_fast_ok(a3, b3, acc3)
    work = torch.float32 if fast else torch.float64
    at = a3.to(work).transpose(-1, -2)  # (L, K, M) a view: a tile reads F consecutive k of each row
    bw = b3.to(work).contiguous()  # (L, K, N): row k of b is contiguous
    if fast:  # (L,) True where no tile of that lead entry can meet a term below 2^-100
        safe = no_tiny_terms(min_nonzero_abs(a3, (1, 2)), min_nonzero_abs(b3, (1, 2)),
                             min_nonzero_abs(acc3, (1, 2)), neab).tolist()
    out = torch.empty(L, M, N, dtype=torch.float32)
    for ls, rows in _tiles(L, M, N * min(F, K) * 4 * 2):
        tile_acc = acc3[ls, rows]
        if fast:
            track = not all(safe[ls])
            res, ok = tensor_core_tile_fp32(at[ls, :, rows], bw[ls], tile_acc, F, neab, track=track)
            if ok:
                out[ls, rows] = res
                continue
        out[ls, rows] = _tensor_core_tile_fp64(at[ls, :, rows], bw[ls], tile_acc, params)
    return out


def _tensor_core_tile_fp64(at: torch.Tensor, b: torch.Tensor, acc: torch.Tensor,
                           params: TensorCoreParams) -> torch.Tensor:
    """tensor-core model on one tile with the fp64 reference step: at (Lt, K, m), b (Lt, K, N), acc (Lt, m, N)."""
    at, b = at.to(torch.float64), b.to(torch.float64)
    out = acc.to(torch.float64)
    K, F = at.shape[1], params.F
    lead_a, lead_b = lead_pow2(at), lead_pow2(b)
    for k0 in range(0, K, F):
        prods = at[:, k0 : k0 + F, :, None] * b[:, k0 : k0 + F, None, :]  # (Lt, n, m, N) exact in fp64
        leads = lead_a[:, k0 : k0 + F, :, None] * lead_b[:, k0 : k0 + F, None, :]
        out = tensor_core_group(out, prods.transpose(0, 1), params.neab, leads.transpose(0, 1))  # group dim first
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
    leads = lead_pow2(p) * lead_pow2(v)
    K = prods.shape[0]
    trace = torch.empty(K, dtype=torch.float64)
    params = tensor_core_params(gpu, in_format) if model is Accumulation.TENSOR_CORE else None
    acc = torch.zeros((), dtype=torch.float64)
    if params is None:
        for k in range(K):
            acc = ieee_fma_step(acc, prods[k])
            trace[k] = acc
    else:
        for k0 in range(0, K, params.F):
            acc = tensor_core_group(acc, prods[k0 : k0 + params.F].clone(), params.neab, leads[k0 : k0 + params.F])
            trace[k0 : k0 + params.F] = acc
    return trace.to(torch.float32)
