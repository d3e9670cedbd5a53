"""Monitor work on a CUDA side stream, so the statistics of a forward's attention calls overlap its backward.

The monitor's per-call work (statistics kernels, W_Q Gram matrices) depends only on tensors the forward has
produced, and nothing in the step waits for its result until the step ends. On a CUDA device `SideStream.run`
queues that work on a stream of its own, after an event that marks where the training stream stood when it was
called: the side stream starts when its inputs are ready, and the GPU can run it beside the backward's kernels.
The inputs are marked as used on the side stream (`Tensor.record_stream`), so the caching allocator does not
hand their memory to the training stream before the side work has read it. `join()` makes the training stream
wait for everything queued so far: call it before anything reads the results or overwrites an input in place
(an optimizer step overwrites W_Q: snapshot weights, as the Gram matrices do, or join before the step).
The tensors `run` returns are marked as used on the training stream too, so their memory is not reused before
the training stream has read them. On a CPU, `run` calls the work at once and `join` does nothing: the CPU path
is unchanged.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a result: itself, the items of a tuple or list, the fields of a dataclass."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors_in(getattr(value, f.name))]
    return []


class SideStream:
    """Runs monitor work beside the training stream of `device` (CUDA), or inline (CPU)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream: Optional[Any] = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def run(self, work: Callable[[], Any], *inputs: torch.Tensor) -> Any:
        """work() on the side stream once the training stream has produced `inputs`; returns what work returns
        (tensors that are valid on the training stream after `join()`)."""
        if self.stream is None:
            return work()
        training = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(training)  # the inputs are ready when the side stream starts
        with torch.cuda.stream(self.stream):
            out = work()
        for t in inputs:
            if t.is_cuda:
                t.record_stream(self.stream)
        for t in _tensors_in(out):  # read on the training stream after join(): not to be reused before that
            if t.is_cuda:
                t.record_stream(training)
        return out

    def join(self) -> None:
        """The training stream waits for the side work queued so far (no host synchronization)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
