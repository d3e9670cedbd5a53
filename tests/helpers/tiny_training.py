"""The tiny byte-level demo GPT and its training steps under CPU bf16 autocast, as the tests' training loops take
them."""
from __future__ import annotations

import math
from pathlib import Path

import torch

import fa_forensics


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


def tiny_gpt(n_layer: int = 2, n_head: int = 2):
    """The demo GPT (pure-PyTorch bf16 flash attention) over bytes, 32 positions and 32 channels, seeded."""
    from fa_forensics.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=n_layer, n_head=n_head, n_embd=32))


def monitored_run(out: Path, n_steps: int, *, n_layer: int = 2, n_head: int = 2, nan_at: int | None = None,
                  **capture_options) -> list[float]:
    """`n_steps` real AdamW steps (lr 1e-2) of `tiny_gpt` under `fa_forensics.capture(out=out, **capture_options)`;
    with `nan_at`, every step's loss is reported to the session and that step's as NaN (an alarm's cue). The losses
    of the steps."""
    model = tiny_gpt(n_layer, n_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    with fa_forensics.capture(model, out=out, **capture_options) as cap:
        for step in range(n_steps):
            loss = train_step(model, opt, gen)
            if nan_at is not None:
                cap.step(math.nan if step == nan_at else loss)
            losses.append(loss.item())
    return losses
