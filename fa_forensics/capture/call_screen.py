"""What happens to an attention call between being seen and being stored: its layout, and its first-call check.

`relaid` takes a call to the reading of its layout the shapes around it fit (capture/layouts.py): q, k, v,
o and dO transposed to (B, H, T, D) (views; dO through a hook on the O autograd saw). `SourceChecks` runs
capture/first_call_check.py once per source at its first recorded call and keeps the sources it refused:
their calls are not stored (training goes on), and the store's attributes say why.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from fa_forensics.capture.first_call_check import FirstCallCheck, check_first_call
from fa_forensics.capture.layouts import Reading

GradHook = Callable[[torch.Tensor], object]
GradSink = Callable[[GradHook], None]


def relaid(reading: Reading, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
           mask: Optional[torch.Tensor], grad_sink: Optional[GradSink], *, mask_follows_q: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                      Optional[GradSink]]:
    """The call's tensors as `reading` lays them out. mask_follows_q: the mask was shaped like q's leading dims
    (attention in torch ops); an SDPA-style mask a function was given stays as given."""
    if reading.swap is None:
        return q, k, v, o, mask, grad_sink
    q2, k2, v2, o2 = (reading.apply(t) for t in (q, k, v, o))
    mask2 = reading.apply(mask) if mask_follows_q and mask is not None else mask
    sink: Optional[GradSink] = None
    if grad_sink is not None:
        inner = grad_sink

        def sink(hook: GradHook) -> None:
            inner(lambda grad: hook(reading.apply(grad)))
    elif o.requires_grad:
        def sink(hook: GradHook, o: torch.Tensor = o) -> None:
            o.register_hook(lambda grad: hook(reading.apply(grad)))
    return q2, k2, v2, o2, mask2, sink


@dataclass
class SourceChecks:
    """The first-call check per source (see the module docstring)."""

    results: dict[str, FirstCallCheck] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # source -> the line that said why

    def check(self, source: str, where: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
              scale: Optional[float], causal: bool, mask: Optional[torch.Tensor], extra: dict, dropout_p: float,
              kernel_dtype: torch.dtype) -> Optional[str]:
        """None when the source's calls may be stored; else the line that says why not (new refusals and old)."""
        if source in self.refused:
            return self.refused[source]
        if source in self.results:
            return None
        try:
            result = check_first_call(q, k, v, o, scale=scale, causal=causal, mask=mask,
                                      softcap=extra.get("softcap"), dropout_p=dropout_p, kernel_dtype=kernel_dtype,
                                      not_replayed=tuple(extra.get("not_replayed") or ()))
        except Exception as exc:  # a check that cannot run never stops training, nor refuses the source
            result = FirstCallCheck(skipped=f"the check could not run ({type(exc).__name__}: {exc})")
        self.results[source] = result
        if result.reproduced:
            return None
        line = (f"fa-forensics capture: {where}: its O does not follow from the Q, K, V it was read with: "
                f"|O − softmax(Q·Kᵀ·scale)·V| = {result.error:.3g} where the rounding of "
                f"{str(kernel_dtype).replace('torch.', '')} allows {result.tolerance:.3g} (max |Δ| "
                f"{result.max_error:.3g}; q {tuple(q.shape)}, k "
                f"{tuple(k.shape)}, v {tuple(v.shape)} as (B, H, T, D), scale "
                f"{'1/√head_dim' if scale is None else f'{scale:.6g}'}, causal {causal}, mask "
                f"{'none' if mask is None else 'bool' if mask.dtype == torch.bool else 'additive'}); its calls are not "
                "recorded, training goes on. Check which arguments hold q, k and v (q=, k=, v= in --attention), the "
                "layout, scale, causal and mask")
        self.refused[source] = line
        return line

    def attrs(self, source: str) -> dict:
        """{"first_call_check": ...} for the layers of `source`, once checked."""
        result = self.results.get(source)
        return {} if result is None else {"first_call_check": result.attrs()}
