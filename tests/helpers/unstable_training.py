"""Tiny GPT-style byte decoders trained with AdamW, made unstable the ways the literature describes.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities") reproduce
at small scale the instabilities of large runs:
- attention-logit growth: without qk-layernorm, at a high learning rate, the attention logits grow until
  the softmax collapses onto one key and the loss diverges;
- output-logit divergence: without z-loss, the language-model head's logits drift (their log-sum-exp
  runs away from 0) at a high learning rate on the head;
- optimizer settings: AdamW's epsilon too small, or β₂ too high, after a learning-rate change.
Healthy controls use qk-layernorm (a LayerNorm on each head's queries and keys) and low learning rates.

Nothing here knows about fa-forensics: `train(spec, around=...)` runs inside whatever context manager
`around(model)` returns (a capture session). Attention is `F.scaled_dot_product_attention`, the loss
`F.cross_entropy` on the head's logits, as in ordinary training scripts.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class RunSpec:
    """One training run: the model, the optimizer and what makes it (un)stable."""

    name: str
    healthy: bool  # a control: no instability is expected
    lr: float = 3e-3
    qk_norm: bool = False  # LayerNorm on queries and keys (per head)
    z_loss: float = 0.0  # coefficient of the z-loss, mean(lse²) of the head's logits
    head_lr_mult: float = 1.0  # the head's learning rate = lr × this
    eps: float = 1e-8  # AdamW epsilon
    beta2: float = 0.95
    lr_spike: Optional[tuple[int, float]] = None  # (from step, ×lr)
    seed: int = 0
    steps: int = 300
    warmup: int = 10  # linear learning-rate warm-up, steps
    width: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 64
    batch: int = 8
    clip: float = 0.0  # gradient-norm clipping (0: none)
    weight_decay: float = 0.0

    def with_seed(self, seed: int) -> RunSpec:
        return replace(self, seed=seed, name=f"{self.name.rsplit('/', 1)[0]}/s{seed}")


class Attention(nn.Module):
    def __init__(self, C: int, H: int, qk_norm: bool):
        super().__init__()
        self.H = H
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        D = C // H
        self.q_norm = nn.LayerNorm(D) if qk_norm else None
        self.k_norm = nn.LayerNorm(D) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, C: int, H: int, qk_norm: bool):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(C), Attention(C, H, qk_norm)
        self.ln_2 = nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C, bias=False), nn.GELU(), nn.Linear(4 * C, C, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, spec: RunSpec, vocab: int = 256):
        super().__init__()
        C = spec.width
        self.wte, self.wpe = nn.Embedding(vocab, C), nn.Embedding(spec.context, C)
        self.h = nn.ModuleList([Block(C, spec.heads, spec.qk_norm) for _ in range(spec.layers)])
        self.ln_f, self.head = nn.LayerNorm(C), nn.Linear(C, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


_CORPUS: dict[int, torch.Tensor] = {}


def corpus(max_bytes: int = 400_000) -> torch.Tensor:
    """The first bytes of the stdlib's top-level .py files, in sorted order (byte ids)."""
    if max_bytes not in _CORPUS:
        data = b""
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            data += path.read_bytes()
            if len(data) >= max_bytes:
                break
        _CORPUS[max_bytes] = torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()
    return _CORPUS[max_bytes]


def learning_rate(spec: RunSpec, step: int) -> float:
    lr = spec.lr * min(1.0, (step + 1) / max(spec.warmup, 1))
    if spec.lr_spike is not None and step >= spec.lr_spike[0]:
        lr *= spec.lr_spike[1]
    return lr


def train(spec: RunSpec, *, around: Callable = lambda model: contextlib.nullcontext(),
          on_step: Optional[Callable[[int, float], None]] = None, stop_after_divergence: int = 0) -> list[float]:
    """Train `spec.steps` steps; the loss of every step (NaN where it was not finite).

    stop_after_divergence > 0: stop that many steps after the loss is first non-finite (a diverged run learns
    nothing more)."""
    torch.manual_seed(spec.seed)
    model = TinyGPT(spec)
    head = [p for n, p in model.named_parameters() if n.startswith("head.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opt = torch.optim.AdamW([{"params": rest, "mult": 1.0}, {"params": head, "mult": spec.head_lr_mult}],
                            lr=spec.lr, betas=(0.9, spec.beta2), eps=spec.eps, weight_decay=spec.weight_decay)
    tokens, gen = corpus(), torch.Generator().manual_seed(spec.seed)
    T = spec.context
    losses: list[float] = []
    nonfinite_at = None
    with around(model):
        for step in range(spec.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(spec, step) * group["mult"]
            starts = torch.randint(0, tokens.numel() - T - 1, (spec.batch,), generator=gen)
            idx = tokens[starts[:, None] + torch.arange(T + 1)]
            logits = model(idx[:, :-1]).reshape(-1, 256)
            loss = F.cross_entropy(logits, idx[:, 1:].reshape(-1))
            total = loss
            if spec.z_loss:
                total = loss + spec.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
            total.backward()
            if spec.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = float(loss.detach())
            losses.append(value if math.isfinite(value) else math.nan)
            if on_step is not None:
                on_step(step, value)
            if not math.isfinite(value) and nonfinite_at is None:
                nonfinite_at = step
            if stop_after_divergence and nonfinite_at is not None and step >= nonfinite_at + stop_after_divergence:
                break
    return losses


def loss_spike(losses: list[float], *, window: int = 20, rise: float = 1.0, hold: int = 5,
               start: int = 20) -> Optional[int]:
    """The first step whose loss is not finite, or exceeds the median of the `window` steps before it by more than
    `rise` nats and stays there (the median of it and the `hold` − 1 steps after it too: one hard batch is not a
    spike); after step `start` (the first steps fall fast). None when there is none."""
    for t in range(start, len(losses)):
        x = losses[t]
        if not math.isfinite(x):
            return t
        before = [v for v in losses[max(0, t - window):t] if math.isfinite(v)]
        if not before:
            continue
        bar = statistics.median(before) + rise
        after = [v if math.isfinite(v) else math.inf for v in losses[t:t + hold]]
        if x > bar and statistics.median(after) > bar:
            return t
    return None


# The runs of the benchmark: unstable ones (each with the mechanism that breaks it) and healthy controls.
UNSTABLE = (
    # no qk-layernorm, the learning rate warmed up towards 1.0: the attention logits grow from the first steps
    RunSpec("attn-logit-growth", healthy=False, lr=1.0, warmup=300, heads=2),
    # qk-layernorm, no z-loss, the head's learning rate 300× the rest: the output logits run away
    RunSpec("output-logit-divergence", healthy=False, lr=1e-2, head_lr_mult=300.0, warmup=300, heads=2, qk_norm=True),
    # AdamW with a tiny epsilon and β₂ = 0.999, the learning rate ×10 at step 150
    RunSpec("optimizer-lr-spike", healthy=False, lr=1e-2, eps=1e-15, beta2=0.999, lr_spike=(150, 10.0), heads=2,
            qk_norm=True),
)
HEALTHY = (
    RunSpec("healthy-qk-norm", healthy=True, lr=1e-1, qk_norm=True),  # a high learning rate behind qk-layernorm
    RunSpec("healthy-low-lr", healthy=True, lr=3e-3),  # no qk-layernorm, a low learning rate
    RunSpec("healthy-lower-lr", healthy=True, lr=1e-3, heads=2),
)
