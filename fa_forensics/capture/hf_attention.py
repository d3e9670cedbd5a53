"""Hugging Face transformers' attention registry: every model's attention, whatever its attn_implementation.

transformers looks up each layer's attention function at every forward in its registry
(`AttentionInterface`, shared as `ALL_ATTENTION_FUNCTIONS`: sdpa, flash_attention_2/3/4, flex_attention,
paged|eager, and any function registered with `AttentionInterface.register`), through
`get_interface(name, default)` (the model's own `eager_attention_forward` is the default for "eager")
or `[name]`. Both lookups are patched when transformers' modeling_utils is imported: on busy steps
they return the function wrapped (on other steps, and inside compiled code, the function itself).

HF's convention: `fn(module, query, key, value, attention_mask, *, scaling, dropout, ...)` with query
(B, H, T, D), key and value (B, Hkv, S, D), returning `(attn_output (B, T, H, D), attn_weights)`.

A wrapped call is a frame for the calls inside it: torch's SDPA (HF's sdpa), flash_attn, flex_attention
and attention written in torch ops (HF's eager) are recorded as they are, each with `hf_attention` = the
registry name, once. Only when nothing inside was seen (a kernel fa-forensics does not watch) is the
call itself read by `hf_call_facts`, in HF's layouts (checked): its attention_mask (4-D bool or additive,
a 2-D padding mask, or a flex BlockMask), scaling, dropout and is_causal (else the module's `is_causal`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch

from fa_forensics.capture import current
from fa_forensics.capture.adapters import causal_mask
from fa_forensics.capture.entry_points import CallFacts, EntryPoint
from fa_forensics.capture.layouts import check_attention_shapes, o_grad_sink, to_bhtd

_MODULE = "transformers.modeling_utils"


def _watched(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` reporting to the active session as a frame named `name` (see the module docstring)."""

    @functools.wraps(fn)
    def hf_attention(*args: Any, **kwargs: Any) -> Any:
        session = current.session  # compiled code first: traced code must not read `busy` (a guard)
        if torch.compiler.is_compiling() or session is None or not session.busy:
            return fn(*args, **kwargs)
        return session.hf_attention_call(name, fn, args, kwargs)

    hf_attention._fa_forensics_hf = name  # type: ignore[attr-defined]  # a mark on the function object, read with getattr
    return hf_attention


def _wrap_lookup(lookup: Callable[..., Any]) -> Callable[..., Any]:
    """A registry lookup (`get_interface(name, default)` or `[name]`) that returns watched functions on busy steps."""

    @functools.wraps(lookup)
    def watched_lookup(self: Any, *args: Any, **kwargs: Any) -> Any:
        fn = lookup(self, *args, **kwargs)
        session = current.session
        if (torch.compiler.is_compiling() or session is None or not session.busy or not callable(fn)
                or getattr(fn, "_fa_forensics_hf", None) is not None):
            return fn
        name = args[0] if args else kwargs.get("attn_implementation", kwargs.get("key"))
        return _watched(fn, str(name))

    return watched_lookup


def hf_entry_points() -> list[EntryPoint]:
    """The registry's lookups, patched when transformers' modeling_utils is imported."""
    return [EntryPoint(_MODULE, f"AttentionInterface.{lookup}", adapter=None,
                       label=f"transformers.AttentionInterface.{lookup}", wrap=_wrap_lookup)
            for lookup in ("get_interface", "__getitem__")]


def _block_mask(mask: Any, q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    from torch.nn.attention.flex_attention import create_mask

    bB, bH = mask.kv_num_blocks.shape[:2]
    with torch.no_grad():
        dense = create_mask(mask.mask_mod, int(bB), int(bH), q.shape[2], k.shape[2], device=q.device)
    return None if bool(dense.all()) else dense


def hf_call_facts(name: str, args: tuple, kwargs: dict, out: Any) -> Optional[CallFacts]:
    """One call of a registry function read by HF's convention; None when it did not pass tensors."""
    bound = dict(zip(("module", "query", "key", "value", "attention_mask"), args))
    bound.update(kwargs)
    q, k, v, module, mask = (bound.get(n) for n in ("query", "key", "value", "module", "attention_mask"))
    o = out[0] if isinstance(out, (tuple, list)) and out else out
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(o, torch.Tensor)):
        return None
    where = f"transformers attention function {name!r}"
    check_attention_shapes(q, k, v, o, "BHTD", where, o_layout="BTHD")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)  # HF's own default (its sdpa function)
    T, S = q.shape[2], k.shape[2]
    attrs: dict[str, Any] = {"layout": "BHTD", "o_layout": "BTHD", "hf_attention": name}
    causal, stored, warning = False, None, None
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        causal = bool(is_causal) and T > 1
        if isinstance(mask, torch.Tensor):  # (B, S) padding: 1 = a real token
            stored = mask.bool()[:, None, None, :]
        if causal and T != S:  # aligned bottom-right, as flash_attn does
            allowed = causal_mask(T, S, q.device).view(1, 1, T, S)
            stored = allowed if stored is None else stored & allowed
            causal = False
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        stored = mask
    elif hasattr(mask, "mask_mod") and hasattr(mask, "kv_num_blocks"):
        stored = _block_mask(mask, q, k)
        attrs["block_mask"] = getattr(mask.mask_mod, "__name__", type(mask.mask_mod).__name__)
    else:
        warning = (f"fa-forensics capture: {where} got an attention_mask of type {type(mask).__name__}, which is "
                   "not recorded; replays of these layers ignore it")
    unreplayed = [n for n in ("softcap", "s_aux", "sinks") if kwargs.get(n) is not None]
    if kwargs.get("sliding_window") is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        unreplayed.append("sliding_window")
    if unreplayed:
        attrs["not_replayed"] = unreplayed
        warning = (f"fa-forensics capture: {where} was called with {', '.join(unreplayed)}, which replays do not "
                   "model; Q, K, V, O are recorded, but a replay of these layers will not reproduce O")
    scale, dropout = kwargs.get("scaling"), kwargs.get("dropout", 0.0)
    return CallFacts(q, k, v, to_bhtd(o, "BTHD"), scale=None if scale is None else float(scale), causal=causal,
                     mask=stored, dropout_p=float(dropout or 0.0),
                     grad_sink=o_grad_sink(o, lambda g: to_bhtd(g, "BTHD")), attrs=attrs, warning=warning)
