"""emulate_replay: cast the inputs, run the forward and (with dO) the backward, build ReplayOut.

Memory is bounded by blocks, not by H·T²: the replay runs one work item at a time, a group of
heads of one batch entry, and within it blocks of query rows (`StreamPlan`), so the largest
temporary holds about `BLOCK_ELEMENTS` scores whatever H and T are. Heads and rows are
independent in attention, so every block's results are bit for bit those of one pass over the
whole (the backward carries its dK / dV accumulators across row blocks in row order).
Stochastic rounding draws from one seeded generator in the order of one pass, so a replay with
it runs as one pass (its memory grows with B·H·T·block_n).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.numerics import accumulate_jit
from fa_forensics.numerics.engines import EngineLike, use_engine
from fa_forensics.replay.config import BackwardKernel, DeltaSource, Precision, ReplayConfig, Rounding
from fa_forensics.replay.emulate.backward import Backward, backward, query_blocks
from fa_forensics.replay.emulate.efficient_schedule import backward_tile, key_splits
from fa_forensics.replay.emulate.forward import Forward, forward
from fa_forensics.replay.emulate.ops import to_input_dtype, torch_dtype
from fa_forensics.replay.out import PBarStats, ReplayOut

_FP32 = Precision.FP32
BLOCK_ELEMENTS = 2**21  # scores (heads × query rows × keys) per block: 8 MiB per fp32 temporary
_ROW_QUANTUM = 32  # row blocks are multiples of the largest tensor-core group (see backward.query_blocks)


@dataclass(frozen=True)
class StreamPlan:
    """How one replay is cut: `heads` per work item, `block_m` query rows per block (None = all)."""

    heads: int
    block_m: Optional[int]

    @classmethod
    def for_shape(cls, H: int, T: int, n_keys: int, budget: Optional[int] = None) -> StreamPlan:
        """The largest work items whose (heads, rows, keys) temporaries stay within `budget`
        elements (default BLOCK_ELEMENTS): whole heads while one fits, else one head in blocks of rows."""
        budget = BLOCK_ELEMENTS if budget is None else budget
        per_head = T * max(n_keys, 1)
        if per_head <= budget:
            return cls(heads=max(1, min(H, budget // per_head)), block_m=None)
        rows = max(_ROW_QUANTUM, budget // max(n_keys, 1) // _ROW_QUANTUM * _ROW_QUANTUM)
        return cls(heads=1, block_m=rows if rows < T else None)

    def items(self, B: int, H: int) -> Iterator[tuple[int, slice]]:
        """(batch index, head slice) of every work item, in order."""
        for b in range(B):
            for h0 in range(0, H, self.heads):
                yield b, slice(h0, min(h0 + self.heads, H))


def high_precision_twin(config: ReplayConfig) -> ReplayConfig:
    """The same replay with every forward cast after the inputs in fp32 (P̄, P̄V, O and the
    autocast intermediates S, m, ℓ, rescaled O): O_hp for δ."""
    return config.with_(p_dtype=_FP32, pv_dtype=_FP32, o_dtype=_FP32, p_scale=1.0,
                        s_dtype=_FP32, stats_dtype=_FP32, rescale_dtype=_FP32, exp_dtype=_FP32)


_STAT_FIELDS = ("repeated_max_rows", "p_one_count", "stabilized_rows", "p_zeroed", "rows")


def streamed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig, plan: StreamPlan, *,
                     causal: bool, scale: float, generator: Optional[torch.Generator],
                     mask: Optional[torch.Tensor] = None) -> Forward:
    """`forward` run work item by work item and row block by row block; the same bits as one pass."""
    if config.rounding is Rounding.STOCHASTIC:
        return forward(q, k, v, config, causal=causal, scale=scale, generator=generator, mask=mask)
    B, H, T, D = q.shape
    mask = None if mask is None else mask.expand(B, H, T, k.shape[-2])
    o = torch.empty(B, H, T, D)
    lse = torch.empty(B, H, T)
    counts = {name: torch.zeros(B, H, dtype=torch.int64) for name in _STAT_FIELDS}  # (B, H) each
    for b, hs in plan.items(B, H):
        bs = slice(b, b + 1)
        for i0, i1 in query_blocks(T, plan.block_m):
            part = forward(q[bs, hs, i0:i1], k[bs, hs], v[bs, hs], config, causal=causal, scale=scale,
                           generator=generator, row0=i0, mask=None if mask is None else mask[bs, hs, i0:i1])
            o[bs, hs, i0:i1] = part.o
            lse[bs, hs, i0:i1] = part.lse
            for name in _STAT_FIELDS:
                counts[name][bs, hs] += getattr(part.stats, name)
    return Forward(o=o, lse=lse, stats=PBarStats(**counts))


def streamed_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                      config: ReplayConfig, plan: StreamPlan, *, causal: bool, scale: float,
                      o_for_delta: Optional[torch.Tensor], mask: Optional[torch.Tensor] = None) -> Backward:
    """`backward` run work item by work item, in row blocks of plan.block_m; the same bits as one pass."""
    B, H = q.shape[:2]
    mask = None if mask is None else mask.expand(B, H, q.shape[2], k.shape[-2])
    delta = torch.empty(lse.shape)
    dq, dk, dv = torch.empty(q.shape), torch.empty(k.shape), torch.empty(v.shape)
    for b, hs in plan.items(B, H):
        at = (slice(b, b + 1), hs)
        part = backward(q[at], k[at], v[at], do[at], lse[at], config, causal=causal, scale=scale,
                        o_for_delta=None if o_for_delta is None else o_for_delta[at], block_m=plan.block_m,
                        mask=None if mask is None else mask[at])
        delta[at], dq[at], dk[at], dv[at] = part.delta, part.dq, part.dk, part.dv
    return Backward(delta=delta, dq=dq, dk=dk, dv=dv)


def launch_config(config: ReplayConfig, q_shape: torch.Size, n_keys: int) -> ReplayConfig:
    """The config with what the whole launch decides fixed before the replay is cut into work items: the
    memory-efficient backward's key splits (PyTorch's heuristic reads the launch's batch and heads, which a work
    item of one batch row and a few heads does not have)."""
    if config.backward_kernel is not BackwardKernel.SDPA_EFFICIENT or config.bwd_key_splits is not None:
        return config
    B, H, _, D = q_shape
    return config.with_(bwd_key_splits=key_splits(B, H, n_keys, backward_tile(D)))


@contextlib.contextmanager
def emulator_threads():
    """Torch's elementwise ops on one thread and the compiled kernels on torch's thread count:
    two thread pools competing for the same cores slow both down (measured: 4x the wall time of
    a GPT-2-size replay on 2 cores). Results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with accumulate_jit.kernel_threads(n):
            yield
    finally:
        torch.set_num_threads(n)


def emulate_replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig,
                   do: Optional[torch.Tensor] = None, *, causal: bool, scale: float,
                   plan: Optional[StreamPlan] = None, mask: Optional[torch.Tensor] = None,
                   engine: EngineLike = None) -> ReplayOut:
    """Replay attention on the CPU emulator; shapes and arguments already validated by api.replay.

    plan: how to cut the work (default: `StreamPlan.for_shape`, blocks of about BLOCK_ELEMENTS).
    mask: SDPA's attn_mask broadcastable to (B, H, T, Tk) (bool or additive), or None.
    engine: which implementation computes (numerics/engines.py; None: the current one); the same bits."""
    if config.plain is not None:  # attention written in torch ops: its recorded ops, whole (replay/eager.py)
        from fa_forensics.replay.eager import plain_replay

        return plain_replay(q, k, v, config, do, causal=causal, scale=scale, mask=mask)
    B, H, T, _ = q.shape
    plan = plan or StreamPlan.for_shape(H, T, k.shape[-2])
    with torch.no_grad(), emulator_threads(), use_engine(engine):
        q32, k32, v32 = (to_input_dtype(x, config) for x in (q, k, v))  # (B, H, T, D)
        generator = torch.Generator().manual_seed(config.seed)
        mask = None if mask is None else mask.detach().cpu()
        fwd = streamed_forward(q32, k32, v32, config, plan, causal=causal, scale=scale, generator=generator, mask=mask)
        delta = dq = dk = dv = None
        if do is not None:
            do32 = to_input_dtype(do, config)
            o_for_delta = None
            if config.delta is DeltaSource.O_LOWP or config.backward_kernel is not BackwardKernel.REFERENCE:
                o_for_delta = fwd.o  # a kernel's backward reads the O it stored
            elif config.delta is DeltaSource.O_HIGHP:
                twin = high_precision_twin(config)
                o_for_delta = streamed_forward(q32, k32, v32, twin, plan, causal=causal, scale=scale, generator=None,
                                               mask=mask).o
            grads = streamed_backward(q32, k32, v32, do32, fwd.lse, launch_config(config, q.shape, k.shape[-2]), plan,
                                      causal=causal, scale=scale, o_for_delta=o_for_delta, mask=mask)
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
