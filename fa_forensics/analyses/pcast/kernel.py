"""The FP8 P-cast attention of paper 002's Algorithm 1, replayed by the replay engine.

The study's kernel is the engine's fp8 recipe (preset "fp8-s1": Q, K, V in fp32 to isolate the
P cast, block 64, P̄·S cast to E4M3, ℓ from the pre-cast fp32 P̄, O accumulated from the cast
P̄ in fp32, epilogue O/(S·ℓ)) with the scale applied as Algorithm 1 does (P̄ multiplied by S,
`PScaleMode.MULTIPLY`), the study's S, KV order and block. What the cast zeroed is read from
the engine's per-block observer, so the counts describe exactly the arithmetic that made O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.errors import InvalidSetting
from fa_forensics.enums import KVOrder, PScaleMode
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.forward import BlockCast, forward

BASE_PRESET = "fp8-s1"  # the engine's fp8 recipe the study varies (S, order, block)


def kv_order(order: KVOrder | str) -> KVOrder:
    """A KV order from its enum or its name; InvalidSetting('orders') for any other name."""
    try:
        return KVOrder(order)
    except ValueError:
        names = ", ".join(o.value for o in KVOrder)
        raise InvalidSetting("orders", f"unknown KV order '{order}' ({names})") from None


def pcast_config(S: float, order: KVOrder | str = KVOrder.FORWARD, block: int = 64) -> ReplayConfig:
    """The replay recipe of one study setting: preset fp8-s1 with P̄ multiplied by S, `order`, `block`."""
    if not (math.isfinite(S) and S > 0):
        raise InvalidSetting("scales", f"P scale S must be positive, got {S} (e.g. 1,256,448)")
    if block < 1:
        raise InvalidSetting("block", f"block size must be ≥ 1, got {block} (e.g. 64)")
    return ReplayConfig.preset(BASE_PRESET).with_(
        p_scale=float(S), p_scale_mode=PScaleMode.MULTIPLY, kv_order=kv_order(order), block_n=int(block))


@dataclass(frozen=True)
class PcastKernelOut:
    """Output of one FP8-P-cast attention pass and what its cast zeroed."""

    o: torch.Tensor  # (..., q, d) fp32: O / (S·ℓ)
    n_zeroed: torch.Tensor  # (..., q) int64: counted P̄ > 0 before the cast and 0 after
    mass_zeroed: torch.Tensor  # (..., q) fp32: Σ of counted zeroed P̄ / ℓ (probability silently lost)
    lse: torch.Tensor  # (..., q) fp32: m + ln ℓ


class _ZeroedTally:
    """Observer of the engine's blocks: what the cast zeroed among the counted keys, and its share of ℓ.

    The zeroed mass follows ℓ's own recurrence (ℓ_z ← α·ℓ_z + Σ zeroed P̄·S), in fp64, and is
    divided by the same recurrence over every P̄·S: the ratio is the share of ℓ the cast dropped.
    """

    def __init__(self, counted: torch.Tensor):
        self.counted = counted  # (L, 1, q, N) bool
        rows = counted.shape[:3]
        self.n_zeroed = torch.zeros(rows, dtype=torch.int64)
        self.ell = torch.zeros(rows, dtype=torch.float64)
        self.ell_zeroed = torch.zeros(rows, dtype=torch.float64)

    def __call__(self, b: BlockCast) -> None:
        zeroed = (b.p_cast == 0) & (b.p_scaled > 0) & b.visible & self.counted[..., b.r0:, b.j0:b.j1]
        alpha = b.alpha.squeeze(-1).double()
        rows = slice(b.r0, None)
        self.ell[..., rows] = alpha * self.ell[..., rows] + b.p_scaled.double().sum(dim=-1)
        self.ell_zeroed[..., rows] = (alpha * self.ell_zeroed[..., rows]
                                      + torch.where(zeroed, b.p_scaled.double(), 0.0).sum(dim=-1))
        self.n_zeroed[..., rows] += zeroed.sum(dim=-1)


def pcast_attention(z: torch.Tensor, v: torch.Tensor, config: ReplayConfig,
                    counted: Optional[torch.Tensor] = None) -> PcastKernelOut:
    """The engine's forward under `config` on given scores: z (..., q, N) fp32 scaled scores (−inf
    where masked); v (..., N, d), broadcastable against z's leading dims. `counted` (bool,
    broadcastable to z, e.g. (N,) "not a sink") picks the keys whose zeroing is counted in n_zeroed."""
    lead, (q, n) = z.shape[:-2], z.shape[-2:]
    d = v.shape[-1]
    shape4 = tuple(lead) if len(lead) == 2 else (-1, 1)  # the engine's (B, H) of (B, H, T, N)
    z4 = z.to(torch.float32).reshape(*shape4, q, n)
    # a view where v broadcasts
    v4 = torch.broadcast_to(v.to(torch.float32), (*lead, n, d)).reshape(*z4.shape[:2], n, d)
    counted = torch.ones((), dtype=torch.bool) if counted is None else counted.to(torch.bool)
    tally = _ZeroedTally(torch.broadcast_to(counted, z.shape).reshape(z4.shape))
    out = forward(None, None, v4, config, causal=False, scale=1.0, generator=None, scores=z4, observe=tally)
    return PcastKernelOut(
        o=out.o.reshape(*lead, q, d),
        n_zeroed=tally.n_zeroed.reshape(*lead, q),
        mass_zeroed=(tally.ell_zeroed / tally.ell).float().reshape(*lead, q),
        lse=out.lse.reshape(*lead, q),
    )


def reference_attention(z: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax(z)·v in fp64: returns (o (..., q, d), p (..., q, N))."""
    p = torch.softmax(z.to(torch.float64), dim=-1)
    return p @ v.to(torch.float64), p
