"""The loss tap: the value of the scalar on which `backward()` is called, for the monitor's timeline
and the `loss` of recorded steps when the script does not report it (`cap.step(loss)`).

While a capture session is active, `torch.autograd.backward` is wrapped (`Tensor.backward`
calls it, so `loss.backward()` is covered). On a step the session watches, each backward call
on a one-element tensor without an explicit gradient adds that tensor (detached, no device
synchronization) to the step's running sum; under gradient accumulation with `loss / n` per
micro-batch, the sum is the step's mean loss. The value is read (`.item()`) once, when the
step's timeline row is written. A GradScaler's `scale(loss).backward()` taps the scaled loss:
report the loss with `cap.step(loss)` in that case.

The output-logit tap: `torch.nn.functional.cross_entropy` (hence `nn.CrossEntropyLoss`) is wrapped the same
way, and on a watched step the log-sum-exp of its logits over the class dimension, averaged over tokens, is
handed to the session (detached, fp32, no synchronization): the monitor's `output_lse` series, the size of
the language-model head's logits where the loss reads them.

Neither tap reads the session inside code that dynamo traces (`torch.compiler.is_compiling()`): a read of `busy`
there would be a guard (a recompile whenever it changes) and the hook would run on fake tensors. A cross-entropy
inside a compiled model therefore reports no logits (its steps' `output_lse` is NaN); an eager one does.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Protocol

import torch


class BackwardListener(Protocol):
    """The session as the loss tap sees it."""

    @property
    def busy(self) -> bool:
        """This step is watched: report backward calls."""

    def on_backward(self, tensors: Any, grad_tensors: Any) -> None:
        """`torch.autograd.backward(tensors, grad_tensors)` was called."""

    def on_loss_logits(self, logits: torch.Tensor) -> None:
        """`F.cross_entropy(logits, ...)` was called."""


_ORIGINAL = torch.autograd.backward
_ORIGINAL_CE = torch.nn.functional.cross_entropy
_session: Optional[BackwardListener] = None


@functools.wraps(_ORIGINAL)
def tapped_backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> None:
    if torch.compiler.is_compiling():  # traced code reads no session state (a read of `busy` would be a guard)
        return _ORIGINAL(tensors, grad_tensors, *args, **kwargs)
    session = _session
    if session is not None and session.busy:
        session.on_backward(tensors, grad_tensors)
    return _ORIGINAL(tensors, grad_tensors, *args, **kwargs)


@functools.wraps(_ORIGINAL_CE)
def tapped_cross_entropy(input: Any, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling():  # inside a compiled model: the original op, no guard on `busy`, no hook
        return _ORIGINAL_CE(input, *args, **kwargs)
    session = _session
    if session is not None and session.busy and isinstance(input, torch.Tensor):
        session.on_loss_logits(input)
    return _ORIGINAL_CE(input, *args, **kwargs)


def mean_lse(logits: torch.Tensor) -> Optional[torch.Tensor]:
    """The mean over tokens of log Σ_c exp(logit_c) (class dimension 1, or 0 for one unbatched row), fp32, detached;
    None for an empty or integer tensor."""
    if logits.numel() == 0 or not logits.is_floating_point():
        return None
    with torch.no_grad():
        return torch.logsumexp(logits.detach().float(), dim=1 if logits.dim() >= 2 else 0).mean()


def scalar_loss(tensors: Any, grad_tensors: Any) -> Optional[torch.Tensor]:
    """The one-element tensor being differentiated from, or None (several outputs, explicit gradient)."""
    if isinstance(tensors, (tuple, list)):
        if len(tensors) != 1:
            return None
        tensors = tensors[0]
    if isinstance(grad_tensors, (tuple, list)):
        grad_tensors = grad_tensors[0] if len(grad_tensors) == 1 else grad_tensors
    if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1 or grad_tensors is not None:
        return None
    return tensors.detach().reshape(()).float()


def install(session: BackwardListener) -> None:
    global _session
    _session = session
    torch.autograd.backward = tapped_backward
    torch.nn.functional.cross_entropy = tapped_cross_entropy


def uninstall(session: BackwardListener) -> None:
    global _session
    if _session is session:
        _session = None
    if torch.autograd.backward is tapped_backward:
        torch.autograd.backward = _ORIGINAL
    if torch.nn.functional.cross_entropy is tapped_cross_entropy:
        torch.nn.functional.cross_entropy = _ORIGINAL_CE
