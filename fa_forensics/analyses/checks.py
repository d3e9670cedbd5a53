"""The layer checks: what `selection.load` warns about on each layer-step it reads.

Each check is a function `(t: LayerTensors, dump, info) -> iterable of one-line warnings`
registered with `@layer_check`; `info` is the layer's attrs (`dump.layer_info(step, layer)`),
`dump` is None for layers built in memory. A warning names where (`t.where`), what was found and
what it means for the findings. Checks added here run for every analysis, and their messages reach
each Result's `warnings`, its JSON and the CLI's stderr (one yellow line each).
"""
from __future__ import annotations

import torch

from fa_forensics.analyses.selection import layer_check  # noqa: F401  (the decorator checks below use)


@layer_check
def attention_dropout(t, dump, info):
    """A layer captured with attention dropout: stored O is not attention of the stored Q, K, V."""
    p = float(getattr(info, "dropout_p", 0.0) or 0.0)
    if p > 0:
        yield (f"{t.where}: captured with attention dropout p={p:g}; stored O includes dropout, so it is not attention of "
               f"the stored Q, K, V and any comparison with it (replay fidelity, bitdiff against stored O) measures dropout, "
               f"not rounding; the replays of Q, K, V are unaffected")


@layer_check
def attention_mask(t, dump, info):
    """A layer captured with an attn_mask: say where the mask is applied and where it is not."""
    if t.mask is not None:
        allowed = t.mask if t.mask.dtype == torch.bool else ~t.mask.isneginf()
        empty = int((~allowed).all(dim=-1).sum())
        rows = f"; {empty} (batch, head, query) rows allow no key (O = 0 there, as SDPA)" if empty else ""
        yield (f"{t.where}: captured with an attention mask ({getattr(info, 'mask', None) or 'bool'}); every replay and "
               f"every score, P̄ and P the analyses form apply it{rows}")


@layer_check
def non_finite_inputs(t, dump, info):
    """Heads that selection.select left out for NaN / Inf / overflowing inputs (analyses/finite.py)."""
    from fa_forensics.analyses.finite import left_out_warnings

    return left_out_warnings(dump) if dump is not None else ()
