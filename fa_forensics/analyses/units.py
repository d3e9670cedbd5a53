"""The independent units of the bias tests: rows that share their dominant key set err together.

A query row's O is dominated by the V rows of the keys that attain its maximum score. Rows of one (step, batch
row, head) whose maximum is attained by the same key, or by the same set of tied keys, read mostly the same V
rows, so their rounding errors move together: they are one measurement, not many. `row_units` gives every row
the id of its unit, (batch row, dominant key set) within a layer-step and head (a step is a layer-step of its
own, so units never span steps), and says which rows have a repeated maximum (the precondition of the P̄ = 1
mechanism, counted as pv-trace counts it: the maximum score attained more than once, exactly). The scores are
the replay's (`primitives.scores_fp32`, in the recipe's s_dtype, under the recorded attn_mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.analyses.primitives import scores_fp32
from fa_forensics.analyses.significance import ALL_ROWS, SUBSETS, TIED_ROWS, UNIT_KIND  # noqa: F401 - re-exported

_HASH_BITS = 40  # per-key weights below 2^40: a sum over up to 2^23 keys stays inside int64


@dataclass(frozen=True)
class RowUnits:
    """The unit of every row of one layer-step and whether its maximum repeats."""

    unit: torch.Tensor  # (B, h, T) int64: dense ids 0..n_units[j]−1 per head j, distinct across batch rows
    tied: torch.Tensor  # (B, h, T) bool: the row's maximum score is attained more than once

    @property
    def n_units(self) -> list[int]:
        """Units per head (over every batch row)."""
        return [int(self.unit[:, j].max()) + 1 if self.unit[:, j].numel() else 0 for j in range(self.unit.shape[1])]


def _key_weights(n_keys: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 2 ** _HASH_BITS, (n_keys,), generator=g, dtype=torch.int64)


def units_of_scores(s: torch.Tensor) -> RowUnits:
    """`RowUnits` of scores s (B, h, T, K) (−inf where masked): a row's key set is the keys at its maximum; a row
    that sees no key is a unit of its own."""
    B, h, T, K = s.shape
    r_m = s.amax(dim=-1, keepdim=True)
    seen = r_m[..., 0] > -math.inf  # (B, h, T)
    at_max = (s == r_m) & seen[..., None]  # (B, h, T, K)
    count = at_max.sum(dim=-1)  # (B, h, T)
    weights = _key_weights(K)
    batch = torch.arange(B).view(B, 1).expand(B, T)
    row = torch.arange(T).view(1, T).expand(B, T)
    unit = torch.empty(B, h, T, dtype=torch.int64)
    for j in range(h):  # one head at a time: the (B, T, K) hash terms stay small
        first = at_max[:, j].to(torch.int8).argmax(dim=-1)  # (B, T) the first key of the set
        digest = (at_max[:, j].to(torch.int64) * weights).sum(dim=-1)  # (B, T) a hash of the set
        unseen = torch.where(seen[:, j], torch.full_like(row, -1), row)  # a row without keys: its own unit
        key = torch.stack([batch, first, count[:, j], digest, unseen], dim=-1).reshape(-1, 5)
        unit[:, j] = torch.unique(key, dim=0, return_inverse=True)[1].reshape(B, T)
    return RowUnits(unit=unit, tied=(count > 1) & seen)


def row_units(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, s_dtype: str = "fp32",
              mask: Optional[torch.Tensor] = None) -> RowUnits:
    """The units of a layer-step's rows from its stored q, k (B, h, T, D) as the replay scores them, one batch row
    at a time to bound memory (T² scores per head)."""
    parts = []
    for b in range(q.shape[0]):
        mb = None if mask is None else (mask[b : b + 1] if mask.shape[0] > 1 else mask)
        parts.append(units_of_scores(scores_fp32(q[b : b + 1], k[b : b + 1], scale, causal, s_dtype, mb)))
    if len(parts) == 1:
        return parts[0]
    offset = torch.zeros(q.shape[1], dtype=torch.int64)
    units = []
    for p in parts:
        units.append(p.unit + offset.view(1, -1, 1))
        offset = offset + p.unit.amax(dim=(0, 2)) + 1
    return RowUnits(unit=torch.cat(units), tied=torch.cat([p.tied for p in parts]))


def rows_as_units(shape: tuple[int, ...]) -> RowUnits:
    """Every row its own unit, no row tied: the units of errors without scores (rows taken as independent)."""
    B, h, T = shape
    ids = torch.arange(B * T, dtype=torch.int64).view(B, 1, T).expand(B, h, T).contiguous()
    return RowUnits(unit=ids, tied=torch.zeros(B, h, T, dtype=torch.bool))


def layer_units(t, config) -> RowUnits:
    """The units of a loaded layer-step `t` (`layers.selection.LayerTensors`, its inputs as `config` sees them),
    scored in `config`'s s_dtype (a ReplayConfig: the low-precision recipe's) under its recorded attn_mask."""
    return row_units(t.q, t.k, t.scale, t.causal, config.s_dtype.value, t.mask)
