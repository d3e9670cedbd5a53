"""The patch of torch.nn.functional.scaled_dot_product_attention, installed only while capture is active.

The patched function costs one attribute check when no step is being recorded: it looks at the
active session's `busy` flag and calls the original. Only on recorded steps does it hand
(Q, K, V, O, attn_mask, is_causal, scale) to the session.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch.nn.functional as F

_ORIGINAL = F.scaled_dot_product_attention
_session = None  # the active CaptureSession, or None


@functools.wraps(_ORIGINAL)
def patched_sdpa(*args, **kwargs):
    """Drop-in for F.scaled_dot_product_attention that reports recorded calls to the active session."""
    session = _session
    if session is None or not session.busy:
        return _ORIGINAL(*args, **kwargs)
    out = _ORIGINAL(*args, **kwargs)
    query, key, value, attn_mask, is_causal, scale = _bind(args, kwargs)
    session.on_attention(query, key, value, out, scale=scale, causal=bool(is_causal) and attn_mask is None,
                         attn_mask_given=attn_mask is not None, source="sdpa")
    return out


def _bind(args: tuple, kwargs: dict):
    """(query, key, value, attn_mask, is_causal, scale) from SDPA's positional/keyword arguments."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound["query"], bound["key"], bound["value"], bound["attn_mask"], bound["is_causal"], bound["scale"]


def install(session) -> None:
    """Route SDPA calls to `session` (patching F.scaled_dot_product_attention if not yet patched)."""
    global _session
    _session = session
    F.scaled_dot_product_attention = patched_sdpa


def uninstall(session, keep_patch: bool = False) -> None:
    """Stop routing to `session`; restore the original function unless `keep_patch` (the launcher keeps it)."""
    global _session
    if _session is session:
        _session = None
    if not keep_patch and F.scaled_dot_product_attention is patched_sdpa:
        F.scaled_dot_product_attention = _ORIGINAL


def active_session() -> Optional[object]:
    return _session


def original_sdpa():
    """The unpatched function (for reference computations in tests and the demo)."""
    return _ORIGINAL
