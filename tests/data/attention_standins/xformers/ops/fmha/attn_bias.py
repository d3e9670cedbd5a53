"""The attn_bias kinds with xformers' names and `materialize(shape, dtype, device)` semantics."""
from dataclasses import dataclass

import torch


class AttentionBias:
    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        raise NotImplementedError


class LowerTriangularMask(AttentionBias):
    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        keep = torch.ones(shape[-2:], dtype=torch.bool, device=device).tril()
        return torch.zeros(shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))


@dataclass
class BlockDiagonalMask(AttentionBias):
    q_seqlens: list
    kv_seqlens: list
    causal: bool = False

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls(list(q_seqlen), list(kv_seqlen or q_seqlen))

    def make_causal(self):
        return BlockDiagonalCausalMask(self.q_seqlens, self.kv_seqlens, True)

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        keep = torch.zeros(shape[-2:], dtype=torch.bool, device=device)
        q0 = k0 = 0
        for lq, lk in zip(self.q_seqlens, self.kv_seqlens):
            block = torch.ones(lq, lk, dtype=torch.bool, device=device)
            keep[q0:q0 + lq, k0:k0 + lk] = block.tril() if self.causal else block
            q0, k0 = q0 + lq, k0 + lk
        return torch.zeros(shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))


class BlockDiagonalCausalMask(BlockDiagonalMask):
    pass
