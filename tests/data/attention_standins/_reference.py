"""Plain attention in (B, H, T, D) with an optional bool mask / additive bias: what the stand-ins compute."""
import torch


def attention(q, k, v, scale=None, causal=False, mask=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[1] != q.shape[1]:  # grouped-query: repeat K/V heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        tq, tk = s.shape[-2:]
        keep = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)
