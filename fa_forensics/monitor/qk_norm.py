"""Whether an attention module normalizes its queries and keys (qk-layernorm) before the logits.

Behind a norm on q and k, the attention logits no longer scale with W_Q: the norm divides q by its own
size, so W_Q's spectral norm can grow (weight decay off, learning at a low rate) without any effect on
the logits. The monitor records this per layer as a fact (`qk_norm` in the store's monitor attributes),
and the alarm rule does not watch W_Q's norm where it is true.

Found by structure, on the attention module the monitor measures: a normalization submodule (a LayerNorm,
RMSNorm or GroupNorm, or a class whose name ends in "Norm") whose own name says it is applied to the
queries or the keys (`q_norm`, `k_norm`, `q_layernorm`, `query_norm`, `key_layernorm`, `qk_norm`, ...: the
names of nanoGPT-style code, OLMo 2, Qwen 3, Gemma 3 and ViT-22B-style models).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

_QK_NAME = re.compile(r"(^|[._])(q|k|qk|query|key|queries|keys)_?(layer_?)?norm($|[._])|"
                      r"(^|[._])(norm|ln|layernorm)_?(q|k|qk)($|[._])", re.IGNORECASE)
_NORM_TYPES = tuple(t for t in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None), torch.nn.GroupNorm) if t)


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith("norm")


def has_qk_norm(attention: Optional[torch.nn.Module]) -> Optional[bool]:
    """True when `attention` holds a normalization named for its queries or keys, False when it holds none,
    None when there is no module to look at."""
    if attention is None:
        return None
    for name, sub in attention.named_modules():
        if name and _is_norm(sub) and _QK_NAME.search(name):
            return True
    return False
