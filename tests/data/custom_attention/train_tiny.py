"""A tiny nanoGPT-style training run whose attention is `BlockedAttention` (nothing in it knows
about fa-forensics). argv: steps, losses.json [, autocast]; it writes the loss of every step."""
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from blocked_attention import BlockedAttention


class CausalSelfAttention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H, self.c_attn, self.c_proj = H, nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = BlockedAttention.apply(q, k, v, None, True, 512)  # tiles of 512 keys, as the paper runs it
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(C), CausalSelfAttention(C, H)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class GPT(nn.Module):
    def __init__(self, V=64, C=32, H=2, L=2):
        super().__init__()
        self.wte, self.head = nn.Embedding(V, C), nn.Linear(C, V)
        self.h = nn.ModuleList([Block(C, H) for _ in range(L)])

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


steps, out = int(sys.argv[1]), sys.argv[2]
autocast = len(sys.argv) > 3 and sys.argv[3] == "autocast"
torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for _ in range(steps):
    idx = torch.randint(0, 64, (2, 20))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
    loss = F.cross_entropy(logits.float().view(-1, 64), idx.roll(-1, 1).view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
with open(out, "w") as fh:
    json.dump(losses, fh)
