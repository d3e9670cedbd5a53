"""The memory-efficient kernel's backward schedule: which tile it picks, how many CTAs share one head's keys, and
in which order each CTA visits the (query block, key block) tiles.

From PyTorch's sources (aten/src/ATen/native/transformers/cuda/attention_backward.cu `_efficient_attention_backward`,
mem_eff_attention/kernel_backward.h, mem_eff_attention/kernels/cutlassB.h):
- Kernel: the first of the sm80 dispatch list (what sm_90 runs) whose kMaxK covers the head dim: 64 × 64 tiles
  (kBlockSizeI queries × kBlockSizeJ keys) up to head dim 64, 128 × 128 up to 128, 128 × 64 beyond. dK and dV
  stay in registers across query blocks when kMaxK ≤ kBlockSizeI; beyond 128 they go through an fp32 workspace
  (the same chain of fp32 additions, but the key-split heuristic caps the splits).
- Key splits (`num_splits_key`, the grid's x): ceil(keys / kBlockSizeJ); 1 when batch·heads ≥ 256 and the keys
  fit in two blocks; at most 200 / (batch·heads) when dK, dV need the workspace; 1 in deterministic mode.
  CTA s of a head takes the key blocks s, s + splits, ...
- Walk: for each of its key blocks a CTA visits query blocks from getQueryStart: the first block the key block
  sees (0 without a mask, the diagonal's under the causal mask), plus, without a mask and with more than one
  split, a shift of s query blocks (getQueryStartShift) after which it wraps around to block 0 and stops before
  the shift (incrIteration). dK and dV of a key block are fp32 accumulators continued over its walk.
- dQ: one fp32 accumulator per query block in a workspace, each CTA adding its tile under a lock (AtomicLock)
  and the last one writing dQ: the sum is chained in the order the CTAs reach that query block. Modelled with
  every CTA of a head running in lockstep (one tile per step; the shift exists so that they reach distinct
  query blocks at each step), ties between CTAs broken by split index. That order is the hardware's, not fixed by
  the program: the model reproduces the recorded bits (docs/gpu-fidelity.md) while every CTA of a head is
  resident at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BackwardTile:
    """The dispatched kernel's tile: kBlockSizeI query rows × kBlockSizeJ keys, and its kMaxK."""

    queries: int
    keys: int
    max_k: int

    @property
    def output_in_registers(self) -> bool:
        """kOutputInRF: dK and dV live in registers for the whole walk (else in an fp32 workspace)."""
        return self.max_k <= self.queries


def backward_tile(head_dim: int) -> BackwardTile:
    """The tile of the kernel `dispatch_cutlassB` launches on sm_80 and later for 16-bit inputs without dropout."""
    if head_dim <= 64:
        return BackwardTile(64, 64, 32 if head_dim <= 32 else 64)
    if head_dim <= 128:
        return BackwardTile(128, 128, 128)
    return BackwardTile(128, 64, 65536)


def key_splits(batch: int, heads: int, num_keys: int, tile: BackwardTile, deterministic: bool = False) -> int:
    """num_splits_key as `_efficient_attention_backward` picks it (no SM count enters the heuristic)."""
    splits = math.ceil(num_keys / tile.keys)
    if batch * heads >= 256 and num_keys <= 2 * tile.keys:
        splits = 1
    if not tile.output_in_registers:
        splits = min(splits, 200 // (batch * heads))
    return 1 if deterministic or splits < 1 else splits


def _query_shift(split: int, splits: int, num_queries: int, tile: BackwardTile, causal: bool) -> int:
    """getQueryStartShift: the first query row of a CTA's walk, before its wrap."""
    if causal or splits <= 1:
        return 0
    return (split * tile.queries) % (math.ceil(num_queries / tile.queries) * tile.queries)


def _first_query(key_start: int, num_queries: int, tile: BackwardTile, causal: bool) -> int:
    """getSmallestQueryForKey (top-left causal mask or none): the query block the key block first meets."""
    if not causal:
        return 0
    if key_start >= num_queries:
        return math.ceil(num_queries / tile.queries) * tile.queries  # nothing to compute
    return key_start // tile.queries * tile.queries


def cta_walk(split: int, splits: int, num_queries: int, num_keys: int, tile: BackwardTile,
             causal: bool) -> list[tuple[int, int]]:
    """The (query_start, key_start) tiles CTA `split` processes, in its order (attention_kernel's loops)."""
    shift = _query_shift(split, splits, num_queries, tile, causal)
    walk = []
    for key_start in range(split * tile.keys, num_keys, splits * tile.keys):
        query = _first_query(key_start, num_queries, tile, causal) + shift
        while query < num_queries:
            walk.append((query, key_start))
            nxt = query + tile.queries
            if shift:
                if nxt >= num_queries:
                    nxt = _first_query(key_start, num_queries, tile, causal)
                elif query < shift <= nxt:
                    break
            elif nxt >= num_queries:
                break
            query = nxt
    return walk


def tile_order(num_queries: int, num_keys: int, tile: BackwardTile, splits: int,
               causal: bool) -> list[tuple[int, int]]:
    """Every tile (query block, key block) of one head, as indices, in the order the model runs them: by step
    (the position in its CTA's walk), then by split. Each key block's tiles come in its CTA's walk order (the
    order of its dK, dV sums) and each query block's in the order the CTAs reach it (the order of its dQ sum)."""
    timed = []
    for split in range(splits):
        for step, (query, key) in enumerate(cta_walk(split, splits, num_queries, num_keys, tile, causal)):
            timed.append((step, split, query // tile.queries, key // tile.keys))
    return [(i, j) for _, _, i, j in sorted(timed)]
