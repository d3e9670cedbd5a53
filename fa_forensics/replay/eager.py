"""Replay of attention written as plain tensor ops: the recorded op sequence (`ReplayConfig.plain`) run again.

The ops of a `PlainRecipe` (replay/plain_recipe.py) are run in their recorded order on the stored Q, K, V:
the scores' product, each factor with its recorded number, the layer's stored mask at the place of the first
mask op (the terms combined, a fill where the term blocked), a soft-cap's tanh, the casts, the softmax in its
dtype, the cast of P, P·V. Two implementations of the products and the softmax:

- re-execution (`config.plain_reexec`): torch's own CPU kernels, with torch's CPU thread count set to the
  recorded one for the scope. On a CPU capture this computes what training computed, the bit oracle, on a
  machine whose torch (and its BLAS) is the one recorded; a CUDA capture is refused (its cuBLAS GEMMs do
  not run on a CPU): its emulator model is preset `eager`.
- the emulator model (replay/emulate/eager.py): products summed exactly and rounded once to fp32 (then to the
  recorded output dtype), softmax exact and rounded once; it does not model a BLAS's blocking of the sums.

The dtypes follow the config where the recording had low precision: the scores' (and their ops') `s_dtype`,
the softmax's `exp_dtype`, P's `p_dtype`, the inputs' `input_dtype`, O's `o_dtype`, so that an analysis's
repair (P cast to fp32, fp32 scores) and the high-precision twin change the recorded op where it rounds. The
stabilized softmax (`config.softmax`) replaces the softmax op by Algorithm 3's shift, the rest unchanged.
Gradients come from autograd through the same ops, as training's backward ran them.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import Precision, ReplayConfig, Rounding, Softmax
from fa_forensics.replay.emulate import eager as model
from fa_forensics.replay.emulate.softmax import block_shift
from fa_forensics.replay.out import PBarStats
from fa_forensics.replay.plain_recipe import MASKS, SCALES, PlainOp, PlainRecipe

_LOW = ("bfloat16", "float16")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_BY_PRECISION = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
_FORMAT = {torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}


def reexec_refusal(recipe: PlainRecipe) -> Optional[str]:
    """Why this machine cannot re-execute `recipe` (None: it can): it was recorded on another device kind."""
    if recipe.device in ("cpu", "unknown"):
        return None
    return (f"the layer's attention ran on {recipe.device}, whose GEMMs this CPU does not run: re-execution reproduces "
            "CPU captures only; replay it with preset eager (the emulator model)")


@contextlib.contextmanager
def threads(n: Optional[int]) -> Iterator[None]:
    """torch's CPU thread count set to `n` for the scope (CPU GEMM blocking may depend on it)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class PlainRun:
    """One run of the ops: O, the scores entering the softmax (fp32), P after its cast, P before it, the rows
    where the stabilized shift fired."""

    o: torch.Tensor
    scores: torch.Tensor
    p_cast: torch.Tensor
    p_soft: torch.Tensor
    fired: torch.Tensor


class _Dtypes:
    """The dtype each recorded dtype stands for under `config` (module docstring)."""

    def __init__(self, config: ReplayConfig):
        self.config = config

    @staticmethod
    def _of(fmt: Precision) -> torch.dtype:
        return _BY_PRECISION.get(fmt, torch.float32)

    def scores(self, recorded: str) -> torch.dtype:
        return self._of(self.config.s_dtype) if recorded in _LOW else _TORCH[recorded]

    def softmax(self, recorded: str) -> torch.dtype:
        return self._of(self.config.exp_dtype) if recorded in _LOW else _TORCH[recorded]

    def probs(self, recorded: str) -> torch.dtype:
        return self._of(self.config.p_dtype) if recorded in _LOW else _TORCH[recorded]

    def inputs(self, recorded: str) -> torch.dtype:
        return self._of(self.config.input_dtype) if recorded in _LOW else _TORCH[recorded]

    def output(self, recorded: str) -> torch.dtype:
        return self._of(self.config.o_dtype) if recorded in _LOW else _TORCH[recorded]


def _blocked(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: Optional[torch.Tensor],
             row0: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(blocked positions (bool) or None, the additive mask or None) for rows row0… of the scores."""
    T, S = q.shape[-2], k.shape[-2]
    blocked = None
    if causal:
        i = torch.arange(row0, row0 + T).view(T, 1)
        blocked = torch.arange(S).view(1, S) > i
    bias = None
    if mask is not None:
        if mask.dtype == torch.bool:
            blocked = ~mask if blocked is None else blocked | ~mask
        else:
            bias = mask
    return blocked, bias


def _apply_mask(s: torch.Tensor, op: Optional[PlainOp], blocked: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], dt: _Dtypes) -> torch.Tensor:
    """The layer's mask applied as op did: an additive term added in op's dtypes, blocked positions filled with
    op's value (masked_fill, where, setitem) or, for an add (a mask of the dtype's lowest value made boolean by
    capture), with the output dtype's lowest value."""
    out = dt.scores(op.out) if op is not None else s.dtype
    if bias is not None:
        term = bias.to(dt.scores(op.ins[1]) if op is not None and len(op.ins) > 1 else out)
        s = s + term
    s = s.to(out)
    if blocked is not None:
        if op is not None and op.op in ("masked_fill", "where", "setitem") and op.value is not None:
            fill = op.value
        elif op is not None and op.op in ("add", "sub"):
            fill = torch.finfo(out).min
        else:
            fill = -math.inf
        s = s.masked_fill(blocked, fill)
    return s


def _softmax(s: torch.Tensor, dtype: torch.dtype, config: ReplayConfig, exact: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, rows where the stabilized shift fired): the recorded softmax, or Algorithm 3's shift in its place."""
    if config.softmax is Softmax.STANDARD:
        p = model.softmax(s, dtype) if exact else torch.softmax(s, -1, dtype=dtype)
        return p, torch.zeros(s.shape[:-1], dtype=torch.bool)
    x = s.to(dtype)
    shift = block_shift(torch.full(s.shape[:-1], -math.inf), x.detach().float(), config)
    m = torch.where(torch.isfinite(shift.m), shift.m, torch.zeros_like(shift.m)).to(dtype).unsqueeze(-1)
    e = torch.exp(x - m)
    total = e.sum(-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(torch.finfo(dtype).tiny), torch.zeros_like(e))
    return p, shift.fired


class _Rounder:
    """A cast to a dtype: torch's (nearest-even), or with `config.rounding` stochastic the emulator's stochastic
    rounding (the repair and fix variants of the P and O casts), drawn from one generator seeded `config.seed`."""

    def __init__(self, config: ReplayConfig):
        self.stochastic = config.rounding is Rounding.STOCHASTIC
        self.generator = torch.Generator().manual_seed(config.seed) if self.stochastic else None

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self.stochastic or dtype == x.dtype or dtype not in _FORMAT:
            return x.to(dtype)
        from fa_forensics.replay.emulate.ops import cast

        return cast(x.float(), _FORMAT[dtype], Rounding.STOCHASTIC, self.generator).to(dtype)


def run_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig, *, causal: bool, scale: float,
            mask: Optional[torch.Tensor], row0: int = 0) -> PlainRun:
    """The recorded ops on q (B, H, R, D) (rows row0…), k, v (B, H, S, D), values in the input dtype."""
    recipe = config.plain
    assert recipe is not None
    exact = not config.plain_reexec
    dt = _Dtypes(config)
    first, last = recipe.ops[0], recipe.ops[-1]
    a_dtype = dt.inputs(first.ins[0]) if first.ins else dt.inputs(recipe.input_dtype)
    blocked, bias = _blocked(q, k, causal, mask, row0)
    mask_ops = [o for o in recipe.scores_ops if o.op in MASKS]
    masked = False
    if first.op == "baddbmm" and first.beta != 0 and (bias is not None or blocked is not None):
        base = bias if bias is not None else torch.zeros(()).masked_fill(blocked, -math.inf)
        s = model.product(first.op, q.to(a_dtype), k.to(a_dtype), dt.scores(first.out), exact,
                          alpha=first.alpha, base=base.to(dt.scores(first.out)))
        if bias is not None and blocked is not None:
            s = s.masked_fill(blocked, -math.inf)
        masked = True
    else:
        s = model.product(first.op, q.to(a_dtype), k.to(a_dtype), dt.scores(first.out), exact, alpha=first.alpha)
    for op in recipe.scores_ops:
        if op.op in SCALES:
            factor = scale if op.value is None else op.value
            s = (s / factor if op.op == "div" else s * factor).to(dt.scores(op.out))
        elif op.op in MASKS:
            if not masked:
                s = _apply_mask(s, op, blocked, bias, dt)
                masked = True
            else:
                s = s.to(dt.scores(op.out))
        elif op.op == "tanh":
            s = torch.tanh(s)
        elif op.op == "to":
            s = s.to(dt.scores(op.out))
    if not masked and (blocked is not None or bias is not None):
        s = _apply_mask(s, mask_ops[0] if mask_ops else None, blocked, bias, dt)
    softmax_dtype = dt.softmax(recipe.ops[recipe.softmax_at].out)
    rounder = _Rounder(config)
    if rounder.stochastic and softmax_dtype in _FORMAT:  # a softmax returned in low precision: rounded here
        p_soft, fired = _softmax(s, torch.float32, config, exact)
        p = rounder(p_soft, softmax_dtype)
    else:
        p_soft, fired = _softmax(s, softmax_dtype, config, exact)
        p = p_soft
    for op in recipe.probs_ops:
        if op.op == "to":
            p = rounder(p, dt.probs(op.out))
    p_in = dt.probs(last.ins[0]) if last.ins else p.dtype
    v_in = dt.inputs(last.ins[1]) if len(last.ins) > 1 else v.dtype
    pv = torch.promote_types(p_in, v_in)
    p = rounder(p, p_in)
    o = model.product(last.op, p.to(pv), v.to(pv).transpose(-1, -2), torch.float32 if rounder.stochastic else
                      dt.output(last.out), exact, values=True)
    o = rounder(o, dt.output(last.out))
    return PlainRun(o=o, scores=s.detach().float(), p_cast=p.detach(), p_soft=p_soft.detach(), fired=fired)


def _stats(run: PlainRun) -> PBarStats:
    s = run.scores
    top = s.amax(dim=-1, keepdim=True)
    repeated = ((s == top) & torch.isfinite(top)).sum(dim=-1) > 1
    B, H, T = s.shape[:3]
    return PBarStats(
        repeated_max_rows=repeated.sum(dim=-1),
        p_one_count=(run.p_cast == 1).sum(dim=(-1, -2)),
        stabilized_rows=run.fired.sum(dim=-1),
        p_zeroed=((run.p_soft > 0) & (run.p_cast == 0)).sum(dim=(-1, -2)),
        rows=torch.full((B, H), T, dtype=torch.int64),
    )


@dataclass
class PlainForward:
    """What the forward gives a replay: O (fp32 holding o_dtype values), lse, the P̄ statistics."""

    o: torch.Tensor
    lse: torch.Tensor
    stats: PBarStats


def _check(config: ReplayConfig) -> PlainRecipe:
    recipe = config.plain
    if recipe is None:
        raise ConfigError("replay.eager: the config carries no plain-attention recipe (ReplayConfig.plain)")
    if config.plain_reexec and (why := reexec_refusal(recipe)) is not None:
        raise ConfigError(f"preset eager-reexec: {why}")
    return recipe


def plain_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig, *, causal: bool,
                  scale: float, mask: Optional[torch.Tensor] = None, row0: int = 0) -> PlainForward:
    """The forward of the recorded ops (no gradients): q (B, H, R, D) rows row0…, fp32 holding input values."""
    recipe = _check(config)
    with torch.no_grad(), threads(recipe.threads if config.plain_reexec else None):
        run = run_ops(q, k, v, config, causal=causal, scale=scale, mask=mask, row0=row0)
    lse = torch.logsumexp(run.scores, dim=-1)
    return PlainForward(o=run.o.float(), lse=lse, stats=_stats(run))


@dataclass
class PlainGrads:
    delta: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def plain_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, o: torch.Tensor,
                   config: ReplayConfig, *, causal: bool, scale: float,
                   mask: Optional[torch.Tensor] = None) -> PlainGrads:
    """dQ, dK, dV by autograd through the recorded ops (the leaves in the input dtype, as autocast's casts
    hand them back), and δ = rowsum(dO ∘ O) in fp32 of the replayed O."""
    recipe = _check(config)
    leaves = [x.detach().to(_Dtypes(config).inputs(recipe.input_dtype)).requires_grad_() for x in (q, k, v)]
    with torch.enable_grad(), threads(recipe.threads if config.plain_reexec else None):
        run = run_ops(*leaves, config, causal=causal, scale=scale, mask=mask)
        dq, dk, dv = torch.autograd.grad(run.o, leaves, do.to(run.o.dtype), allow_unused=True)
    zeros = [torch.zeros(x.shape) for x in (q, k, v)]
    dq, dk, dv = (z if g is None else g.float() for g, z in zip((dq, dk, dv), zeros))
    delta = (do.float() * o.float()).sum(dim=-1)
    return PlainGrads(delta=delta, dq=dq, dk=dk, dv=dv)


def plain_replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ReplayConfig,
                 do: Optional[torch.Tensor] = None, *, causal: bool, scale: float,
                 mask: Optional[torch.Tensor] = None):
    """`replay` of a config with a plain-attention recipe: the whole layer at once (a GEMM's blocking may depend
    on its shape), forward and, with dO, backward (replay/out.ReplayOut)."""
    from fa_forensics.replay.emulate.ops import torch_dtype
    from fa_forensics.replay.emulate.ops import to_input_dtype
    from fa_forensics.replay.out import ReplayOut

    q32, k32, v32 = (to_input_dtype(x, config) for x in (q, k, v))
    mask = None if mask is None else mask.detach().cpu()
    fwd = plain_forward(q32, k32, v32, config, causal=causal, scale=scale, mask=mask)
    grads = None
    if do is not None:
        grads = plain_backward(q32, k32, v32, to_input_dtype(do, config), fwd.o, config, causal=causal, scale=scale,
                               mask=mask)
    return ReplayOut(o=fwd.o.to(torch_dtype(config.o_dtype)), lse=fwd.lse, stats=fwd.stats,
                     delta=None if grads is None else grads.delta, dq=None if grads is None else grads.dq,
                     dk=None if grads is None else grads.dk, dv=None if grads is None else grads.dv, config=config,
                     backend="emulate", accumulation=config.accumulation.value)
