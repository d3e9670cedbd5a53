"""A nanoGPT-style GPT whose attention is the paper's reference FlashAttention-2 as it trains.

`flash_attention_bf16` computes, forward and backward, exactly what the paper's reference code
(pure-PyTorch FA2 under CUDA BF16 autocast, blocks of 512; ucker/why-low-precision-training-fails)
computes, by running the replay emulator under preset "bf16-autocast-train" (its numerics
contract: fa_forensics/replay/emulate/forward.py and backward.py; the preset: replay/config.py):
- forward: S = bf16(q kᵀ), s = bf16(S·α); running max m and row sum ℓ in bf16; P̄ = exp(bf16(s − m))
  cast to bf16; the O accumulator a bf16 buffer, rescaled and added to in bf16; O = bf16(acc / ℓ);
- backward: dP = bf16(dO Vᵀ), δ = Σ bf16(dO ∘ O), dS = bf16(P·α·(dP − δ)), dQ, dK, dV accumulated
  block by block in bf16.
Every exp is the emulator's, so a stored Q, K, V replayed under that preset (`fa-forensics match`)
gives the stored O bit for bit on any CPU. The emulator runs on the CPU (a CUDA model's tensors
are copied there and back). CPU autocast is switched off inside: these are the only roundings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fa_forensics.capture import record as capture_record

TRAINING_RECIPE = "bf16-autocast-train"  # the replay preset the demo's attention is


class _ReferenceAttention(torch.autograd.Function):
    """Forward and backward of the reference code through the emulator (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool, block: int):
        from fa_forensics.replay.config import ReplayConfig
        from fa_forensics.replay.emulate.forward import forward
        from fa_forensics.replay.emulate.run import to_input_dtype

        config = ReplayConfig.preset(TRAINING_RECIPE).with_(block_m=block, block_n=block)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            q32, k32, v32 = (to_input_dtype(x, config) for x in (q, k, v))  # (B, H, T, D) bf16 values as fp32
            fwd = forward(q32, k32, v32, config, causal=causal, scale=scale, generator=None)
        ctx.save_for_backward(q32, k32, v32, fwd.o, fwd.lse)
        ctx.config, ctx.scale, ctx.causal, ctx.dtypes = config, scale, causal, (q.dtype, k.dtype, v.dtype)
        return fwd.o.to(device=q.device, dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, do):
        from fa_forensics.replay.emulate.backward import backward
        from fa_forensics.replay.emulate.run import to_input_dtype

        q32, k32, v32, o32, lse = ctx.saved_tensors
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            g = backward(q32, k32, v32, to_input_dtype(do, ctx.config), lse, ctx.config,
                         causal=ctx.causal, scale=ctx.scale, o_for_delta=o32)
        dq, dk, dv = (x.to(device=do.device, dtype=dt) for x, dt in zip((g.dq, g.dk, g.dv), ctx.dtypes))
        return dq, dk, dv, None, None, None


def flash_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
                         block: int = 512) -> torch.Tensor:
    """The paper's reference FA2 (preset bf16-autocast-train, blocks `block`): q, k, v (B, H, T, D) → O (B, H, T, D)
    bf16."""
    return _ReferenceAttention.apply(q, k, v, float(scale), bool(causal), int(block))


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 256  # context T
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128  # C; head dim D = C / H
    attention: str = "flash-bf16"  # "flash-bf16" (the reference FA2, reports to capture) | "sdpa"
    flash_block: int = 512  # the reference code's block size (T = 256 fits in one)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: x (B, T, C) → (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.attention, self.flash_block = config.attention, config.flash_block
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.last_o = None  # O of the last call (tests read it with retain_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        scale = 1.0 / math.sqrt(D)
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        else:
            o = flash_attention_bf16(q, k, v, scale, causal=True, block=self.flash_block)
            capture_record(q, k, v, o, scale=scale, causal=True, softmax="standard")  # no-op unless capturing
        self.last_o = o
        y = o.to(q.dtype).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, n_layer blocks (`transformer.h.{i}.attn`), tied LM head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) int64 → logits (B, T, V); with targets (B, T) also the mean cross-entropy loss."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
