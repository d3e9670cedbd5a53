"""What the capture session hands to its parts: typed events, and the warnings it raises.

The session turns hook and patch calls into these events; the recorder (capture/recorder.py), the
monitor's collector and the ring read them. Messages for a person are warnings of the categories
below (never prints): a library user sees them through Python's warnings, the launcher of
`fa-forensics capture` renders each as one line on stderr.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Optional, TextIO

import sys
import warnings

import torch


class CaptureWarning(RuntimeWarning):
    """Something a capture could not do as asked (a skipped call, a step with no attention call, ...)."""


class AlarmWarning(CaptureWarning):
    """The monitor's alarm rule fired; the message is one line naming step, layer, head and metric."""


def show_capture_warnings_as_lines(collect: Optional[list[str]] = None, prefix: str = "") -> None:
    """Show every CaptureWarning as its message alone (after `prefix`, e.g. "rank 1: "), one line on stderr
    (for command-line runs), also appended to `collect` when given; other warnings keep Python's format."""
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Optional[TextIO] = None,
             line: Optional[str] = None) -> None:
        if issubclass(category, CaptureWarning):
            print(prefix + str(message), file=sys.stderr if file is None else file, flush=True)
            if collect is not None:
                collect.append(prefix + str(message))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.simplefilter("always", CaptureWarning)
    warnings.showwarning = show


@dataclass(frozen=True)
class ModuleInput:
    """X: the input of the attention module `name`, seen by its forward pre-hook (B, T, C)."""

    name: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the recorded forward pass, as SDPA (or `cap.record`) got it.

    q (B, H, T, D); k, v (B, Hk, Tk, D) (Hk < H: grouped-query); o (B, H, T, D); mask: SDPA's attn_mask
    or None; autocast_dtype: autocast's dtype when it was on, else None; grad_sink: inside a compiled
    graph O has no autograd history here, and the dO hook is handed to grad_sink instead.
    """

    step: int
    layer: int  # call order within the forward pass
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    scale: Optional[float]
    causal: bool
    mask: Optional[torch.Tensor]
    dropout_p: float
    autocast_dtype: Optional[torch.dtype]
    source: str  # "sdpa" | "record" | the watched entry point's name
    x: Optional[ModuleInput] = None
    grad_sink: Optional[Callable] = None
    extra: Optional[dict] = None  # further layer attributes (layout, softmax, precision facts, ...)

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype the attention kernel computes in: autocast's dtype for fp32 inputs under autocast."""
        if self.q.dtype == torch.float32 and self.autocast_dtype is not None:
            return self.autocast_dtype
        return self.q.dtype

    @property
    def score_dtype(self) -> torch.dtype:
        """The precision the kernel forms S in: as recorded (attention written in torch ops: the dtype of
        its product Q·Kᵀ); torch's fused SDPA kernels keep S in their fp32 accumulator; other custom
        attention (`record`, a watched entry point) is taken to round S = QKᵀ to the kernel dtype."""
        recorded = getattr(torch, str((self.extra or {}).get("score_dtype", "")), None)
        if isinstance(recorded, torch.dtype):
            return recorded
        return torch.float32 if self.source == "sdpa" else self.kernel_dtype


@dataclass(frozen=True)
class TimelineRow:
    """A monitored step's row, waiting for its loss: given loss (cap.step) or the loss tap's sum."""

    step: int
    series: Optional[dict]  # metric -> (L, H) array, None when no attention call was seen
    given_loss: Optional[float]
    tapped_loss: Optional[torch.Tensor]
