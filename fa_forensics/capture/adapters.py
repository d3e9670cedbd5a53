"""Built-in adapters: what a call of flash_attn, xformers or flex_attention means as (Q, K, V, O, mask).

Each adapter reads one call by the library's own signature and layout and returns `CallFacts`
with (B, H, T, D) views; the patch is installed only where the library is imported (see
capture/entry_points.py), so a run without the library pays nothing.

- flash_attn (B, T, H, D): flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func;
  the varlen forms (packed sequences of total length N, cu_seqlens) are recorded as one batch row
  (1, H, N, D) with a block-diagonal boolean mask (and causal inside each sequence, aligned
  bottom-right as flash_attn does), causal=False. causal with Tq != Tk is recorded as that mask too.
  softcap is the layer's `softcap` (replays apply it); window_size and alibi_slopes are not replayed: the call
  is recorded with a warning.
- xformers.ops.memory_efficient_attention (B, M, H, K, or (B, M, K) as one head): attn_bias None;
  LowerTriangularMask as causal (square); any other AttentionBias (BlockDiagonalMask, its causal
  forms, ...) through its own `materialize()`, stored as a boolean mask where it is 0/-inf and as
  an additive bias otherwise; a tensor bias as an additive bias.
- torch.nn.attention.flex_attention.flex_attention (B, H, T, D): a block_mask is stored as the
  boolean mask its mask_mod gives; a score_mod cannot be replayed: recorded, named, warned about.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from fa_forensics.capture.entry_points import CallFacts, EntryPoint
from fa_forensics.capture.layouts import check_attention_shapes, o_grad_sink, to_bhtd


def _bthd(t: torch.Tensor) -> torch.Tensor:
    return to_bhtd(t, "BTHD")


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _output(out: Any) -> Optional[torch.Tensor]:
    o = out[0] if isinstance(out, (tuple, list)) and out else out
    return o if isinstance(o, torch.Tensor) else None


def causal_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """(tq, tk) bool, True where query i may see key j: j <= i + (tk - tq) (bottom-right aligned)."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return j <= i + (tk - tq)


def block_diagonal_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, device: torch.device) -> torch.Tensor:
    """(1, 1, Nq, Nk) bool: query rows of sequence s see the keys of sequence s only (causal inside)."""
    starts_q: list[int] = cu_q.tolist()
    starts_k: list[int] = cu_k.tolist()
    mask = torch.zeros(starts_q[-1], starts_k[-1], dtype=torch.bool, device=device)
    for (q0, q1), (k0, k1) in zip(zip(starts_q[:-1], starts_q[1:]), zip(starts_k[:-1], starts_k[1:])):
        mask[q0:q1, k0:k1] = causal_mask(q1 - q0, k1 - k0, device) if causal else True
    return mask.view(1, 1, *mask.shape)


# -- flash_attn ----------------------------------------------------------------------------------
def _flash_facts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: Optional[torch.Tensor], where: str, *,
                 dropout_p: Optional[float], scale: Optional[float], causal: bool,
                 cu: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rest: dict) -> Optional[CallFacts]:
    """q (B, T, H, D) etc. (varlen: (N, H, D) with cu = (cu_seqlens_q, cu_seqlens_k)); None when the call
    returned no tensor."""
    if o is None:
        return None
    grad_sink = o_grad_sink(o, (lambda g: _bthd(g.unsqueeze(0))) if cu is not None else _bthd)  # on the O autograd saw
    if cu is not None:
        q, k, v, o = (t.unsqueeze(0) for t in (q, k, v, o))
    check_attention_shapes(q, k, v, o, "BTHD", where)
    tq, tk = q.shape[1], k.shape[1]
    mask = None
    if cu is not None:
        mask = block_diagonal_mask(cu[0], cu[1], bool(causal), q.device)
        causal = False
    elif causal and tq != tk:
        mask = causal_mask(tq, tk, q.device).view(1, 1, tq, tk)
        causal = False
    unreplayed = [name for name, value, neutral in (("window_size", rest.get("window_size"), (-1, -1)),
                                                     ("alibi_slopes", rest.get("alibi_slopes"), None))
                  if value is not None and value != neutral and not (name == "window_size" and tuple(value) == neutral)]
    warning = None
    if unreplayed:
        warning = (f"fa-forensics capture: {where} was called with {', '.join(unreplayed)}, which replays do not "
                   "model; Q, K, V, O are recorded, but a replay of these layers will not reproduce O")
    attrs: dict[str, Any] = {"layout": "BTHD", "varlen": cu is not None}
    softcap = rest.get("softcap")
    if isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0:
        attrs["softcap"] = float(softcap)
    if unreplayed:
        attrs["not_replayed"] = unreplayed
    return CallFacts(_bthd(q), _bthd(k), _bthd(v), _bthd(o), scale=None if scale is None else float(scale),
                     causal=bool(causal), mask=mask, dropout_p=float(dropout_p or 0.0), grad_sink=grad_sink,
                     attrs=attrs, warning=warning)


_FLASH_TAIL = ("window_size", "softcap", "alibi_slopes")


def _flash_kwargs(args: tuple, kwargs: dict, first: int) -> dict:
    """dropout_p, softmax_scale, causal and the unreplayed options, from position `first` on."""
    names = ("dropout_p", "softmax_scale", "causal", *_FLASH_TAIL)
    values = {n: _arg(args, kwargs, first + i, n) for i, n in enumerate(names)}
    return {"dropout_p": values["dropout_p"], "scale": values["softmax_scale"], "causal": bool(values["causal"]),
            "rest": {n: values[n] for n in _FLASH_TAIL}}


def flash_attn_func(args: tuple, kwargs: dict, out: Any, where: str = "flash_attn_func") -> Optional[CallFacts]:
    q, k, v, o = _arg(args, kwargs, 0, "q"), _arg(args, kwargs, 1, "k"), _arg(args, kwargs, 2, "v"), _output(out)
    return _flash_facts(q, k, v, o, where, **_flash_kwargs(args, kwargs, 3))


def flash_attn_qkvpacked_func(args: tuple, kwargs: dict, out: Any,
                              where: str = "flash_attn_qkvpacked_func") -> Optional[CallFacts]:
    qkv = _arg(args, kwargs, 0, "qkv")  # (B, T, 3, H, D)
    return _flash_facts(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], _output(out), where, **_flash_kwargs(args, kwargs, 1))


def flash_attn_kvpacked_func(args: tuple, kwargs: dict, out: Any,
                             where: str = "flash_attn_kvpacked_func") -> Optional[CallFacts]:
    q, kv = _arg(args, kwargs, 0, "q"), _arg(args, kwargs, 1, "kv")  # kv (B, Tk, 2, Hk, D)
    return _flash_facts(q, kv[:, :, 0], kv[:, :, 1], _output(out), where, **_flash_kwargs(args, kwargs, 2))


def flash_attn_varlen_func(args: tuple, kwargs: dict, out: Any,
                           where: str = "flash_attn_varlen_func") -> Optional[CallFacts]:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("q", "k", "v")))
    cu = (_arg(args, kwargs, 3, "cu_seqlens_q"), _arg(args, kwargs, 4, "cu_seqlens_k"))
    return _flash_facts(q, k, v, _output(out), where, cu=cu, **_flash_kwargs(args, kwargs, 7))


def flash_attn_varlen_qkvpacked_func(args: tuple, kwargs: dict, out: Any,
                                     where: str = "flash_attn_varlen_qkvpacked_func") -> Optional[CallFacts]:
    qkv = _arg(args, kwargs, 0, "qkv")  # (N, 3, H, D)
    cu = _arg(args, kwargs, 1, "cu_seqlens")
    return _flash_facts(qkv[:, 0], qkv[:, 1], qkv[:, 2], _output(out), where, cu=(cu, cu),
                        **_flash_kwargs(args, kwargs, 3))


def flash_attn_varlen_kvpacked_func(args: tuple, kwargs: dict, out: Any,
                                    where: str = "flash_attn_varlen_kvpacked_func") -> Optional[CallFacts]:
    q, kv = _arg(args, kwargs, 0, "q"), _arg(args, kwargs, 1, "kv")  # kv (Nk, 2, Hk, D)
    cu = (_arg(args, kwargs, 2, "cu_seqlens_q"), _arg(args, kwargs, 3, "cu_seqlens_k"))
    return _flash_facts(q, kv[:, 0], kv[:, 1], _output(out), where, cu=cu, **_flash_kwargs(args, kwargs, 6))


_FLASH = (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
          flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func)


# -- xformers ------------------------------------------------------------------------------------
def memory_efficient_attention(args: tuple, kwargs: dict, out: Any,
                               where: str = "xformers.ops.memory_efficient_attention") -> Optional[CallFacts]:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    bias, p, scale = _arg(args, kwargs, 3, "attn_bias"), _arg(args, kwargs, 4, "p", 0.0), _arg(args, kwargs, 5, "scale")
    o = _output(out)
    if o is None:
        return None
    grad_sink = o_grad_sink(o, (lambda g: _bthd(g.unsqueeze(2))) if o.dim() == 3 else _bthd)  # on the O autograd saw
    if q.dim() == 3:  # (B, M, K): one head
        q, k, v, o = (t.unsqueeze(2) for t in (q, k, v, o))
    check_attention_shapes(q, k, v, o, "BTHD", where)
    B, tq, H, _ = q.shape
    tk = k.shape[1]
    causal, mask, kind = False, None, "none"
    if isinstance(bias, torch.Tensor):
        mask, kind = bias.expand(B, H, tq, tk) if bias.dim() == 4 else bias, "tensor"
    elif bias is not None:
        kind = type(bias).__name__
        if kind == "LowerTriangularMask" and tq == tk:
            causal = True
        else:
            shape = (B, H, tq, tk) if isinstance(getattr(bias, "_bias", None), torch.Tensor) else (1, 1, tq, tk)
            mask = bias.materialize(shape, dtype=torch.float32, device=q.device)
    return CallFacts(_bthd(q), _bthd(k), _bthd(v), _bthd(o), scale=None if scale is None else float(scale),
                     causal=causal, mask=mask, dropout_p=float(p or 0.0), grad_sink=grad_sink,
                     attrs={"layout": "BTHD", "attn_bias": kind})


# -- flex_attention ------------------------------------------------------------------------------
def flex_attention(args: tuple, kwargs: dict, out: Any, where: str = "flex_attention") -> Optional[CallFacts]:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    score_mod, block_mask = _arg(args, kwargs, 3, "score_mod"), _arg(args, kwargs, 4, "block_mask")
    scale = _arg(args, kwargs, 5, "scale")
    o = _output(out)
    if o is None:
        return None
    check_attention_shapes(q, k, v, o, "BHTD", where)
    mask = None
    attrs: dict[str, Any] = {"layout": "BHTD"}
    if block_mask is not None:
        from torch.nn.attention.flex_attention import create_mask

        bB, bH = block_mask.kv_num_blocks.shape[:2]
        with torch.no_grad():
            mask = create_mask(block_mask.mask_mod, int(bB), int(bH), q.shape[2], k.shape[2], device=q.device)
        if bool(mask.all()):
            mask = None
        attrs["block_mask"] = getattr(block_mask.mask_mod, "__name__", type(block_mask.mask_mod).__name__)
    warning = None
    if score_mod is not None:
        name = getattr(score_mod, "__name__", type(score_mod).__name__)
        attrs["score_mod"] = name
        attrs["not_replayed"] = ["score_mod"]
        warning = (f"fa-forensics capture: {where} was called with score_mod {name!r}, which replays cannot apply; "
                   "Q, K, V, O are recorded, but a replay of these layers computes plain softmax(Q Kᵀ·scale) "
                   "and will not reproduce O")
    return CallFacts(q, k, v, o, scale=None if scale is None else float(scale), causal=False, mask=mask, attrs=attrs,
                     warning=warning)


def built_in_entry_points() -> list[EntryPoint]:
    """Every built-in entry point (each patched only if its module is, or gets, imported)."""
    eps = []
    for adapter in _FLASH:
        for module in ("flash_attn.flash_attn_interface", "flash_attn"):
            eps.append(EntryPoint(module, adapter.__name__, adapter, f"flash_attn.{adapter.__name__}"))
    for module in ("xformers.ops.fmha", "xformers.ops"):
        eps.append(EntryPoint(module, "memory_efficient_attention", memory_efficient_attention,
                              "xformers.ops.memory_efficient_attention"))
    eps.append(EntryPoint("torch.nn.attention.flex_attention", "flex_attention", flex_attention,
                          "torch.nn.attention.flex_attention.flex_attention"))
    return eps


WATCHED = ("torch's scaled_dot_product_attention", "flash_attn (flash_attn_func, its packed and varlen forms)",
           "xformers.ops.memory_efficient_attention", "torch.nn.attention.flex_attention",
           "Hugging Face's attention functions (any attn_implementation)",
           "attention written in torch ops (softmax(Q·Kᵀ)·V) in the model's forward",
           "fa_forensics.capture.record")
