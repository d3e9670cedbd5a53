"""The patch of torch.nn.functional.scaled_dot_product_attention, installed only while capture is active.

The patched function costs one attribute check when no step is being recorded: it calls the
original and looks at the active session's `busy` flag. Only on busy steps does it hand
(Q, K, V, O, attn_mask, dropout_p, is_causal, scale) to the session.

Under torch.compile, dynamo traces this function. Traced code never reads the session's `busy` flag
(dynamo would turn the read into a guard, and the first recorded step would recompile): while a
session is installed, every compiled graph hands each call to the opaque custom op
`fa_forensics::tap_attention` (capture/graph_ops.py), and the op's body looks at `busy` when the
graph runs. One graph serves recorded and unrecorded steps alike; it is not a graph break.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F

from fa_forensics.capture import current

_ORIGINAL = F.scaled_dot_product_attention


@functools.wraps(_ORIGINAL)
def patched_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Drop-in for F.scaled_dot_product_attention that reports recorded calls to the active session."""
    out = _ORIGINAL(*args, **kwargs)
    session = current.session
    if session is None:
        return out
    if torch.compiler.is_compiling():  # every step: the op decides when the graph runs, so no guard reads `busy`
        return _tap_in_graph(args, kwargs, out)
    if session.busy:
        _report(session, args, kwargs, out)
    return out


def _tap_in_graph(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """The hand-over inside a compiled graph: one custom op whose output (a copy of O) replaces O."""
    from fa_forensics.capture.graph_ops import tap_attention

    bound = _bind(args, kwargs)
    scale = bound["scale"]
    o, _token = tap_attention(bound["query"], bound["key"], bound["value"], out, bound["attn_mask"],
                              float(bound["dropout_p"] or 0.0), bool(bound["is_causal"]),
                              None if scale is None else float(scale), torch.is_grad_enabled(),
                              autocast_dtype(bound["query"]))
    return o


@torch.compiler.disable
def _report(session: current.ActiveSession, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
    """Hand one SDPA call to the session (eager, outside any compiled graph)."""
    bound = _bind(args, kwargs)
    session.on_attention(bound["query"], bound["key"], bound["value"], out, scale=bound["scale"],
                         causal=bool(bound["is_causal"]),
                         attn_mask=bound["attn_mask"], dropout_p=float(bound["dropout_p"] or 0.0), source="sdpa")


def autocast_dtype(q: torch.Tensor) -> Optional[torch.dtype]:
    """Autocast's dtype on q's device when autocast is on there, else None."""
    device_type = q.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _bind(args: tuple, kwargs: dict) -> dict:
    """SDPA's positional/keyword arguments by name, with its defaults."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def install(session: current.ActiveSession) -> None:
    """Route SDPA calls to `session` (patching F.scaled_dot_product_attention if not yet patched)."""
    current.session = session
    F.scaled_dot_product_attention = patched_sdpa


def uninstall(session: current.ActiveSession, keep_patch: bool = False) -> None:
    """Stop routing to `session`; restore the original function unless `keep_patch` (the launcher keeps it)."""
    if current.session is session:
        current.session = None
    if not keep_patch and F.scaled_dot_product_attention is patched_sdpa:
        F.scaled_dot_product_attention = _ORIGINAL


def active_session() -> Optional[current.ActiveSession]:
    return current.session


def original_sdpa() -> Callable[..., torch.Tensor]:
    """The unpatched function (for reference computations in tests and the demo)."""
    return _ORIGINAL
