"""A small pure-PyTorch blocked attention as an autograd Function, in the style of the paper's
reference code (written for the tests: tiles of `block` keys, running row max and row sum, an
environment switch to a stabilized shift), in layout (B, H, T, D)."""
import os

import torch


class BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, block):
        scale = q.shape[-1] ** -0.5
        T = q.shape[-2]
        o = torch.zeros_like(q)
        row_max = torch.full((*q.shape[:-1], 1), -torch.finfo(q.dtype).max, dtype=q.dtype, device=q.device)
        row_sum = torch.zeros((*q.shape[:-1], 1), dtype=q.dtype, device=q.device)
        rows = torch.arange(T, device=q.device).view(-1, 1)
        for start in range(0, k.shape[-2], block):
            kc, vc = k[..., start:start + block, :], v[..., start:start + block, :]
            s = torch.einsum("...id,...jd->...ij", q, kc) * scale
            if causal:
                cols = torch.arange(start, start + kc.shape[-2], device=q.device).view(1, -1)
                s = s.masked_fill(cols > rows, -torch.finfo(s.dtype).max)
            m = s.amax(dim=-1, keepdim=True)
            if os.environ.get("TINY_STABLE", "0") == "1":
                ties = (s >= m - 1e-3).sum(dim=-1, keepdim=True) > 1
                m = torch.where(ties & (m > 0), 2.0 * m, m)
                m = torch.where(ties & (m < 0), 0, m)
            new_max = torch.maximum(m, row_max)
            p = torch.exp(s - new_max)
            correction = torch.exp(row_max - new_max)
            row_sum.copy_(correction * row_sum + p.sum(dim=-1, keepdim=True).clamp(min=1e-10))
            o.mul_(correction).add_(torch.einsum("...ij,...jd->...id", p, vc))
            row_max.copy_(new_max)
        o.div_(row_sum)
        ctx.save_for_backward(q, k, v, o)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().float().requires_grad_() for t in (q, k, v))
            s = qq @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
            if ctx.causal:
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            out = torch.softmax(s, dim=-1) @ vv
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
