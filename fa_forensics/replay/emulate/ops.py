"""The two primitive operations of the emulator: a cast (rounding) and a matrix product.

Every rounding in the emulator goes through `cast` (numerics.round_to) and every matrix product
through `mm` (numerics.matmul), so the accumulation model chosen in the config (ieee /
tensor-core) applies to every product and the rounding mode to every cast it governs.
All tensors here are fp32 tensors whose values are exactly representable in their format.
"""
from __future__ import annotations

from typing import Optional

import torch

from fa_forensics.numerics import matmul, round_to, to_torch_dtype
from fa_forensics.numerics.accumulate import Band
from fa_forensics.replay.config import Accumulation, GPUModel, Precision, ReplayConfig, Rounding

# Width order of the formats: the product of two operands is modelled with the wider one's
# tensor-core parameters (a mixed fp8 x bf16 MMA does not exist; fp32 falls back to ieee).
_WIDTH = {Precision.FP8_E4M3: 0, Precision.FP8_E5M2: 0, Precision.FP16: 1, Precision.BF16: 1, Precision.FP32: 2}


def wider(a: Precision, b: Precision) -> Precision:
    """The wider of two operand formats: the `in_format` of their product."""
    return a if _WIDTH[a] >= _WIDTH[b] else b


def promote(a: Precision, b: Precision) -> Precision:
    """The dtype PyTorch gives a binary op on tensors of formats a and b (bf16 − bf16 stays
    bf16; anything with fp32, or bf16 with fp16, is fp32)."""
    return a if a is b else Precision.FP32


def cast(
    x: torch.Tensor,
    fmt: Precision,
    rounding: Rounding = Rounding.NEAREST_EVEN,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Round x (fp32 or fp64) to fmt; returns fp32 holding values exactly representable in fmt.

    fp8 e4m3 saturates at ±448 (the hardware's satfinite cast); fp32 input cast to fp32 is a no-op.
    """
    if fmt is Precision.FP32:
        return x.float()
    return round_to(x, fmt.value, mode=rounding.value, generator=generator).float()


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    accumulation: Accumulation,
    gpu: GPUModel,
    in_format: Precision,
    acc: Optional[torch.Tensor] = None,
    band: Optional[Band] = None,
    finite_operands: bool = False,
    mma_k: Optional[int] = None,
) -> torch.Tensor:
    """fp32 product a @ b ((..., M, K) @ (..., K, N) -> (..., M, N)) under the accumulation model.

    acc (..., M, N), if given, is the starting accumulator (the C operand of an MMA): the
    products are added into it in the model's order, as `tl.dot(p, v, acc)` does.
    band: the causal structure of the product (`numerics.accumulate.Band`): zero terms skipped,
    unwanted outputs 0; the same bits.
    finite_operands: a and b are finite by construction (replay inputs that `fused.eligible`
    checked, P̄ ≤ its scale S), so the compiled kernels skip their finiteness check; values a
    low-precision cast can overflow (dS, the rescaled accumulator) are always checked.
    mma_k: the K of the kernel's MMA instruction where smaller than the tensor core's group (an m16n8k8
    MMA sums 8 products per instruction): the tensor-core model's groups are then that long.
    """
    return matmul(a, b, accumulation=accumulation.value, gpu=gpu.value, in_format=in_format.value, acc=acc,
                  band=band, assume_finite=finite_operands, mma_k=mma_k)


def finfo_max(fmt: Precision) -> float:
    """The largest finite value of fmt (torch.finfo(dtype).max): the reference code's mask value."""
    return float(torch.finfo(torch_dtype(fmt)).max)


def torch_dtype(fmt: Precision) -> torch.dtype:
    """The torch dtype a tensor of format fmt is returned in (fp8 e4m3 -> float8_e4m3fn)."""
    return to_torch_dtype(fmt.value)


def to_input_dtype(x: torch.Tensor, config: ReplayConfig) -> torch.Tensor:
    """x (any float dtype, any device) rounded once to config.input_dtype, as fp32 on the CPU."""
    x = x.detach().cpu()
    x = x.double() if x.dtype == torch.float64 else x.float()  # fp64 is rounded once, not twice
    return cast(x, config.input_dtype, Rounding.NEAREST_EVEN)
