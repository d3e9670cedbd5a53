"""A nanoGPT-style GPT whose attention is a pure-PyTorch FlashAttention-2 forward with BF16 casts.

Numerics contract of `flash_attention_bf16` (the paper's setting: its reference code is a pure
PyTorch FA2 run under BF16 autocast, P̄V in BF16):
- inputs q, k, v are cast to bf16 (what autocast's linear layers return);
- S = α · Q Kᵀ in fp32 (bf16 × bf16 products are exact in fp32; fp32 accumulation);
- online softmax over KV blocks: running max m and running sum ℓ in fp32, causal mask -inf;
- P̄ = exp(S − m) cast to bf16; ℓ ← ℓ·exp(m_old − m) + rowsum(P̄) in fp32;
- P̄V is an fp32 matmul of the exact bf16 values rounded to bf16 (autocast's matmul output);
  the accumulator acc ← acc·exp(m_old − m) + bf16(P̄V) stays fp32;
- O = bf16(acc / ℓ).
The backward pass is autograd through these operations (fp32 where the forward is fp32).
Autocast is switched off inside, so the casts above are the only roundings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fa_forensics.capture import record as capture_record


def flash_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
                         block: int = 128) -> torch.Tensor:
    """FlashAttention-2 forward (Algorithm 1 of the paper) in plain PyTorch: q, k, v (B, H, T, D) → O (B, H, T, D) bf16."""
    bf16 = torch.bfloat16
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(bf16), k.to(bf16), v.to(bf16)
        T = q.shape[2]
        rows = []
        for i0 in range(0, T, block):
            q_i = q[:, :, i0:i0 + block].float()  # (B, H, Br, D) exact bf16 values
            Br = q_i.shape[2]
            m_i = q_i.new_full(q_i.shape[:-1] + (1,), -math.inf)  # (B, H, Br, 1)
            l_i = q_i.new_zeros(q_i.shape[:-1] + (1,))  # (B, H, Br, 1)
            acc = torch.zeros_like(q_i)  # (B, H, Br, D) fp32
            kv_end = min(T, i0 + Br) if causal else T
            for j0 in range(0, kv_end, block):
                k_j = k[:, :, j0:j0 + block].float()  # (B, H, Bc, D)
                v_j = v[:, :, j0:j0 + block].float()  # (B, H, Bc, D)
                s_ij = (q_i @ k_j.transpose(-1, -2)) * scale  # (B, H, Br, Bc) fp32
                if causal and j0 + k_j.shape[2] > i0:
                    row = torch.arange(i0, i0 + Br, device=s_ij.device)[:, None]
                    col = torch.arange(j0, j0 + k_j.shape[2], device=s_ij.device)[None, :]
                    s_ij = s_ij.masked_fill(col > row, -math.inf)
                m_new = torch.maximum(m_i, s_ij.amax(dim=-1, keepdim=True))
                p_bar = torch.exp(s_ij - m_new).to(bf16)  # (B, H, Br, Bc) the P̄ cast
                rescale = torch.exp(m_i - m_new)
                l_i = l_i * rescale + p_bar.float().sum(dim=-1, keepdim=True)
                pv = (p_bar.float() @ v_j).to(bf16)  # (B, H, Br, D) P̄V rounded to bf16
                acc = acc * rescale + pv.float()
                m_i = m_new
            rows.append((acc / l_i).to(bf16))
        return torch.cat(rows, dim=2)  # (B, H, T, D) bf16


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 256  # context T
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128  # C; head dim D = C / H
    attention: str = "flash-bf16"  # "flash-bf16" (pure-PyTorch FA2, reports to capture) | "sdpa"
    flash_block: int = 128


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
            capture_record(q, k, v, o, scale=scale, causal=True)  # no-op unless a capture is active
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
