"""Capture inside torch.compile graphs: opaque custom ops that hand tensors to the session at run time.

Why custom ops and not `torch.compiler.disable`: a disabled function is a graph break, and a graph
break changes what inductor fuses around it, so a selected step computed other bits than the same
step without capture. A `torch.library.custom_op` is one opaque node in the graph: dynamo and
inductor keep everything around it as without capture, and its Python body runs eagerly when the
compiled graph runs. While a session is installed the hooks insert the ops on every step, and the
bodies read the session's `busy` flag at run time: traced code reads no session state, so dynamo
has no guard that changes at a recorded step and the graph compiled at the session's first step
serves every step (no recompilation when recording starts or stops). On steps that are not busy a
body only copies its input (a custom op may not return an alias of it).

- `tap_attention(q, k, v, o, mask, ...) -> (o', token)`: reports one SDPA call; o' is a copy of O
  (a custom op may not return an alias of its input) and carries the gradient: its backward runs
  `tap_grad(dO, token)`, which hands dO to the hook the session left under `token`.
- `tap_input(x) -> x'`: reports X, the attention module's input (x' is a copy of x).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Optional

import torch

from fa_forensics.capture import current

_GRAD_HOOKS: dict[int, Callable[[torch.Tensor], None]] = {}  # token -> the session's dO hook
_TOKENS = itertools.count(1)
_NO_TOKEN = 0


@torch.library.custom_op("fa_forensics::tap_attention", mutates_args=())
def tap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, mask: Optional[torch.Tensor],
                  dropout_p: float, is_causal: bool, scale: Optional[float], grad_enabled: bool,
                  autocast_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    session = current.session
    token = _NO_TOKEN
    # compiled graphs run with grad mode off: the traced mode is passed in
    if session is not None and grad_enabled and session.busy:
        sinks: list = []
        session.on_attention(q, k, v, o, scale=scale, causal=is_causal, attn_mask=mask, dropout_p=dropout_p,
                             source="sdpa", grad_sink=sinks.append, grad_enabled=True,
                             autocast_dtype=autocast_dtype)
        if sinks:
            token = next(_TOKENS)
            _GRAD_HOOKS[token] = sinks[0]
    return o.clone(), torch.tensor(token, dtype=torch.int64)


@tap_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, mask: Optional[torch.Tensor],
      dropout_p: float, is_causal: bool, scale: Optional[float], grad_enabled: bool,
      autocast_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(o), torch.empty((), dtype=torch.int64)


def _tap_attention_setup(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    ctx.save_for_backward(output[1])


def _tap_attention_backward(ctx: Any, grad_o: torch.Tensor, grad_token: Optional[torch.Tensor]) -> tuple:
    (token,) = ctx.saved_tensors
    return None, None, None, tap_grad(grad_o, token), None, None, None, None, None, None


tap_attention.register_autograd(_tap_attention_backward, setup_context=_tap_attention_setup)


@torch.library.custom_op("fa_forensics::tap_grad", mutates_args=())
def tap_grad(grad: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    hook = _GRAD_HOOKS.pop(int(token), None)
    if hook is not None:
        hook(grad)
    return grad.clone()


@tap_grad.register_fake
def _(grad: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("fa_forensics::tap_input", mutates_args=())
def tap_input(x: torch.Tensor, name: str, grad_enabled: bool) -> torch.Tensor:
    session = current.session
    if session is not None and grad_enabled:
        session.take_input_from_graph(name, x)
    return x.clone()


@tap_input.register_fake
def _(x: torch.Tensor, name: str, grad_enabled: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _tap_input_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return grad, None, None


tap_input.register_autograd(_tap_input_backward)


def forget_grad_hooks() -> None:
    """Drop dO hooks whose backward never ran (the session ended)."""
    _GRAD_HOOKS.clear()
