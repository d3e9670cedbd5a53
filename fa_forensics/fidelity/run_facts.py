"""What a dump records about how one layer-step was computed: precision, autocast, device, dropout,
softmax variant. The candidate recipes of `match` and the reading of a verdict follow these facts.

Every fact is read defensively: an attribute a capture did not write is None (unknown), never a
guess. `precision` is the run's working precision at that layer: "fp32" (stored in float32 and
autocast not on), "bf16", "fp16", "fp8", or None when the dump does not say.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_SOFTMAX_KEYS = ("softmax", "softmax_variant")  # layer, then run attributes, in this order
_KERNEL_KEYS = ("kernel", "sdpa_backend", "source")


@dataclass(frozen=True)
class RunFacts:
    """The recorded facts of one layer-step (None: not recorded)."""

    precision: Optional[str]  # fp32 | bf16 | fp16 | fp8
    autocast: Optional[bool]
    device: Optional[str]  # device type: cpu | cuda | ...
    dropout_p: float
    softmax: Optional[str]  # standard | stabilized
    kernel: Optional[str]  # the recorded kernel or entry point: "sdpa", "record", a wrapped callable's name

    @property
    def is_fp32_run(self) -> bool:
        return self.precision == "fp32"

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0


UNKNOWN = RunFacts(None, None, None, 0.0, None, None)


_UNKNOWN_WORDS = ("unknown", "none", "")


def _text(value) -> Optional[str]:
    """A recorded text fact, lower-cased; None when absent or recorded as unknown."""
    text = value.strip().lower() if isinstance(value, str) else ""
    return None if text in _UNKNOWN_WORDS else text


def _precision(dtype: Optional[str], autocast: Optional[bool]) -> Optional[str]:
    if dtype is None:
        return None
    if dtype.startswith("float8"):
        return "fp8"
    p = _PRECISIONS.get(dtype)
    if p == "fp32" and autocast:
        return None  # fp32 stored under autocast: the kernel's precision is not in the dump
    return p


def _device(layer_attrs: dict, run_attrs: dict) -> Optional[str]:
    raw = (_text(layer_attrs.get("device_type")) or _text(run_attrs.get("device_type"))
           or _text(run_attrs.get("device")))
    return None if raw is None else raw.split(":")[0]


def _stored_dtype(dump, step: int, layer: int) -> Optional[str]:
    """The dtype of the stored q when the layer attributes do not name one."""
    try:
        arr = dump._array(step, layer, "q")
        return _text(str(arr.attrs.get("dtype", arr.dtype)))
    except Exception:  # an unreadable array is reported by the analysis that needs it
        return None


def facts_at(dump, step: int, layer: int) -> RunFacts:
    """The recorded facts of (step, layer) of `dump` (UNKNOWN for a layer built in memory)."""
    if dump is None:
        return UNKNOWN
    run_attrs = dict(getattr(dump, "attrs", {}) or {})
    try:
        layer_attrs = dict(dump._layer(step, layer).attrs)
    except Exception:  # a stand-in without zarr groups
        layer_attrs = {}
    autocast = layer_attrs.get("autocast")
    autocast = autocast if isinstance(autocast, bool) else None
    dtype = _text(layer_attrs.get("dtype")) or _stored_dtype(dump, step, layer)
    try:
        dropout = float(layer_attrs.get("dropout_p") or 0.0)
    except (TypeError, ValueError):
        dropout = 0.0
    softmax = next((_text(a.get(k)) for a in (layer_attrs, run_attrs) for k in _SOFTMAX_KEYS if _text(a.get(k))), None)
    kernel = next((_text(layer_attrs.get(k)) for k in _KERNEL_KEYS if _text(layer_attrs.get(k))), None)
    return RunFacts(_precision(dtype, autocast), autocast, _device(layer_attrs, run_attrs), dropout, softmax, kernel)
