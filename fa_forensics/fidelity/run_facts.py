"""What a dump records about how one layer-step was computed: precision, autocast, device, kernel or entry
point, dropout, softmax variant, and what of the call no replay models. The candidate recipes of `match`
and the reading of a verdict follow these facts.

Every fact is read defensively: an attribute a capture or an import did not write is None (unknown), never a
guess, and an unknown fact excludes nothing. `precision` is the working precision of the attention kernel at
that layer: "fp32" (stored in float32 and autocast not on), "bf16", "fp16", "fp8", or None when the dump does
not say. A layer-step's facts are read once per opened dump (`facts_at`) into one frozen `RunFacts`.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional

_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_SOFTMAX_KEYS = ("softmax", "softmax_variant")  # layer, then run attributes, in this order
_KERNEL_KEYS = ("kernel", "sdpa_backend", "source")
SOFTMAX_VARIANTS = ("standard", "stabilized")
GPU_DEVICES = ("cuda", "hip", "rocm", "xpu")

# The entry points a recorded `kernel` / `source` names, by family: the SDPA backends, the flash-attn and
# xformers packages, flex_attention. Anything else is custom code (an `--attention` target, `record()`, the
# paper's reference Function), which may call any kernel inside: it excludes nothing.
KERNEL_FAMILIES = ("sdpa", "sdpa-cudnn", "sdpa-efficient", "sdpa-flash", "sdpa-math", "flash_attn", "xformers",
                   "flex_attention")
_FAMILY_ALIASES = {
    "cudnn": "sdpa-cudnn", "sdpa-cudnn-attention": "sdpa-cudnn", "cudnn_attention": "sdpa-cudnn",
    "efficient": "sdpa-efficient", "mem-efficient": "sdpa-efficient", "efficient_attention": "sdpa-efficient",
    "flash": "sdpa-flash", "flash_attention": "sdpa-flash", "math": "sdpa-math",
    "flash-attn": "flash_attn", "flash_attn_2": "flash_attn", "flash-attn-2": "flash_attn",
    "flex": "flex_attention",
}
_FAMILY_PREFIXES = (("flash_attn.", "flash_attn"), ("xformers.", "xformers"),
                    ("torch.nn.attention.flex_attention", "flex_attention"))


def kernel_family(kernel: Optional[str]) -> Optional[str]:
    """The entry-point family of a recorded kernel or source ("sdpa", "sdpa-cudnn", "flash_attn", ...), or None
    for custom code and for nothing recorded."""
    if kernel is None:
        return None
    name = kernel.strip().lower()
    name = _FAMILY_ALIASES.get(name, name)
    if name in KERNEL_FAMILIES:
        return name
    return next((family for prefix, family in _FAMILY_PREFIXES if name.startswith(prefix)), None)


@dataclass(frozen=True)
class RunFacts:
    """The recorded facts of one layer-step (None: not recorded)."""

    precision: Optional[str]  # fp32 | bf16 | fp16 | fp8
    autocast: Optional[bool]
    device: Optional[str]  # device type: cpu | cuda | ...
    dropout_p: float
    softmax: Optional[str]  # standard | stabilized
    kernel: Optional[str]  # the recorded kernel or entry point: "sdpa", "record", a wrapped callable's name
    not_replayed: tuple[str, ...] = ()  # options of the call no replay applies (score_mod, softcap, window_size, ...)
    score_mod: Optional[str] = None  # the name of a flex_attention score_mod
    assumed: tuple[str, ...] = ()  # settings an import assumed, the file not saying them (causal, scale)
    # capture recorded the op sequence of attention written in torch ops (plain_recipe); False: a capture recorded
    # the call and no such sequence; None: not known (an import, a layer built in memory)
    plain_ops: Optional[bool] = None
    softcap: bool = False  # that sequence has a soft-cap (c·tanh(S/c)), which only its own replay applies

    @property
    def is_fp32_run(self) -> bool:
        return self.precision == "fp32"

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0

    @property
    def on_gpu(self) -> Optional[bool]:
        """True on a recorded GPU device, False on another recorded device, None when not recorded."""
        return None if self.device is None else self.device.startswith(GPU_DEVICES)

    @property
    def kernel_family(self) -> Optional[str]:
        return kernel_family(self.kernel)

    def unverifiable(self) -> Optional[str]:
        """Why the stored O cannot tell whether a replay computes what training computed (None: it can):
        attention dropout, or an option of the call that no replay applies."""
        if self.has_dropout:
            return (f"attention dropout p={self.dropout_p:g}: stored O includes dropout, which no replay of the stored "
                    f"Q, K, V reproduces")
        if self.not_replayed:
            named = ", ".join(f"score_mod {self.score_mod!r}" if n == "score_mod" and self.score_mod else n
                              for n in self.not_replayed)
            return f"the call used {named}: stored O includes it, which no replay of the stored Q, K, V applies"
        return None


UNKNOWN = RunFacts(None, None, None, 0.0, None, None)


_UNKNOWN_WORDS = ("unknown", "none", "")


def _text(value) -> Optional[str]:
    """A recorded text fact, lower-cased; None when absent or recorded as unknown."""
    text = value.strip().lower() if isinstance(value, str) else ""
    return None if text in _UNKNOWN_WORDS else text


def _texts(value) -> tuple[str, ...]:
    """A recorded list of names (a list of strings, or one string), lower-cased; () when absent or malformed."""
    values = [value] if isinstance(value, str) else (value if isinstance(value, (list, tuple)) else [])
    return tuple(t for t in (_text(v) for v in values) if t is not None)


def _precision(dtype: Optional[str], autocast: Optional[bool], autocast_dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return None
    if dtype.startswith("float8"):
        return "fp8"
    p = _PRECISIONS.get(dtype)
    if p == "fp32" and autocast:
        # fp32 stored under autocast: the kernel computed in autocast's dtype, when that was recorded
        return _PRECISIONS.get(autocast_dtype or "")
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


def _autocast(layer_attrs: dict) -> tuple[Optional[bool], Optional[str]]:
    """(autocast on, its dtype): from `autocast` (bool) and `autocast_dtype` ("bfloat16", "none")."""
    on = layer_attrs.get("autocast")
    dtype = _text(layer_attrs.get("autocast_dtype"))
    if not isinstance(on, bool):
        on = None if "autocast_dtype" not in layer_attrs else dtype is not None
    return on, dtype


def read_facts(dump, step: int, layer: int) -> RunFacts:
    """The recorded facts of (step, layer) of `dump`, read from its attributes (UNKNOWN for a layer built in
    memory)."""
    if dump is None:
        return UNKNOWN
    run_attrs = dict(getattr(dump, "attrs", {}) or {})
    try:
        layer_attrs = dict(dump._layer(step, layer).attrs)
    except Exception:  # a stand-in without zarr groups
        layer_attrs = {}
    autocast, autocast_dtype = _autocast(layer_attrs)
    dtype = _text(layer_attrs.get("dtype")) or _stored_dtype(dump, step, layer)
    try:
        dropout = float(layer_attrs.get("dropout_p") or 0.0)
    except (TypeError, ValueError):
        dropout = 0.0
    dropout = dropout if math.isfinite(dropout) else 0.0  # not a probability: not recorded
    softmax = next((_text(a.get(k)) for a in (layer_attrs, run_attrs) for k in _SOFTMAX_KEYS if _text(a.get(k))), None)
    if softmax is not None and softmax.startswith("stabil"):
        softmax = "stabilized"
    kernel = next((_text(layer_attrs.get(k)) for k in _KERNEL_KEYS if _text(layer_attrs.get(k))), None)
    capture = recorded if isinstance(recorded := run_attrs.get("capture"), dict) else {}
    score_mod = layer_attrs.get("score_mod")
    plain = layer_attrs.get("plain_recipe")
    ops = plain.get("ops") if isinstance(plain, dict) else None
    recorded = isinstance(ops, list)
    softcap = isinstance(ops, list) and any(isinstance(o, dict) and o.get("op") == "tanh" for o in ops)
    plain_ops = True if recorded else (False if _text(layer_attrs.get("source")) is not None else None)
    return RunFacts(_precision(dtype, autocast, autocast_dtype), autocast, _device(layer_attrs, run_attrs),
                    dropout, softmax, kernel,
                    not_replayed=_texts(layer_attrs.get("not_replayed")),
                    score_mod=score_mod if isinstance(score_mod, str) else None,
                    assumed=_texts(capture.get("assumed")), plain_ops=plain_ops, softcap=softcap)


# Per opened Dump: (step, layer) -> RunFacts, so that a layer-step's attributes are read once.
_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def facts_at(dump, step: int, layer: int) -> RunFacts:
    """The recorded facts of (step, layer) of `dump`, read once per opened dump (`read_facts`)."""
    if dump is None:
        return UNKNOWN
    try:
        memo = _FACTS.setdefault(dump, {})
    except TypeError:  # not weak-referenceable (an in-memory stand-in): read every time
        return read_facts(dump, step, layer)
    if (step, layer) not in memo:
        memo[(step, layer)] = read_facts(dump, step, layer)
    return memo[(step, layer)]
