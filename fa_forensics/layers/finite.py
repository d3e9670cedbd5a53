"""Non-finite inputs: heads whose stored values are NaN / Inf, or so large that the fp32 replay
overflows, are left out of an analysis, and a warning names them; never a NaN presented as a finding.

A diverged run has NaNs, so this is real data, not only bad input. Per head of one layer-step:
- q, k, v, o, do: a head with any NaN or Inf is left out (named with the array and the count);
- a head with a value above 2^60 in any of them (its square overflows fp32 in the statistics), or
  whose logits can overflow fp32 (|q|max·|k|max·D·α above fp32's largest value / 16), is left out too;
- x (B, T, C), shared by the heads: with non-finite values it is dropped (set to None), and the
  analyses that need X say so.
When no head is left, `NothingFinite` (a one-line DumpError, CLI exit 2) names what was found.
"""
from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Optional

import torch

from fa_forensics.errors import DumpError

FP32_MAX = float(torch.finfo(torch.float32).max)
OVERFLOW = FP32_MAX / 16  # headroom for the sums of a replay
LARGE = 2.0**60  # a value above it overflows fp32 once squared (variances) or summed with its kind


class NothingFinite(DumpError):
    """Every selected head of a layer-step holds non-finite (or overflowing) inputs."""


def _count(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a tensor."""
    f = t.float()
    return int(torch.isnan(f).sum()), int(torch.isinf(f).sum())


def _describe(nan: int, inf: int, total: int) -> str:
    parts = [f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n]
    return f"{' and '.join(parts)} of {total} values"


def _head_max(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """max |t| per head (dim 1) over finite values, as float64: (h,)."""
    if t is None:
        return None
    a = t.float().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return a.transpose(0, 1).reshape(a.shape[1], -1).amax(dim=1).double()


def _problems(tensors: dict[str, Optional[torch.Tensor]], scale: float) -> dict[int, list[str]]:
    """Storage position in dim 1 -> what is wrong with that head (empty when every head is fine)."""
    bad: dict[int, list[str]] = {}
    for name in ("q", "k", "v", "o", "do"):
        arr = tensors.get(name)
        if arr is None:
            continue
        f = arr.float()
        per_head = (~torch.isfinite(f)).transpose(0, 1).reshape(f.shape[1], -1).sum(dim=1)
        for pos in torch.nonzero(per_head).flatten().tolist():
            nan, inf = _count(arr[:, pos])
            bad.setdefault(pos, []).append(f"{name} holds {_describe(nan, inf, arr[:, pos].numel())}")
    q = tensors["q"]
    D = q.shape[-1]
    q_max, k_max = _head_max(q), _head_max(tensors["k"])
    logit_bound = q_max * k_max * D * abs(scale)
    for name in ("q", "k", "v", "o", "do"):
        top = _head_max(tensors.get(name))
        if top is None:
            continue
        for pos in torch.nonzero(top > LARGE).flatten().tolist():
            if pos not in bad:
                bad[pos] = [f"{name} holds values up to {float(top[pos]):.3g}, which overflow fp32 in the replay's "
                            "sums and statistics"]
    for pos in torch.nonzero(logit_bound > OVERFLOW).flatten().tolist():
        if pos not in bad:
            bad[pos] = [f"q·k logits up to {float(logit_bound[pos]):.3g} overflow fp32"]
    return bad


# dump -> {"left_out": warnings of what `screen` left out (attached to every layer of that dump by
# the layer check), "screened": (step, layer, heads) -> (heads kept, warnings)}
_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def screen(dump, selections: list) -> list:
    """The selections without the heads whose inputs are non-finite or overflow fp32 (one read per
    layer-step, cached), and without layer-steps left with no head. Raises NothingFinite when
    nothing is left; the warnings reach every analysed layer through `left_out_warnings`."""
    out = []
    state = _STATE.setdefault(dump, {"left_out": [], "screened": {}})
    messages, screened = state["left_out"], state["screened"]
    for sel in selections:
        key = (sel.step, sel.layer, tuple(sel.heads))
        if key not in screened:
            info = dump.layer_info(sel.step, sel.layer)
            tensors = {n: dump.read(sel.step, sel.layer, n, heads=sel.heads)
                       if dump.has(sel.step, sel.layer, n) else None
                       for n in ("q", "k", "v", "o", "do")}
            bad = _problems(tensors, info.scale if info.scale and info.scale > 0 else 1.0)
            keep = [h for i, h in enumerate(sel.heads) if i not in bad]
            found = [f"step {sel.step} layer {sel.layer} head {sel.heads[pos]}: {'; '.join(why)}; head left out of the "
                     "analysis"
                     for pos, why in sorted(bad.items())]
            screened[key] = (keep, found)
        keep, found = screened[key]
        messages.extend(m for m in found if m not in messages)
        if keep:
            out.append(replace(sel, heads=keep))
    if not out:
        raise NothingFinite(f"{dump.path}: no selected head has finite inputs ({messages[0]}); nothing to analyse: "
                            "select other steps, layers or heads, or capture before the run diverged")
    return out


def left_out_warnings(dump) -> list[str]:
    """What `screen` left out of this dump's selections (one line each)."""
    try:
        return list(_STATE.get(dump, {}).get("left_out", []))
    except TypeError:  # not weak-referenceable (an in-memory stand-in)
        return []


def finite_x(t, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], list[str]]:
    """x if every value is finite, else None and a warning naming the count."""
    if x is None or torch.isfinite(x.float()).all():
        return x, []
    nan, inf = _count(x)
    return None, [f"{t.where}: x holds {_describe(nan, inf, x.numel())}; x is left out (analyses that need X skip this "
                  "layer)"]
