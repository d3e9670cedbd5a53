"""The capture session that SDPA calls and the compiled-graph taps report to (None while capture is off).

One per process: `sdpa.install` sets it, `sdpa.uninstall` clears it. It lives apart from sdpa.py so that
the custom ops of graph_ops.py, which sdpa.py inserts into compiled graphs, read it without importing
sdpa.py. `ActiveSession` names what these callers ask of it (the capture session provides it).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import torch


class ActiveSession(Protocol):
    """The session as the SDPA patch, the compiled-graph taps and the Hugging Face registry see it."""

    @property
    def busy(self) -> bool:
        """This step is recorded or monitored: hand calls over."""

    def on_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                     scale: Optional[float], causal: bool, attn_mask: Optional[torch.Tensor], dropout_p: float,
                     source: str, grad_sink: Optional[Callable] = None, grad_enabled: Optional[bool] = None,
                     autocast_dtype: Optional[torch.dtype] = None) -> None:
        """One attention call (q, k, v, o as (B, H, T, D))."""

    def hf_attention_call(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run a Hugging Face attention function on a busy step and return what it returned."""

    def take_input_from_graph(self, name: str, x: torch.Tensor) -> None:
        """X, the input of the attention module `name`, inside a compiled graph."""


session: Optional[ActiveSession] = None  # the active CaptureSession
