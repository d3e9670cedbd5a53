"""A tiny GPT whose attention is written inline in torch ops, in one of several forms a user may write
(written for the tests; nothing in it knows about fa-forensics):

  alibi    causal scores plus an ALiBi bias (−slope·distance per head), added before the softmax
  softcap  Gemma 2's soft-capping written inline: scores = cap · tanh(scores / cap), then the causal mask
  hbtd     the heads-first layout (H, B, T, D): q, k, v transposed so that heads lead the batch
  plain    causal scaled-dot-product attention in (B, H, T, D)

As a script: argv = form, steps, losses.json [, bf16]; it writes the loss of every step (bf16: CPU autocast)."""
import json
import math
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F

CAP = 5.0  # the soft-cap


def alibi_slopes(n_head):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_head) for h in range(n_head)])


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, form):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.form = n_head, n_embd, form
        pos = torch.arange(block_size)
        self.register_buffer("distance", (pos.view(1, -1) - pos.view(-1, 1)).clamp(max=0).float())
        self.register_buffer("slopes", alibi_slopes(n_head).view(1, n_head, 1, 1))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        if self.form == "hbtd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (H, B, T, D)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        if self.form == "alibi":
            att = att + self.slopes * self.distance[:T, :T]
        if self.form == "softcap":
            att = att / CAP
            att = torch.tanh(att)
            att = att * CAP
        att = att.masked_fill(~causal, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        if self.form == "hbtd":
            y = y.transpose(0, 1)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, form):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, block_size, form)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, form, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size, form) for _ in range(n_layer)])
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def main(form, steps, out, bf16=False):
    torch.manual_seed(0)
    model = GPT(form)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 64, (3, 17))
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with open(out, "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "bf16")
