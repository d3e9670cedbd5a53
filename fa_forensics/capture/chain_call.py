"""One attention chain of torch ops (capture/torch_ops.py) as one call: (B, H, T, D) tensors, a mask, causal.

The products of a chain fix the last two dims of every tensor ((T, D), (S, D), (T, S)); the leading dims
are read as (B, H) for 4-D tensors, split with X's batch (else the module's head count) for (B·H)-folded
ones, and as B then heads folded for 5 or more. The mask terms are applied in their order to one mask,
boolean where that says the same as the additive values, and a mask that is exactly causal becomes
causal=True.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from fa_forensics.capture.torch_ops import MaskTerm, PlainCall

TensorMap = Callable[[torch.Tensor], torch.Tensor]


def _collapse_broadcast(t: torch.Tensor) -> torch.Tensor:
    """`t` with each expanded dim (stride 0) taken back to size 1: a mask expanded for an op is stored once."""
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for stride, size in zip(t.stride(), t.shape))
    return t[index]


def _broadcast_lead(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(t.shape[:-2] for t in tensors)))


def to_heads(call: PlainCall, batch: Optional[int], heads: Optional[int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TensorMap, TensorMap]:
    """Q, K, V, O of a chain as (B, H, T, D) tensors, and a function giving any (…, T, S) tensor of the
    chain (a mask) the same (B or 1, H or 1, T, S) form, and a converter for dO.

    4-D chains read their leading dims as (B, H). A 3-D chain ((B·H), T, D) is split with `batch` (X's
    batch) or else `heads` (the module's head count); with neither, each row is one sequence with one head.
    Chains of 5 or more dims keep dim 0 as B and fold the rest into H."""
    lead = _broadcast_lead(call.q, call.k, call.v, call.o)
    n = len(lead)
    if n == 2:
        B, H = lead
    elif n == 1:
        (BH,) = lead
        if batch and BH % batch == 0:
            B, H = batch, BH // batch
        elif heads and BH % heads == 0:
            B, H = BH // heads, heads
        else:
            B, H = BH, 1
    else:
        B, H = lead[0], math.prod(lead[1:])

    def shape4(t: torch.Tensor) -> torch.Tensor:
        """A tensor whose leading dims broadcast to `lead`, as (B', H', ·, ·)."""
        tail = t.shape[-2:]
        own = (1,) * (n - (t.dim() - 2)) + tuple(t.shape[:-2])
        if n == 2:
            return t.reshape(*own, *tail)
        if n == 1:
            if own[0] == 1:
                return t.reshape(1, 1, *tail)
            return t.reshape(B, H, *tail)
        if all(d == 1 for d in own[1:]):
            return t.reshape(own[0], 1, *tail)
        return t.expand(own[0] if own[0] == 1 else B, *lead[1:], *tail).reshape(own[0] if own[0] == 1 else B, H,
                                                                                  *tail)

    def kv(t: torch.Tensor) -> torch.Tensor:
        t4 = shape4(t)
        if t4.shape[0] == B and (t4.shape[1] == H or (t4.shape[1] and H % t4.shape[1] == 0)):
            return t4
        return t4.expand(B, H, *t4.shape[2:])

    q4 = shape4(call.q).expand(B, H, *call.q.shape[-2:])
    o4 = shape4(call.o).expand(B, H, *call.o.shape[-2:])

    def grad4(g: torch.Tensor) -> torch.Tensor:
        return shape4(call.o_convert(g) if call.o_convert is not None else g)

    return q4, kv(call.k), kv(call.v), o4, shape4, grad4


def combine_mask(call: PlainCall, shape4: TensorMap) -> tuple[Optional[torch.Tensor], bool]:
    """(mask, causal) of a chain: mask None, bool (True = may attend) or additive (B', H', T, S).

    The terms are applied in their order to zeros (a bias adds, blocked positions take their fill
    value). The result is boolean when it only keeps (0) or blocks (−inf, or the dtype's lowest value)
    and no row is blocked whole (a row blocked with a finite value is a uniform softmax in the model,
    which a boolean mask would not say); a mask that is exactly causal (T = S, the lower triangle on
    every head) is returned as causal=True without a mask, one that blocks nothing as no mask."""
    final = call.scores_shape
    T, S = final[-2:]

    def fitted(term: MaskTerm) -> torch.Tensor:
        t = _collapse_broadcast(term.tensor.detach())
        if term.shape != final:  # applied before a reshape of the scores: take it to their final shape
            t = t.expand(term.shape).reshape(final)
        t = t.expand(*t.shape[:-2], T, S) if t.dim() >= 2 else t.expand(T, S)
        return shape4(t)

    if not call.terms:
        return None, False
    terms = [(term, fitted(term)) for term in call.terms]
    if len(terms) == 1 and terms[0][0].kind == "bias":
        mask = terms[0][1] if terms[0][1].is_floating_point() else terms[0][1].float()
    elif all(term.kind == "blocked" and math.isinf(term.value) for term, _ in terms):
        blocked = terms[0][1]
        for _, t in terms[1:]:
            blocked = blocked | t
        mask = ~blocked
    else:
        mask = torch.zeros((), dtype=torch.float32, device=terms[0][1].device)
        for term, t in terms:
            mask = mask + t.float() if term.kind == "bias" else mask.masked_fill(t, term.value)
    allowed: Optional[torch.Tensor]
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        keep = mask == 0
        block = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
        whole_rows = bool((~keep).all(dim=-1).any())
        allowed = keep if bool((keep | block).all()) and not whole_rows else None
    if allowed is None:
        return mask, False
    if bool(allowed.all()):
        return None, False
    if T == S and bool((allowed == torch.ones(T, S, dtype=torch.bool, device=allowed.device).tril()).all()):
        return None, True
    return allowed, False


