"""The demo training loop: the small GPT on the demo corpus's bytes, bf16 autocast, AdamW, optional capture.

Per step: forward under bf16 autocast → loss.backward() → clip the gradient norm to 1.0 →
optimizer.step() → capture session's `cap.step(loss)` → `on_step(StepInfo, model)`.
`on_step` is the one place for per-step statistics (a monitor hooks in there).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch

from fa_forensics.demo.corpus import CORPUS_BYTES
from fa_forensics.demo.data import demo_corpus, random_batch
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.errors import InvalidSetting

if TYPE_CHECKING:
    from fa_forensics.capture.settings import CaptureSettings


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (given these and the torch build, the run is deterministic: the corpus is
    generated, the same bytes everywhere)."""

    steps: int = 300
    seed: int = 0
    device: str = "cpu"
    batch_size: int = 4
    lr: float = 2e-3
    warmup: int = 20
    grad_clip: float = 1.0
    model: GPTConfig = GPTConfig()
    corpus_bytes: int = CORPUS_BYTES
    capture: Optional[CaptureSettings] = None  # what to record (None = no capture); the monitor writes there too


@dataclass(frozen=True)
class StepInfo:
    """What one training step produced."""

    step: int
    loss: float
    lr: float
    seconds: float


@dataclass(frozen=True)
class TrainResult:
    losses: tuple[float, ...]
    captured_steps: tuple[int, ...]
    seconds: float
    monitored_steps: int = 0
    alarm_steps: tuple[int, ...] = ()  # steps at which the monitor's alarm fired


StepHook = Callable[[StepInfo, torch.nn.Module], None]


def build(config: DemoConfig) -> tuple[GPT, torch.optim.Optimizer, torch.Tensor, torch.Generator]:
    """The seeded model, its AdamW optimizer (β = 0.9, 0.95, no weight decay), the corpus and the batch RNG."""
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise InvalidSetting("device", f"unknown device {config.device!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidSetting("device", "cuda asked for, but no CUDA GPU is available; use cpu")
    torch.manual_seed(config.seed)
    model = GPT(config.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    tokens = demo_corpus(config.corpus_bytes)
    generator = torch.Generator().manual_seed(config.seed)
    return model, optimizer, tokens, generator


def train_step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               grad_clip: float) -> torch.Tensor:
    """One optimizer step under bf16 autocast; returns the loss (a 0-dim fp32 tensor)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(config: DemoConfig, on_step: Optional[StepHook] = None) -> TrainResult:
    """Run the demo training; capture the selected steps (and monitor every N-th) if `config.capture` is set."""
    model, optimizer, tokens, generator = build(config)
    device = next(model.parameters()).device
    session = contextlib.nullcontext()
    if config.capture is not None:
        from fa_forensics.capture import CaptureSession

        session = CaptureSession(
            model, config.capture,
            run_attrs={"amp_dtype": "bfloat16", "device": str(device),
                       "model": {"name": "fa-forensics demo GPT", **config.model.__dict__},
                       "capture": {"command": "demo-train", "seed": config.seed, "train_steps": config.steps}},
        )
    losses: list[float] = []
    start = time.perf_counter()
    with session as cap:
        for step in range(config.steps):
            lr = config.lr * min(1.0, (step + 1) / max(1, config.warmup))
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            x, y = (t.to(device) for t in random_batch(tokens, config.batch_size, config.model.block_size, generator))
            loss = train_step(model, optimizer, x, y, config.grad_clip)
            if cap is not None:
                cap.step(loss)
            info = StepInfo(step, float(loss), lr, time.perf_counter() - t0)
            losses.append(info.loss)
            if on_step is not None:
                on_step(info, model)
        captured = tuple(cap.recorded_steps) if cap is not None else ()
    monitored = len(cap.monitored_steps) if cap is not None else 0
    alarm_steps = tuple(sorted({a.step for a in cap.alarms})) if cap is not None else ()
    return TrainResult(tuple(losses), captured, time.perf_counter() - start, monitored, alarm_steps)
