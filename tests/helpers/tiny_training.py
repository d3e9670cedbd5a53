"""One optimizer step of a tiny byte-level GPT under CPU bf16 autocast, as the tests' training loops take it."""
from __future__ import annotations

import torch


def train_step(model, opt: torch.optim.Optimizer, gen: torch.Generator, batch: int = 2, seq: int = 32) -> torch.Tensor:
    """A random (batch, seq) window of byte ids as input and target, forward under bf16 autocast, backward, the
    optimizer's step; the loss (its graph freed)."""
    idx = torch.randint(0, 256, (batch, seq), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
