"""The layer checks: what `selection.load` warns about on each layer-step it reads.

Each check is a function `(t: LayerTensors, dump, info) -> iterable of one-line warnings`
registered with `@layer_check` (this module holds the registry; `selection.load` runs it through
`with_checks`); `info` is the layer's attrs (`dump.layer_info(step, layer)`),
`dump` is None for layers built in memory. A warning names where (`t.where`), what was found and
what it means for the findings. Checks added here run for every analysis, and their messages reach
each Result's `warnings`, its JSON and the CLI's stderr (one yellow line each).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from fa_forensics.layers.finite import left_out_warnings

LayerCheck = Callable[[object, object, object], Iterable[str]]  # (LayerTensors, dump, info) -> warnings
LAYER_CHECKS: list[LayerCheck] = []


def layer_check(fn: LayerCheck) -> LayerCheck:
    """Register `fn(t, dump, info) -> iterable of one-line warnings`, run by `selection.load` on every layer-step.

    `info` is `dump.layer_info(step, layer)` (the layer's attrs), `dump` may be None for layers
    built in memory. A check names where (`t.where`) and what it means for the findings.
    """
    LAYER_CHECKS.append(fn)
    return fn


def with_checks(t, dump=None, info=None):
    """The LayerTensors `t` with the warnings of every registered check (registration order, no repeats)."""
    found = list(t.warnings)
    for check in LAYER_CHECKS:
        for message in check(t, dump, info) or ():
            if message not in found:
                found.append(message)
    return replace(t, warnings=tuple(found))


@layer_check
def attention_dropout(t, dump, info):
    """A layer captured with attention dropout: stored O is not attention of the stored Q, K, V."""
    p = float(getattr(info, "dropout_p", 0.0) or 0.0)
    if p > 0:
        yield (f"{t.where}: captured with attention dropout p={p:g}; stored O includes dropout, so it is not attention "
               "of the stored Q, K, V and any comparison with it (replay fidelity, bitdiff against stored O) measures "
               "dropout, not rounding; the replays of Q, K, V are unaffected")


@layer_check
def attention_mask(t, dump, info):
    """A layer captured with an attn_mask: one line for the run (the same text in every layer-step, so it is
    said once), and per step the (batch, head, query) rows that allow no key, counted as the replay applies
    the mask: broadcast over batch and heads, and with the causal rule where the layer is causal."""
    if t.mask is None:
        return
    yield (f"captured with an attention mask ({getattr(info, 'mask', None) or 'bool'}); every replay and every "
           "score, P̄ and P the analyses form apply it (the GPU kernels' backward models do not model masks: under "
           "their presets the backward there is the emulator's reference backward)")
    B, H, T = t.q.shape[:3]
    K = t.k.shape[-2]
    allowed = t.mask if t.mask.dtype == torch.bool else ~t.mask.isneginf()
    allowed = allowed.expand(B, H, T, K)
    if t.causal:
        allowed = allowed & torch.ones(T, K, dtype=torch.bool).tril()  # the replay's causal rule: key ≤ query
    empty = int((~allowed).all(dim=-1).sum())
    if empty:
        yield (f"step {t.step}: {empty} of {B * H * T} (batch, head, query) rows allow no key under the mask "
               "(O = 0 there, as SDPA)")


@layer_check
def non_finite_inputs(t, dump, info):
    """Heads that selection.select left out for NaN / Inf / overflowing inputs (layers/finite.py)."""
    return left_out_warnings(dump) if dump is not None else ()
