"""The recorder: what of one attention call goes into the store, in which dtype and layout.

Given an `AttentionCall` of a selected layer, it selects the batch slice and heads, expands
grouped-query K/V to one head per query head, casts fp32 inputs to autocast's dtype (what the
kernel computed with), builds the layer attributes, and hands each array to `put(step, layer,
name, tensor, layer_attrs)` (the session routes it to the background writer or the ring). dO
arrives later, from the hook it leaves on O (or with the compiled graph's `tap_grad`); `missing_do(step)`
says which recorded layers of an ended step got none, and why.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from fa_forensics.capture.events import AttentionCall
from fa_forensics.capture.selection import CaptureSelection, InvalidCaptureSetting

Put = Callable[[int, int, str, torch.Tensor, dict], None]

# why a recorded layer has no dO
NO_GRADIENT = "its O had no gradient (computed without autograd, or detached)"
NOT_REACHED = "the backward pass did not reach its O (O was not used in the loss, or backward was not called)"


def attention_mask_for_store(mask: torch.Tensor, batch: Optional[slice],
                             head_index: Optional[torch.Tensor]) -> torch.Tensor:
    """SDPA's attn_mask as stored: 4-D (B' or 1, H' or 1, Tq, Tk), batch slice and heads applied to the
    dims that are not broadcast. Boolean masks stay boolean (True = may attend); an additive mask whose
    values are all 0 or -inf / the dtype's lowest value becomes boolean too, unless a row blocks every
    key (with the lowest value such a row is a uniform softmax, which a boolean mask would not say); any
    other additive mask (a bias such as ALiBi) is kept as given."""
    m = mask.detach()
    m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() < 4 else m
    if batch is not None and m.shape[0] > 1:
        m = m[batch]
    if head_index is not None and m.shape[1] > 1:
        m = m.index_select(1, head_index.to(m.device))
    if m.dtype != torch.bool:
        allowed = m == 0
        blocked = torch.isneginf(m) | (m <= torch.finfo(m.dtype).min)
        if bool((allowed | blocked).all()) and bool(allowed.any(dim=-1).all()):
            m = allowed
    return m


class Recorder:
    """Turns selected attention calls into store arrays (see the module docstring)."""

    def __init__(self, selection: CaptureSelection, put: Put, on_backward: Callable[[], None]):
        self.selection = selection
        self._put = put
        self._on_backward = on_backward  # told when a dO arrived (micro-batch detection without a module tree)
        self.do_waiting: dict[int, dict[int, str]] = {}  # step -> layer -> why its dO has not come (yet)

    def record(self, call: AttentionCall) -> bool:
        """Queue q, k, v, o, x and mask of `call` and arrange for its dO; False if the call cannot be stored
        (not 4-D)."""
        q, k, v, o = call.q, call.k, call.v, call.o
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or o.dim() != 4:
            return False
        B, H, T, D = q.shape
        heads = self.selection.heads
        if heads is not None and heads[-1] >= H:
            raise InvalidCaptureSetting("heads",
                                        f"{list(heads)} asks for head {heads[-1]} but layer {call.layer} has {H} heads "
                                        f"(0..{H - 1})")
        batch = self.selection.batch
        if batch is not None and len(range(*batch.indices(B))) == 0:
            raise InvalidCaptureSetting("batch",
                                        f"{batch.start}:{'' if batch.stop is None else batch.stop} selects no sample "
                                        "of layer "
                                        f"{call.layer}'s batch of {B} (0..{B - 1}); choose a slice within it, e.g. "
                                        f"0:{min(B, 2)}")
        head_index = None if heads is None else torch.tensor(heads, device=q.device)
        dtype = call.kernel_dtype
        batch = self.selection.batch

        def select(t: torch.Tensor, per_head: bool = True, kv: bool = False) -> torch.Tensor:
            t = t.detach()
            if batch is not None:
                t = t[batch]
            if per_head:
                if kv and t.shape[1] != H:  # grouped-query attention: one K/V head per group of query heads
                    kv_index = torch.arange(H, device=t.device) // (H // t.shape[1])
                    t = t.index_select(1, kv_index if head_index is None else kv_index[head_index])
                elif head_index is not None:
                    t = t.index_select(1, head_index)
            return t

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() and t.dtype == torch.float32 and t.dtype != dtype else t

        attrs = {  # n_heads = heads stored; `heads` = the model's numbers of the stored heads
            "module": call.x.name if call.x is not None else call.source,
            "n_heads": int(H if heads is None else len(heads)),
            "heads": list(range(H)) if heads is None else [int(h) for h in heads],
            "head_dim": int(D),
            "scale": float(call.scale) if call.scale is not None else 1.0 / math.sqrt(D),
            "causal": bool(call.causal),
            "dtype": str(dtype).replace("torch.", ""),
            "input_dtype": str(q.dtype).replace("torch.", ""),
            "autocast": call.autocast_dtype is not None,
            "dropout_p": float(call.dropout_p),
            "device_type": q.device.type,
            "autocast_dtype": "none" if call.autocast_dtype is None else str(call.autocast_dtype).replace("torch.", ""),
            **(call.extra or {}),
        }
        mask = None
        if call.mask is not None:
            mask = attention_mask_for_store(call.mask, batch, head_index)
            attrs["mask"] = "bool" if mask.dtype == torch.bool else "additive"
        step, layer = call.step, call.layer
        for name, tensor in (("q", cast(select(q))), ("k", cast(select(k, kv=True))), ("v", cast(select(v, kv=True))),
                             ("o", select(o))):
            self._put(step, layer, name, tensor, attrs)
        if call.x is not None:
            self._put(step, layer, "x", select(call.x.tensor, per_head=False), attrs)
        if mask is not None:
            self._put(step, layer, "mask", mask, attrs)

        def do_hook(grad: torch.Tensor) -> None:
            self._put(step, layer, "do", select(grad), attrs)
            self.do_waiting.get(step, {}).pop(layer, None)
            self._on_backward()

        if call.grad_sink is not None:
            call.grad_sink(do_hook)
        elif o.requires_grad:
            o.register_hook(do_hook)
        else:
            self.do_waiting.setdefault(step, {})[layer] = NO_GRADIENT
            return True
        self.do_waiting.setdefault(step, {})[layer] = NOT_REACHED
        return True

    def missing_do(self, step: int) -> dict[str, list[int]]:
        """The recorded layers of `step` without dO, by reason (call when the step has ended); forgets the step."""
        missing: dict[str, list[int]] = {}
        for layer, reason in sorted(self.do_waiting.pop(step, {}).items()):
            missing.setdefault(reason, []).append(layer)
        return missing
