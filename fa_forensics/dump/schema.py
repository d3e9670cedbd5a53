"""Dump format v1: names, layout and dtype encodings shared by the writer and the reader.

Layout (zarr v3), see DESIGN.md:
    run.zarr/                      attrs.fa_forensics = {format_version: 1, ...}
      [rank_{r}/]                  ranks r > 0 of a multi-rank run write their own subtree
        step_{S:09d}/              attrs: {step, loss?, complete: true written last}
          layer_{L:03d}/           attrs: {module, n_heads, head_dim, scale, causal, dtype, arrays}
            q k v o do             (B, H, T, D), chunks (1, 1, T, D): one head of one tensor
            x                      (B, T, C),    chunks (1, T, C)
            mask                   (B or 1, H or 1, Tq, Tk), chunks (1, 1, Tq, Tk): SDPA's attn_mask
                                   when one was passed; bool (True = may attend) or an additive
                                   float bias, broadcastable to (B, H, Tq, Tk)
      timeline/                    per-step series, first axis = monitored step

zarr has no bf16 / fp8: those are stored as their bit patterns (uint16 / uint8) and the array
attribute `dtype` names the original torch dtype, so a round trip is bit-exact.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

if TYPE_CHECKING:
    import numpy as np

FORMAT_VERSION = 1
ATTRS_KEY = "fa_forensics"  # root attribute holding the run description
TENSOR_NAMES = ("q", "k", "v", "o", "do", "x")  # what every recorded attention call has
HEAD_TENSORS = ("q", "k", "v", "o", "do")  # (B, H, T, D); x is (B, T, C)
MASK = "mask"  # (B or 1, H or 1, Tq, Tk): bool (True = may attend) or additive float; only where SDPA got one
ARRAY_NAMES = (*TENSOR_NAMES, MASK)  # every array a layer group may hold
TIMELINE_GROUP = "timeline"

STEP_RE = re.compile(r"^step_(\d{9})$")
LAYER_RE = re.compile(r"^layer_(\d{3})$")
RANK_RE = re.compile(r"^rank_(\d+)$")


def step_key(step: int) -> str:
    return f"step_{int(step):09d}"


def layer_key(layer: int) -> str:
    return f"layer_{int(layer):03d}"


def rank_key(rank: int) -> str:
    return f"rank_{int(rank)}"


# torch dtype name <-> (stored numpy dtype, carrier dtype name). bf16 / fp8 go through same-width ints. Keyed by
# name, so that reading a dump's metadata (info, verify) does not import torch.
_STORED = {
    "float32": ("float32", None),
    "float64": ("float64", None),
    "float16": ("float16", None),
    "bfloat16": ("uint16", "int16"),
    "float8_e4m3fn": ("uint8", "uint8"),
    "float8_e5m2": ("uint8", "uint8"),
    "bool": ("bool", None),
}


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16', 'float8_e4m3fn', ... (the torch name without the 'torch.' prefix)."""
    return str(dtype).removeprefix("torch.")


def supported_dtype_names() -> list[str]:
    return sorted(_STORED)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named by an array's `dtype` attribute; KeyError if unknown."""
    import torch

    if name not in _STORED:
        raise KeyError(name)
    return getattr(torch, name)


def encode(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """Tensor -> (numpy array to store, dtype attribute). Bit-exact for every supported dtype."""
    import torch

    name = dtype_name(tensor.dtype)
    if name not in _STORED:
        raise ValueError(f"dtype {tensor.dtype} cannot be stored; supported: {', '.join(supported_dtype_names())}")
    stored, carrier = _STORED[name]
    t = tensor.detach().to("cpu").contiguous()
    if carrier is not None:
        t = t.view(getattr(torch, carrier))
    return t.numpy().view(stored), name


def decode(array: np.ndarray, name: str) -> torch.Tensor:
    """Stored numpy array + dtype attribute -> tensor in the original dtype (no copy of values)."""
    import numpy as np
    import torch

    dtype = torch_dtype(name)
    stored, carrier = _STORED[name]
    a = np.ascontiguousarray(array)
    if carrier is None:
        return torch.from_numpy(a.astype(stored, copy=False))
    return torch.from_numpy(a.view(carrier)).view(dtype)


# layer attributes that say how the attention call was made (written by capture): precision facts,
# softmax variant, entry point, layout, and what of the call a replay does not model; for attention
# written in torch ops also its ops (`chain`), the dtypes S, the softmax and P were in, and factors
# applied to Q or K before their product; for Hugging Face models the attention function's name
CALL_ATTR_KEYS: tuple[str, ...] = (
    "device_type", "autocast_dtype", "softmax", "softmax_rule", "source", "layout", "varlen", "attn_bias", "block_mask",
    "score_mod", "not_replayed", "o_layout", "chain", "score_dtype", "softmax_dtype", "p_dtype", "q_scale", "k_scale",
    "hf_attention")
# the first recorded call's O checked against a float64 recomputation (capture/first_call_check.py), and the
# soft-cap a chain of torch ops applied to its scores (cap·tanh(S / cap))
CALL_ATTR_KEYS += ("first_call_check", "softcap")
CALL_ATTR_KEYS += ("plain_recipe",)  # the op sequence of attention written in torch ops


@dataclass(frozen=True)
class LayerInfo:
    """What one layer of one step holds: attention settings and array shapes."""

    module: str | None
    n_heads: int
    head_dim: int
    scale: float
    causal: bool
    dtype: str
    arrays: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dropout_p: float = 0.0  # SDPA's dropout_p at capture: stored O includes dropout when > 0
    mask: str | None = None  # "bool" | "additive" when SDPA got an attn_mask (array `mask`), else None
    autocast: bool | None = None  # autocast was active at the call (None: not recorded)
    input_dtype: str | None = None  # dtype of Q as passed to SDPA (before autocast's cast)
    call: dict[str, Any] = field(default_factory=dict)  # the CALL_ATTR_KEYS the capture recorded

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "n_heads": self.n_heads,
            "head_dim": self.head_dim,
            "scale": self.scale,
            "causal": self.causal,
            "dtype": self.dtype,
            "dropout_p": self.dropout_p,
            "mask": self.mask,
            "autocast": self.autocast,
            "input_dtype": self.input_dtype,
            "call": dict(self.call),
            "arrays": {k: list(v) for k, v in self.arrays.items()},
        }
