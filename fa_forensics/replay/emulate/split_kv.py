"""FlashAttention-2's split-KV forward: the key blocks cut into runs, each run's O and lse, then the combine kernel.

PyTorch's FlashAttention-2 forward (without dropout) chooses a number of splits from the occupancy of the GPU
(`flash_num_splits`, the heuristic of its flash_api.cpp); with more than one split each run of
ceil(n_blocks / splits) key blocks (block_n keys each) is its own online softmax, written as an fp32 O normalized
by that run's ℓ, and an fp32 lse = fma(m, α, log ℓ) (−inf where the run sees no key). The combine kernel, per row:
lse_max = max lse (0 if all −inf); e_s = exp(fp32(lse_s − lse_max)); their sum by a shuffle-xor butterfly over the
lanes of its thread layout; lse = fp32(log Σ) + lse_max; O = Σ_s fma(exp(fp32(lse_s − lse)), O_s, O) in split
order from 0, then one cast to the output dtype. exp and log are the given functions (the kernel presets: CUDA's
expf and logf, numerics.libdevice, as a build without fast math calls them).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fa_forensics.numerics import exp_fp32, fma_fp32, log_fp32

_THREADS = 128  # threads of the combine kernel's block


def split_ranges(n_keys: int, block_n: int, splits: int) -> list[tuple[int, int]]:
    """[start, stop) of the keys of each split: ceil(n_blocks / splits) blocks of block_n keys each (the
    trailing splits may be empty, as in the kernel)."""
    n_blocks = math.ceil(n_keys / block_n)
    per_split = math.ceil(n_blocks / splits)
    return [(min(s * per_split * block_n, n_keys), min((s + 1) * per_split * block_n, n_keys)) for s in range(splits)]


def combine_lanes(head_dim: int) -> int:
    """Lanes that hold one row's per-split lse in the combine kernel: 128 threads over a block of 4 (head dim a
    multiple of 128), 8 (of 64) or 16 rows."""
    rows = 4 if head_dim % 128 == 0 else (8 if head_dim % 64 == 0 else 16)
    return _THREADS // rows


def butterfly_sum(values: torch.Tensor, lanes: int) -> torch.Tensor:
    """The sum over dim 0 (splits, ...) as the combine kernel forms it: split s sits in lane s % lanes (each lane
    first adds its own splits in order), then shuffle-xor steps lanes/2, ..., 1 add lane pairs."""
    held = torch.zeros((lanes, *values.shape[1:]), dtype=torch.float32)
    for s in range(values.shape[0]):
        held[s % lanes] = held[s % lanes] + values[s]
    offset = lanes // 2
    while offset >= 1:
        held = held + held[torch.arange(lanes) ^ offset]
        offset //= 2
    return held[0]


def combine(parts: list[tuple[torch.Tensor, torch.Tensor]], head_dim: int, exp=exp_fp32,
            log=log_fp32) -> tuple[torch.Tensor, torch.Tensor]:
    """(O fp32 (B, H, R, D), lse (B, H, R)) from each split's (O_s fp32, lse_s)."""
    lse = torch.stack([p[1] for p in parts])  # (S, B, H, R)
    lse_max = lse.amax(dim=0)
    lse_max = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    total = butterfly_sum(exp(lse - lse_max), combine_lanes(head_dim))
    empty = (total == 0) | torch.isnan(total)
    lse_sum = torch.where(empty, torch.full_like(total, math.inf), log(total) + lse_max)
    o = torch.zeros_like(parts[0][0])
    for o_s, lse_s in parts:
        o = fma_fp32(exp(lse_s - lse_sum).unsqueeze(-1), o_s, o)
    return o, lse_sum


def forward_splits(run: Callable[[tuple[int, int]], tuple[torch.Tensor, torch.Tensor, object]], n_keys: int,
                   block_n: int, splits: int, head_dim: int, exp=exp_fp32, log=log_fp32):
    """Run `run(keys)` (one split's (O_s, lse_s, stats)) for every split and combine with `exp`, `log`:
    (O, lse, [stats])."""
    parts, stats = [], []
    for keys in split_ranges(n_keys, block_n, splits):
        o_s, lse_s, st = run(keys)
        parts.append((o_s, lse_s))
        stats.append(st)
    o, lse = combine(parts, head_dim, exp, log)
    return o, lse, stats


def flash_num_splits(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, sm_count: int,
                     dropout: bool = False) -> int:
    """The number of splits PyTorch's FlashAttention-2 forward picks (flash_api.cpp's num_splits_heuristic with
    128 threads per block): 1 with dropout or when batch·heads·ceil(seqlen_q / 64) blocks nearly fill the GPU;
    else the fewest splits whose wave efficiency is within 85 % of the best."""
    if dropout:
        return 1
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    n_blocks = math.ceil(seqlen_k / block_n)
    work = batch * heads * math.ceil(seqlen_q / 64)
    slots = 2 * sm_count
    if work >= 0.8 * slots:
        return 1
    most = min(128, slots, n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))

    eff = {}
    for s in range(1, most + 1):
        if eligible(s):
            waves = work * s / slots
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values(), default=0.0)
    return next((s for s in sorted(eff) if eff[s] >= 0.85 * best), 1)
