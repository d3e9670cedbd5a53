"""A deterministic sample of a layer-step's query rows, the replay of those rows alone, and bit comparisons.

Rows of attention are independent: the forward of a block of query rows starting at row r0 gives, bit for
bit, those rows of the whole replay (`replay.emulate.forward`, whatever the tiling, the kernel model or the
mask). `match` screens its candidate recipes on a sample of rows and replays every element only for the
recipes that may win (a cached or in-dump match is re-checked on every element, never on a sample:
`fidelity.stored_match`). The sample depends on the number of rows alone (`row_sample`): blocks of
SAMPLE_BLOCK rows, about one row in SAMPLE_SHARE, spread evenly and ending with the last block (the rows that
see every key), for every batch row and head. A layer of a few blocks is not sampled: its sample is every row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.enums import Backend
from fa_forensics.errors import DumpError
from fa_forensics.layers.selection import LayerTensors, replay_layer
from fa_forensics.replay.config import ReplayConfig

SAMPLE_BLOCK = 32  # rows per sampled block: a multiple of every tensor-core row group
SAMPLE_SHARE = 16  # about one row in this many is sampled
_SCORES_PER_ITEM = 2**21  # scores (heads × rows × keys) replayed at once: bounded memory, as the full replay's


@dataclass(frozen=True)
class RowSample:
    """The sampled query rows of a layer with `n_rows` rows: half-open blocks (every row when `whole`)."""

    n_rows: int
    blocks: tuple[tuple[int, int], ...]

    @property
    def whole(self) -> bool:
        return self.blocks == ((0, self.n_rows),)

    @property
    def rows(self) -> int:
        return sum(i1 - i0 for i0, i1 in self.blocks)

    def index(self) -> torch.Tensor:
        """The sampled row numbers, in order (for `index_select` on the rows' dimension)."""
        return torch.cat([torch.arange(i0, i1) for i0, i1 in self.blocks])

    def to_list(self) -> list[list[int]]:
        return [[i0, i1] for i0, i1 in self.blocks]


def row_sample(n_rows: int) -> RowSample:
    """The sample of a layer with `n_rows` query rows: ceil(blocks / SAMPLE_SHARE) blocks of SAMPLE_BLOCK rows
    spread evenly, the last one last; every row when that would be half of them or more."""
    n_blocks = math.ceil(n_rows / SAMPLE_BLOCK)
    want = math.ceil(n_blocks / SAMPLE_SHARE)
    if 2 * want >= n_blocks:
        return RowSample(n_rows, ((0, n_rows),))
    picks = sorted({(k + 1) * n_blocks // want - 1 for k in range(want)})
    return RowSample(n_rows, tuple((b * SAMPLE_BLOCK, min((b + 1) * SAMPLE_BLOCK, n_rows)) for b in picks))


def stored_o(t: LayerTensors) -> torch.Tensor:
    """The layer-step's stored O, which a match compares replays with; DumpError when the dump has none."""
    if t.o is None:
        raise DumpError(f"{t.where}: the dump has no 'o' array; match compares replays with the stored O")
    return t.o


def replay_rows(t: LayerTensors, config: ReplayConfig, sample: RowSample,
                backend: Backend = Backend.EMULATE) -> torch.Tensor:
    """The replayed O (in config's O dtype) of the sampled rows of every batch row and head, (B, h, R, D): the
    same bits as those rows of `replay_layer(t, config)`. A whole sample (or another backend) replays the layer."""
    if sample.whole or Backend(backend) is not Backend.EMULATE:
        o = replay_layer(t, config, backward=False, backend=backend).o
        return o if sample.whole else o.index_select(2, sample.index())
    from fa_forensics.replay.emulate.forward import forward
    from fa_forensics.replay.emulate.ops import torch_dtype
    from fa_forensics.replay.emulate.run import emulator_threads, to_input_dtype

    B, H, T, D = t.q.shape
    config = t.with_facts(config)
    n_keys = t.k.shape[-2]
    heads = max(1, min(H, _SCORES_PER_ITEM // (SAMPLE_BLOCK * max(n_keys, 1))))
    out = torch.empty(B, H, sample.rows, D)
    with torch.no_grad(), emulator_threads():
        q, k, v = (to_input_dtype(x, config) for x in (t.q, t.k, t.v))  # (B, h, T, D) fp32
        mask = None if t.mask is None else t.mask.detach().cpu().expand(B, H, T, n_keys)
        generator = torch.Generator().manual_seed(config.seed)
        for b in range(B):
            for h0 in range(0, H, heads):
                at = (slice(b, b + 1), slice(h0, min(h0 + heads, H)))
                r = 0
                for i0, i1 in sample.blocks:
                    part = forward(q[at][..., i0:i1, :], k[at], v[at], config, causal=t.causal, scale=t.scale,
                                   generator=generator, row0=i0, mask=None if mask is None else mask[at][..., i0:i1, :])
                    out[at][..., r:r + i1 - i0, :] = part.o
                    r += i1 - i0
    return out.to(torch_dtype(config.o_dtype))


def sampled(x: torch.Tensor, sample: RowSample) -> torch.Tensor:
    """The sampled rows of a (B, h, T, D) tensor."""
    return x if sample.whole else x.index_select(2, sample.index())


def equal_bits(replayed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Elementwise: the replayed value, rounded to stored's dtype, has stored's bits (bool, stored's shape)."""
    r = replayed.to(stored.dtype)
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[stored.dtype.itemsize]
    return r.view(view) == stored.view(view)


@dataclass(frozen=True)
class Comparison:
    """A replayed O against the stored one: elements with equal bits, per row too, and the largest differences."""

    equal: int
    n: int
    equal_per_row: torch.Tensor  # (B·h·R,) int64: equal elements of every compared row
    max_abs_err: float  # max |O_replay − O_stored| over finite elements (in fp64); nan when none is finite
    max_ulp: Optional[int]  # max |stored − replayed| in ulps of its row's largest |stored| (`row_ulps`)

    @property
    def share(self) -> float:
        return self.equal / self.n if self.n else math.nan


def compare(replayed: torch.Tensor, stored: torch.Tensor) -> Comparison:
    """Bits of `replayed` (rounded to stored's dtype, nearest-even, as a kernel's epilogue would) against `stored`,
    both (B, h, R, D)."""
    equal = equal_bits(replayed, stored)
    diff = (replayed.to(stored.dtype).double() - stored.double()).abs()
    finite = torch.isfinite(diff)
    max_err = float((replayed.double() - stored.double()).abs()[finite].max()) if finite.any() else math.nan
    ulps = row_ulps(diff, stored)
    max_ulp = math.ceil(float(ulps[finite].max())) if finite.any() else None
    return Comparison(int(equal.sum()), stored.numel(), equal.reshape(-1, stored.shape[-1]).sum(-1), max_err, max_ulp)


def row_ulps(diff: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """|differences| (fp64) in ulps of the largest finite |stored| of their row (the last dimension): the unit a
    row's sums are rounded at, so that a kernel that sums in another order differs by a few of them, also in
    elements far below the row's largest (where the element's own ulp is tiny)."""
    info = torch.finfo(stored.dtype)
    magnitude = torch.where(torch.isfinite(stored), stored.double().abs(), torch.zeros((), dtype=torch.float64))
    scale = magnitude.amax(dim=-1, keepdim=True).clamp(min=info.tiny)
    _, exponent = torch.frexp(scale)  # scale = m · 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.full_like(scale, info.eps), exponent - 1)
    return diff / ulp


def compare_o(replayed: torch.Tensor, stored: torch.Tensor) -> tuple[float, float, int]:
    """(share of elements with equal bits in stored's dtype, max |difference|, n elements)."""
    c = compare(replayed, stored)
    return c.share, c.max_abs_err, c.n
