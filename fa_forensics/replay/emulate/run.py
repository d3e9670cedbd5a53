"""emulate_replay: cast the inputs, run the forward and (with dO) the backward, build ReplayOut."""
from __future__ import annotations

from typing import Optional

import torch

from fa_forensics.replay.config import DeltaSource, Precision, ReplayConfig, Rounding
from fa_forensics.replay.emulate.backward import backward
from fa_forensics.replay.emulate.forward import forward
from fa_forensics.replay.emulate.ops import cast, torch_dtype
from fa_forensics.replay.out import ReplayOut

_FP32 = Precision.FP32


def to_input_dtype(x: torch.Tensor, config: ReplayConfig) -> torch.Tensor:
    """x (any float dtype, any device) rounded once to config.input_dtype, as fp32 on the CPU."""
    x = x.detach().cpu()
    x = x.double() if x.dtype == torch.float64 else x.float()  # fp64 is rounded once, not twice
    return cast(x, config.input_dtype, Rounding.NEAREST_EVEN)


def high_precision_twin(config: ReplayConfig) -> ReplayConfig:
    """The same replay with every forward cast after the inputs in fp32 (P̄, P̄V, O and the
    autocast intermediates S, m, ℓ, rescaled O): O_hp for δ."""
    return config.with_(p_dtype=_FP32, pv_dtype=_FP32, o_dtype=_FP32, p_scale=1.0,
                        s_dtype=_FP32, stats_dtype=_FP32, rescale_dtype=_FP32)


def emulate_replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig,
                   do: Optional[torch.Tensor] = None, *, causal: bool, scale: float) -> ReplayOut:
    """Replay attention on the CPU emulator; shapes and arguments already validated by api.replay."""
    with torch.no_grad():
        q32, k32, v32 = (to_input_dtype(x, config) for x in (q, k, v))  # (B, H, T, D)
        generator = torch.Generator().manual_seed(config.seed)
        fwd = forward(q32, k32, v32, config, causal=causal, scale=scale, generator=generator)
        delta = dq = dk = dv = None
        if do is not None:
            do32 = to_input_dtype(do, config)
            o_for_delta = None
            if config.delta is DeltaSource.O_LOWP:
                o_for_delta = fwd.o
            elif config.delta is DeltaSource.O_HIGHP:
                twin = high_precision_twin(config)
                o_for_delta = forward(q32, k32, v32, twin, causal=causal, scale=scale, generator=None).o
            grads = backward(q32, k32, v32, do32, fwd.lse, config, causal=causal, scale=scale, o_for_delta=o_for_delta)
            delta, dq, dk, dv = grads.delta, grads.dq, grads.dk, grads.dv
        return ReplayOut(
            o=fwd.o.to(torch_dtype(config.o_dtype)),
            lse=fwd.lse,
            stats=fwd.stats,
            delta=delta,
            dq=dq,
            dk=dk,
            dv=dv,
            config=config,
            backend="emulate",
            accumulation=config.accumulation.value,
        )
