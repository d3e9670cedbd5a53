"""A soft-cap written inline on the scores: `cap * tanh(scores / cap)` (Gemma 2's eager attention).

The chain (capture/torch_ops.py, which calls `on_tanh`) already folds a division of the scores by a number into
their scale. `on_tanh` takes tanh of the scores as a soft-cap of 1 on them, `tanh(S·σ) = 1·tanh(S·σ / 1)`; a
multiplication by c after it scales the cap and the scale alike (c·k·tanh(S·σ/k) = (c·k)·tanh(S·(σ·c)/(c·k))), so
any c·tanh(S·σ) is recorded as `softcap` c with scale σ·c, which is the soft-cap that replays apply:
s = cap·tanh(S·scale/cap).

A tanh of scores that already hold a mask or bias, or a second tanh, is a form replays cannot apply: following
the chain stops with `SoftCapNotFollowed`, whose line says what and what to do (the session says it; training
goes on).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

TANH_FUNCS = (torch.tanh, torch.Tensor.tanh, F.tanh)


class SoftCapNotFollowed(ValueError):
    """A tanh on the scores in a form that replays cannot apply."""


def on_tanh(node: Any, step: dict) -> Any:
    """The chain's scores after a tanh (`step` the op as recorded): they continue as soft-capped scores (softcap 1,
    see the module docstring); a form replays cannot apply raises `SoftCapNotFollowed`."""
    if node.softcap is not None:
        raise SoftCapNotFollowed("the scores pass through tanh twice, which replays cannot apply; report the call "
                                 "with fa_forensics.capture.record(q, k, v, o, ...) to record its Q, K, V and O")
    if node.terms:
        raise SoftCapNotFollowed(f"a soft-cap (tanh) is applied after a {node.terms[-1].kind} term on the scores "
                                 f"(ops: {' '.join(node.ops)}), which replays cannot apply (they cap the scaled "
                                 "scores, then mask); apply the mask after cap·tanh(scores / cap), or report the call "
                                 "with fa_forensics.capture.record(q, k, v, o, ...)")
    return replace(node, softcap=1.0, ops=(*node.ops, "tanh"), steps=(*node.steps, step))
