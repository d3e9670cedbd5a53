"""replay(..., backend="triton"): run the Triton kernels under a ReplayConfig and build a ReplayOut.

Runs on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is first imported; the tests do this). The kernels implement the emulator's numerics
contract (replay/emulate/forward.py, backward.py) with these known differences:
- exp(x) is evaluated as exp2(x·log2 e) (the tutorial's and the hardware's way): P may differ
  from the emulator's exp (correctly rounded in fp32) by an ulp before the P̄ cast;
- on a GPU, low-precision dots run on tensor cores (their accumulation is the `tensor-core`
  model, not `ieee`); under the interpreter the test suite's compatibility layer makes every
  dot the `ieee` sequential fp32 walk. `ReplayOut.accumulation` says which one ran;
- stochastic rounding is the emulator's alone: this backend refuses it in one line (use backend "emulate");
- the kernels skip KV blocks a causal mask hides and never clamp a block's row sum: exact for the
  standard softmax, so masked_blocks=visit and row_sum_floor are accepted there; with another
  softmax (the reference code's STABLE=1 loop, preset "bf16-autocast-stabilized") they are refused;
- the backward is the FA2 kernels' (fp32 dP, δ, dQ, dK, dV accumulators): the reference code's
  backward knobs (dp_dtype, delta_dtype, grad_dtype, ds_alpha) and a named backward_kernel are refused
  when dO is given.
The autocast reference's low-precision S, m, ℓ and rescaled accumulator (s_dtype, stats_dtype,
rescale_dtype, preset "bf16-autocast") are constexpr cast points of the kernels, as in the emulator.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from fa_forensics.errors import BackendUnsupported
from fa_forensics.enums import BackwardKernel, DeltaSource, MaskedBlocks, Precision, Rounding, Softmax
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.run import high_precision_twin
from fa_forensics.replay.out import PBarStats, ReplayOut

_FP32 = Precision.FP32


class TritonBackendError(BackendUnsupported):
    """The triton backend cannot run this replay here (`.reason`); the emulator can."""

    def __init__(self, reason: str) -> None:
        super().__init__("triton", reason)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_for(q: torch.Tensor) -> torch.device:
    if q.is_cuda:
        return q.device
    if interpreting():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise TritonBackendError(
        "needs a CUDA GPU (none found) or TRITON_INTERPRET=1 set before triton is imported")


def to_input(x: torch.Tensor, fmt: Precision, device: torch.device) -> torch.Tensor:
    """x rounded once (nearest-even) to fmt, contiguous, on device. fp8 e4m3 saturates at ±448."""
    from fa_forensics.replay.triton.launch import TORCH_DTYPES

    if x.dtype == torch.float64:  # one rounding from fp64, not fp64 → fp32 → fmt
        from fa_forensics.replay.emulate.run import to_input_dtype
        from fa_forensics.replay.config import ReplayConfig as _Cfg

        x = to_input_dtype(x, _Cfg(input_dtype=fmt))
    x = x.to(device)
    if fmt is Precision.FP8_E4M3:
        x = x.float().clamp(-448.0, 448.0)
    elif fmt is Precision.FP8_E5M2:
        x = x.float().clamp(-57344.0, 57344.0)
    return x.to(TORCH_DTYPES[fmt]).contiguous()


def _stats(rows: torch.Tensor) -> PBarStats:
    """Per-row kernel counters (B, H, T, 4) int32 → PBarStats of (B, H) int64."""
    rows = rows.to("cpu", torch.int64)
    B, H, T, _ = rows.shape
    return PBarStats(
        repeated_max_rows=(rows[..., 0] > 1).sum(-1),
        p_one_count=rows[..., 1].sum(-1),
        stabilized_rows=(rows[..., 2] > 0).sum(-1),
        p_zeroed=rows[..., 3].sum(-1),
        rows=torch.full((B, H), T, dtype=torch.int64),
    )


def _check_supported(config: ReplayConfig, backward: bool) -> None:
    """Refuse, in one line, what the kernels do not implement (before triton is imported)."""
    if config.rounding is Rounding.STOCHASTIC:
        raise TritonBackendError("implements nearest-even casts only, not rounding=stochastic")
    if config.is_kernel_model:
        raise TritonBackendError("does not implement the kernel models (exp_form, exp_unit, lse_form, row_sum, "
                                 "normalize, kv_splits, mma_k): replay them with the emulator")
    reference_loop = config.masked_blocks is MaskedBlocks.VISIT or config.row_sum_floor > 0
    if reference_loop and config.softmax is not Softmax.STANDARD:
        raise TritonBackendError(
            f"skips fully masked KV blocks and does not clamp row sums, which changes the bits under "
            f"softmax={config.softmax.value} (the reference code's loop)")
    if config.exp_dtype is not Precision.FP32:
        raise TritonBackendError(
            f"keeps exp and the row sums in fp32, not in exp_dtype={config.exp_dtype.value} (CPU autocast)")
    if backward and config.backward_kernel is not BackwardKernel.REFERENCE:
        raise TritonBackendError(f"runs its own backward, not backward_kernel={config.backward_kernel.value}")
    if backward and config.has_reference_backward:
        raise TritonBackendError(
            "runs the FA2 kernels' fp32 backward, not the reference code's bf16 one (dp_dtype, delta_dtype, "
            "grad_dtype, ds_alpha)")


def replay_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig,
                  do: Optional[torch.Tensor] = None, *, causal: bool = True,
                  scale: Optional[float] = None) -> ReplayOut:
    """The Triton twin of the emulator: same arguments, same ReplayOut (tensors on the CPU)."""
    _check_supported(config, backward=do is not None)
    device = _device_for(q)  # before triton is imported: without a GPU or the interpreter, refuse first
    from fa_forensics.replay.triton import launch  # imports triton: only now

    B, H, T, D = q.shape
    scale = float(scale) if scale is not None else D ** -0.5
    qi, ki, vi = (to_input(x, config.input_dtype, device) for x in (q, k, v))  # (B, H, T, D)
    plan = launch.plan_for(config, T, D)
    o, lse, stats = launch.forward(qi, ki, vi, config, plan, causal=causal, scale=scale)
    delta = dq = dk = dv = None
    if do is not None:
        doi = to_input(do, config.input_dtype, device)
        if config.delta is DeltaSource.O_LOWP:
            delta = launch.delta(qi, ki, vi, doi, o, lse, "o", plan, causal=causal, scale=scale)
        elif config.delta is DeltaSource.O_HIGHP:
            twin = high_precision_twin(config)  # every forward cast after the inputs in fp32, as the emulator
            o_hp, _, _ = launch.forward(qi, ki, vi, twin, plan, causal=causal, scale=scale)
            delta = launch.delta(qi, ki, vi, doi, o_hp, lse, "o", plan, causal=causal, scale=scale)
        else:
            delta = launch.delta(qi, ki, vi, doi, None, lse, config.delta.value, plan, causal=causal, scale=scale,
                                 s_dtype=config.s_dtype)
        dq, dk, dv = launch.backward(qi, ki, vi, doi, lse, delta, config, plan, causal=causal, scale=scale)
    low_dots = config.input_dtype is not _FP32 or config.p_dtype is not _FP32 or config.ds_dtype is not _FP32
    accumulation = "tensor-core" if (device.type == "cuda" and low_dots) else "ieee"

    def cpu(t):
        return None if t is None else t.cpu()

    return ReplayOut(o=o.cpu(), lse=lse.cpu(), stats=_stats(stats), delta=cpu(delta), dq=cpu(dq), dk=cpu(dk),
                     dv=cpu(dv), config=config, backend="triton", accumulation=accumulation)
