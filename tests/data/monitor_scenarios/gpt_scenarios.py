"""A tiny bf16 GPT (2 layers, width 64, 4 heads, context 64) trained on Python stdlib bytes, with an
instability injected from step `--at` on. Nothing in it knows about fa-forensics: run it under
`fa-forensics capture ... -- python gpt_scenarios.py --scenario NAME`, or call `train(...)` inside a
capture session.

Scenarios (from step `at`; the weights are changed before that step's forward pass):
  control          nothing injected
  lr-jump          the learning rate times 30
  logit-growth     every layer's queries times 1.15 per step (logits grow 1.15x a step)
  sink-drift       every layer's queries drift towards the first key (attention collapses onto a sink)
  wq-x20           layer 1's W_Q times 20, once
  wq-x1e36         layer 1's W_Q times 1e36, once
  wq-nan           layer 1's W_Q set to NaN, once
  nan-activation   NaN in layer 0's input at one position of step `at` (NaN spreads through the weights)
  inf-loss         the loss of step `at` is +inf (its gradient is the loss's own: training goes on)
The script writes one loss per line to `--losses` (when given). `--stop-on-nonfinite` ends it with
exit code 1 at the first non-finite loss, as many training scripts do.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SCENARIOS = ("control", "lr-jump", "logit-growth", "sink-drift", "wq-x20", "wq-x1e36", "wq-nan", "nan-activation",
             "inf-loss")
STATE = {"step": 0, "scenario": "control", "at": 200}


def injected(step: int | None = None) -> bool:
    step = STATE["step"] if step is None else step
    return STATE["scenario"] != "control" and step >= STATE["at"]


class CausalSelfAttention(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.H, self.c_attn, self.c_proj = H, nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if injected() and STATE["scenario"] == "logit-growth":
            q = q * 1.15 ** (STATE["step"] - STATE["at"] + 1)
        if injected() and STATE["scenario"] == "sink-drift":
            q = q + 0.1 * (STATE["step"] - STATE["at"] + 1) * k[:, :, :1]  # towards key 0, growing each step
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(C), CausalSelfAttention(C, H)
        self.ln_2, self.mlp = nn.LayerNorm(C), nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, V: int = 256, T: int = 64, C: int = 64, H: int = 4, L: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block(C, H) for _ in range(L)])
        self.ln_f, self.head = nn.LayerNorm(C), nn.Linear(C, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.h):
            if i == 0 and STATE["scenario"] == "nan-activation" and STATE["step"] == STATE["at"]:
                x = x.clone()
                x[:, 5] = math.nan
            x = block(x)
        return self.head(self.ln_f(x))


def corpus(max_bytes: int = 500_000) -> torch.Tensor:
    """The first bytes of the stdlib's top-level .py files, in sorted order."""
    data = b""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()


def inject_weights(model: GPT, step: int) -> None:
    """The once-only weight changes, before step `at`'s forward pass."""
    if step != STATE["at"] or STATE["scenario"] not in ("wq-x20", "wq-x1e36", "wq-nan"):
        return
    w = model.h[1].attn.c_attn.weight
    C = w.shape[1]
    with torch.no_grad():
        if STATE["scenario"] == "wq-nan":
            w[:C] = math.nan
        else:
            w[:C] *= 20.0 if STATE["scenario"] == "wq-x20" else 1e36


def train(scenario: str = "control", *, steps: int = 300, at: int = 200, seed: int = 0, batch: int = 8,
          lr: float = 3e-3, stop_on_nonfinite: bool = False, on_loss=None,
          around=lambda model: contextlib.nullcontext()) -> list[float]:
    """Train; returns the loss of every step (the value backward() was called on). `around(model)`: a context
    manager the loop runs in (a library caller's capture session)."""
    STATE.update(step=0, scenario=scenario, at=at)
    torch.manual_seed(seed)
    model, T = GPT(), 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    tokens, gen = corpus(), torch.Generator().manual_seed(seed)
    with around(model):
        return _loop(model, opt, tokens, gen, scenario, steps, at, batch, lr, T, stop_on_nonfinite, on_loss)


def _loop(model, opt, tokens, gen, scenario, steps, at, batch, lr, T, stop_on_nonfinite, on_loss) -> list[float]:
    losses = []
    for step in range(steps):
        STATE["step"] = step
        scale = 30.0 if scenario == "lr-jump" and step >= at else 1.0
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * scale
        inject_weights(model, step)
        starts = torch.randint(0, tokens.numel() - T - 1, (batch,), generator=gen)
        idx = tokens[starts[:, None] + torch.arange(T + 1)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        if scenario == "inf-loss" and step == at:
            loss = loss + math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_loss is not None:
            on_loss(step, losses[-1])
        if stop_on_nonfinite and not math.isfinite(losses[-1]):
            raise SystemExit(f"loss is {losses[-1]} at step {step}; stopping")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=SCENARIOS, default="control")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--losses", default=None)
    parser.add_argument("--stop-on-nonfinite", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    losses = train(args.scenario, steps=args.steps, at=args.at, seed=args.seed, lr=args.lr,
                   stop_on_nonfinite=args.stop_on_nonfinite,
                   on_loss=None if args.losses is None else lambda step, loss: _append(args.losses, loss))
    print(f"final loss {losses[-1]:.4f}")


def _append(path: str, loss: float) -> None:
    with open(path, "a") as fh:
        fh.write(f"{loss!r}\n")


if __name__ == "__main__":
    main()
