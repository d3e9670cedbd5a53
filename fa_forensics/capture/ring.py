"""The host-memory ring of recent monitored steps (`--ring K`): what is written when an alarm fires.

On a monitored step that is not being written, the selected layers' Q, K, V, O, dO and X (batch
slice, selected heads) are copied to host memory as they would be for a dump, and kept for the
last K such steps only (a deque with maxlen K: memory is bounded by K steps). When the alarm fires
the session writes every step held (the alarm step included) as complete steps of the store.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class RingArray:
    layer: int
    name: str
    tensor: torch.Tensor  # on the host (pinned when it came from CUDA)
    ready: Any  # a torch.cuda.Event to wait on before reading `tensor`, or None
    layer_attrs: dict


@dataclass
class RingStep:
    """The arrays of one monitored step, held in host memory."""

    step: int
    arrays: list[RingArray] = field(default_factory=list)
    loss: Optional[float] = None

    @property
    def nbytes(self) -> int:
        return sum(a.tensor.numel() * a.tensor.element_size() for a in self.arrays)


class StepRing:
    """The last `capacity` sealed steps."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._steps: deque[RingStep] = deque(maxlen=self.capacity)

    def push(self, step: RingStep) -> None:
        self._steps.append(step)  # the oldest step falls out when full

    def last(self) -> Optional[RingStep]:
        return self._steps[-1] if self._steps else None

    def drain(self) -> list[RingStep]:
        """Every held step, oldest first; the ring is empty afterwards."""
        steps = list(self._steps)
        self._steps.clear()
        return steps

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._steps)

    def __len__(self) -> int:
        return len(self._steps)
