"""memory_efficient_attention with xformers' signature: (B, M, H, K) or (B, M, K), attn_bias kinds."""
import torch

from _reference import attention
from xformers.ops.fmha.attn_bias import AttentionBias, LowerTriangularMask  # noqa: F401


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
    three_d = query.dim() == 3
    if three_d:
        query, key, value = (t.unsqueeze(2) for t in (query, key, value))
    B, M, H, _ = query.shape
    mask = None
    if isinstance(attn_bias, torch.Tensor):
        mask = attn_bias.float()
    elif attn_bias is not None:
        mask = attn_bias.materialize((B, H, M, key.shape[1]), dtype=torch.float32, device=query.device)
    o = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale, False, mask).transpose(1, 2)
    return o.squeeze(2) if three_d else o
