"""The catalogue of attention kernels users train with, as replay recipes with their tile search space.

Each `KernelRecipe` names a kernel, the preset that models its arithmetic (replay/config.py), where the model
comes from, the devices and stored dtypes it applies to, and the tiles it runs with per head dimension (and
dropout): `tiles(head_dim, n_keys)` gives the preset names with an '@' tile suffix, most likely first
(`sdpa-flash@block_m=64,block_n=256,kv_splits=4`). `kernel_presets` lists them for one layer, the order `match`
tries them in. docs/gpu-fidelity.md has each model, its sources and its measured fidelity.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from fa_forensics.replay.emulate.split_kv import split_ranges


def _tile(**fields) -> str:
    return ",".join(f"{k}={v}" for k, v in fields.items())


def _cudnn_tiles(head_dim: int, n_keys: int, dropout: bool) -> list[str]:
    # closed source: 128-key tiles reproduced every recorded set on sm_90 (head dims 32, 64, 128); 64 as the
    # alternative the kernel may pick
    return [_tile(block_m=128, block_n=128), _tile(block_m=128, block_n=64)]


def _efficient_tiles(head_dim: int, n_keys: int, dropout: bool) -> list[str]:
    # PyTorch's cutlassF dispatch takes the first kernel whose kMaxK fits: 64 x 64 (head dim <= 64),
    # 64 x 128 (<= 128), 32 x 128 beyond
    if head_dim <= 64:
        return [_tile(block_m=64, block_n=64)]
    if head_dim <= 128:
        return [_tile(block_m=64, block_n=128)]
    return [_tile(block_m=32, block_n=128)]


def flash_tile(head_dim: int, dropout: bool = False, causal: bool = True, sm8x: bool = False) -> tuple[int, int]:
    """(block_m, block_n) of FlashAttention-2's forward (flash_fwd_launch_template.h) for head dims up to 128 on
    sm_80 / sm_90, and on sm_86 / sm_89 (`sm8x`) where it differs; beyond 128, 128 x 64 is assumed (not read
    from the source)."""
    if head_dim <= 32:
        return (128, 128)
    if head_dim <= 64:
        return (128, 64) if dropout else (128, 128)
    if head_dim <= 96:
        return (64, 64) if sm8x and causal else (128, 64)
    if head_dim <= 128:
        if dropout:
            return (128, 32)
        if sm8x:
            return (64, 64) if causal else (128, 32)
        return (128, 64)
    return (128, 64)


def _flash_tiles(head_dim: int, n_keys: int, dropout: bool) -> list[str]:
    # the one-pass kernel first, then its split-KV forward (64-row tiles, 256 / 128 / 64 keys) for every
    # split count that changes the runs (the count PyTorch picks depends on batch·heads and the GPU's SMs)
    bm, bn = flash_tile(head_dim, dropout)
    tiles = [_tile(block_m=bm, block_n=bn)]
    bm8, bn8 = flash_tile(head_dim, dropout, sm8x=True)  # sm_86 / sm_89: only another block_n changes the bits
    if bn8 != bn:
        tiles.append(_tile(block_m=bm8, block_n=bn8))
    if dropout:
        return tiles
    split_bn = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    n_blocks = math.ceil(n_keys / split_bn)
    seen = set()
    for s in range(2, min(n_blocks, 16) + 1):
        runs = tuple(r for r in split_ranges(n_keys, split_bn, s) if r[0] < r[1])
        if len(runs) > 1 and runs not in seen:
            seen.add(runs)
            tiles.append(_tile(block_m=64, block_n=split_bn, kv_splits=s))
    return tiles


@dataclass(frozen=True)
class KernelRecipe:
    """One kernel: its model's preset, sources, where it runs, what it stores, its tiles, and the entry point a
    recorded run names it by (`entry`: sdpa-cudnn, sdpa-efficient, sdpa-flash, flash_attn)."""

    kernel: str
    preset: str
    source: str
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]  # stored O dtypes (torch names without "torch.")
    tile_rule: Callable[[int, int, bool], list[str]]
    entry: str

    def tiles(self, head_dim: int, n_keys: int, dropout: bool = False) -> list[str]:
        """The preset names with their tile suffix, most likely first."""
        return [f"{self.preset}@{t}" for t in self.tile_rule(head_dim, n_keys, dropout)]


KERNEL_RECIPES = (
    KernelRecipe("SDPA cuDNN attention, sm_90", "sdpa-cudnn-sm90",
                 "closed source: cuDNN frontend documentation and measurement on an H200", ("cuda",), ("bfloat16",),
                 _cudnn_tiles, "sdpa-cudnn"),
    KernelRecipe("SDPA memory-efficient attention (xformers / CUTLASS)", "sdpa-efficient",
                 "PyTorch mem_eff_attention/kernel_forward.h", ("cuda",), ("bfloat16",), _efficient_tiles,
                 "sdpa-efficient"),
    KernelRecipe("SDPA FlashAttention-2 (PyTorch's vendored copy)", "sdpa-flash",
                 "PyTorch flash_attn/ (flash_fwd_kernel.h, softmax.h, flash_api.cpp)", ("cuda",), ("bfloat16",),
                 _flash_tiles, "sdpa-flash"),
    KernelRecipe("FlashAttention-2 (flash-attn package)", "flash-attn-2",
                 "Dao-AILab/flash-attention csrc/flash_attn/src", ("cuda",), ("bfloat16",), _flash_tiles,
                 "flash_attn"),
    KernelRecipe("SDPA cuDNN attention, sm_90, fp16", "sdpa-cudnn-sm90-fp16",
                 "as sdpa-cudnn-sm90 with fp16 inputs, P̄ and O", ("cuda",), ("float16",), _cudnn_tiles,
                 "sdpa-cudnn"),
    KernelRecipe("SDPA memory-efficient attention, fp16", "sdpa-efficient-fp16",
                 "as sdpa-efficient with fp16 inputs, P̄ and O", ("cuda",), ("float16",), _efficient_tiles,
                 "sdpa-efficient"),
    KernelRecipe("SDPA FlashAttention-2, fp16", "sdpa-flash-fp16",
                 "as sdpa-flash with fp16 inputs, P̄ and O", ("cuda",), ("float16",), _flash_tiles,
                 "sdpa-flash"),
)


def kernel_presets(head_dim: int, n_keys: int, dtype: str = "bfloat16", dropout: bool = False) -> list[str]:
    """Every kernel recipe for a layer whose stored O has `dtype`, with its tiles, in search order."""
    return [name for r in KERNEL_RECIPES if dtype in r.dtypes for name in r.tiles(head_dim, n_keys, dropout)]
