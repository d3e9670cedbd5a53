"""`--attention` targets: custom attention named `MODULE:QUALNAME[,OPTIONS]`, and how its calls are read.

A target is a function or a `torch.autograd.Function` (its `apply` is what models call). The options
map the call to attention (every one optional):

  layout=BHTD|BTHD     how q, k, v are laid out (default BHTD: (B, heads, T, head_dim))
  o_layout=BHTD|BTHD   how the output is laid out (default: as layout)
  q=, k=, v=           the arguments holding Q, K, V: a parameter name (query) or a position (1);
                       default: parameters named q/query, k/key, v/value, else the first three tensors
  out=N                which element of a tuple or list result is O (default 0; a tensor result is O)
  mask=                the argument holding an SDPA-style mask (default: mask/attn_mask/attention_mask)
  scale=               a number, or the argument holding it (default: scale/softmax_scale/sm_scale/scaling,
                       else 1/sqrt(head_dim))
  causal=              true/false, or the argument holding it (default: causal/is_causal, else causal
                       exactly when no mask was passed)
  dropout=             the argument holding the dropout probability (default: dropout_p/dropout)

e.g. `transformers.models.gpt2.modeling_gpt2:eager_attention_forward,q=query,k=key,v=value,out=0,o_layout=BTHD`
(HF's module-first signature: (module, query, key, value, attention_mask, scaling, dropout) returning
(O in (B, T, H, D), weights)). Every name and value is checked when the option is parsed; the shapes of
every call are checked against the layouts (capture/layouts.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Union

import torch

from fa_forensics.capture.entry_points import CallFacts, EntryPoint
from fa_forensics.capture.layouts import check_attention_shapes, check_layout, o_grad_sink, to_bhtd
from fa_forensics.capture.selection import InvalidCaptureSetting

_CAUSAL = ("causal", "is_causal")
_SCALE = ("scale", "softmax_scale", "sm_scale", "scaling")
_MASK = ("mask", "attn_mask", "attention_mask")
_DROPOUT = ("dropout_p", "dropout")
_BY_NAME = {"q": ("q", "query"), "k": ("k", "key"), "v": ("v", "value")}

Argument = Union[str, int]  # a parameter name or a position
OPTIONS = ("layout", "o_layout", "q", "k", "v", "out", "mask", "scale", "causal", "dropout")
_HELP = ("layout=BHTD|BTHD, o_layout=BHTD|BTHD, q=/k=/v=/mask=/dropout=NAME or POSITION, out=INDEX, "
         "scale=NUMBER or NAME, causal=true|false or NAME")


def _argument(key: str, value: str, text: str) -> Argument:
    if value.isdigit():
        return int(value)
    if value.isidentifier():
        return value
    raise InvalidCaptureSetting("attention", f"{key}={value!r} in {text!r}: name a parameter (e.g. {key}=query) "
                                             "or give its position (e.g. q=1)")


@dataclass(frozen=True)
class TargetSpec:
    """`--attention MODULE:QUALNAME[,OPTIONS]`, parsed (module docstring)."""

    module: str
    qualname: str
    layout: str = "BHTD"
    o_layout: Optional[str] = None  # None: as layout
    q: Optional[Argument] = None
    k: Optional[Argument] = None
    v: Optional[Argument] = None
    out: Optional[int] = None
    mask: Optional[Argument] = None
    scale: Optional[float] = None  # a fixed scale
    scale_arg: Optional[Argument] = None  # the argument holding the scale
    causal: Optional[bool] = None  # a fixed causal flag
    causal_arg: Optional[Argument] = None  # the argument holding it
    dropout: Optional[Argument] = None

    @classmethod
    def parse(cls, text: str) -> TargetSpec:
        head, *options = [p.strip() for p in str(text).split(",")]
        module, sep, qualname = head.partition(":")
        if not sep or not module or not qualname or not all(p.isidentifier() for p in qualname.split(".")):
            raise InvalidCaptureSetting("attention", f"{text!r} does not name a callable; write MODULE:QUALNAME, "
                                                     "e.g. attention:FlashAttentionFunction or "
                                                     "mypkg.attn:attention_fn,layout=BTHD")
        values: dict[str, Any] = {}
        for option in options:
            key, eq, value = option.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not eq or key not in OPTIONS:
                raise InvalidCaptureSetting("attention", f"{option!r} in {text!r} is not an option; use {_HELP}")
            if key in values or (key == "scale" and "scale_arg" in values) or (key == "causal" and "causal_arg"
                                                                               in values):
                raise InvalidCaptureSetting("attention", f"{key} is given twice in {text!r}")
            if key in ("layout", "o_layout"):
                values[key] = check_layout(value)
            elif key in ("q", "k", "v", "mask", "dropout"):
                values[key] = _argument(key, value, text)
            elif key == "out":
                if not value.isdigit():
                    raise InvalidCaptureSetting("attention", f"out={value!r} in {text!r}: give the index of O in the "
                                                             "returned tuple, e.g. out=0")
                values["out"] = int(value)
            elif key == "causal":
                if value.lower() in ("true", "false", "1", "0"):
                    values["causal"] = value.lower() in ("true", "1")
                elif value.isidentifier():
                    values["causal_arg"] = value
                else:
                    raise InvalidCaptureSetting("attention", f"causal={value!r} in {text!r}: write causal=true, "
                                                             "causal=false or the name of the argument holding it")
            else:
                values.update(_scale_option(value, text))
        spec = cls(module.strip(), qualname.strip(), **values)
        taken = [a for a in (spec.q, spec.k, spec.v) if a is not None]
        if len(set(taken)) != len(taken):
            raise InvalidCaptureSetting("attention", f"q, k and v name the same argument in {text!r}")
        return spec

    def to_text(self) -> str:
        parts = [f"{self.module}:{self.qualname}", f"layout={self.layout}"]
        for f in fields(self):
            if f.name in ("module", "qualname", "layout"):
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            key = {"scale_arg": "scale", "causal_arg": "causal"}.get(f.name, f.name)
            text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else value
            parts.append(f"{key}={text}")
        return ",".join(parts)

    def entry_point(self) -> EntryPoint:
        return EntryPoint(self.module, self.qualname, TargetAdapter(self), self.to_text())


def _scale_option(value: str, text: str) -> dict:
    if value.isidentifier() and value.lower() not in ("nan", "inf", "infinity"):
        return {"scale_arg": value}
    try:
        scale = float(value)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidCaptureSetting("attention", f"scale={value!r} in {text!r} must be a positive number or the name "
                                                 "of the argument holding it")
    return {"scale": scale}


@dataclass(frozen=True)
class TargetAdapter:
    """Reads one call of a target (args, kwargs, output) -> CallFacts; `params`: the callable's parameter names."""

    spec: TargetSpec
    params: tuple[str, ...] = ()

    def with_parameters(self, params: list[str]) -> TargetAdapter:
        return replace(self, params=tuple(params))

    def __call__(self, args: tuple, kwargs: dict, out: Any) -> Optional[CallFacts]:
        spec = self.spec
        bound = dict(zip(self.params, args))
        bound.update(kwargs)

        def read(arg: Optional[Argument], names: tuple[str, ...] = ()) -> Any:
            if isinstance(arg, int):
                return args[arg] if arg < len(args) else None
            if arg is not None:
                return bound.get(arg)
            return next((bound[n] for n in names if n in bound), None)

        q, k, v = (read(getattr(spec, n), _BY_NAME[n]) for n in "qkv")
        if spec.q is None and spec.k is None and spec.v is None and not all(
                isinstance(t, torch.Tensor) for t in (q, k, v)):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            q, k, v = (tensors + [None] * 3)[:3]
        o = out
        if isinstance(out, (tuple, list)):
            index = spec.out or 0
            o = out[index] if index < len(out) else None
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v, o)):
            return None
        where, o_layout = spec.to_text(), spec.o_layout or spec.layout
        check_attention_shapes(q, k, v, o, spec.layout, where, o_layout=o_layout)
        mask = read(spec.mask, _MASK)
        scale = spec.scale if spec.scale is not None else read(spec.scale_arg, _SCALE)
        causal = spec.causal if spec.causal is not None else read(spec.causal_arg, _CAUSAL)
        dropout = read(spec.dropout, _DROPOUT)
        warning = None
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
            shape = f" of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else ""
            warning = (f"fa-forensics capture: {where}: the call's mask ({type(mask).__name__}{shape}) is not a 4-D "
                       "SDPA-style mask and is not recorded; replays of these layers ignore it")
            mask = None
        convert = functools.partial(to_bhtd, layout=spec.layout)
        convert_o = functools.partial(to_bhtd, layout=o_layout)
        attrs = {"layout": spec.layout}
        if o_layout != spec.layout:
            attrs["o_layout"] = o_layout
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = float(scale)
        scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
        return CallFacts(convert(q), convert(k), convert(v), convert_o(o), scale=scale,
                         causal=bool(causal) if isinstance(causal, bool) else mask is None, mask=mask,
                         dropout_p=float(dropout) if isinstance(dropout, float) else 0.0,
                         grad_sink=o_grad_sink(o, convert_o) if o_layout != "BHTD" else None, attrs=attrs,
                         warning=warning)
