"""The memory-efficient backward's schedule (replay/emulate/efficient_schedule.py), read from PyTorch's
attention_backward.cu and kernel_backward.h: the dispatched tile, the key-split heuristic, each CTA's walk over
the query blocks and the order that makes of every dK, dV and dQ sum; and that the schedule is a knob of the
config that changes the bits, not the gradients."""
from __future__ import annotations

import pytest
import torch

from fa_forensics.errors import ConfigError
from fa_forensics.replay import ReplayConfig, replay
from fa_forensics.replay.emulate.backward_kernels import kernel_backward
from fa_forensics.replay.emulate.efficient_schedule import (
    BackwardTile,
    backward_tile,
    cta_walk,
    key_splits,
    tile_order,
)

T64 = BackwardTile(64, 64, 64)


def test_the_dispatched_tile_per_head_dim():
    assert backward_tile(32) == BackwardTile(64, 64, 32)
    assert backward_tile(64) == T64 and T64.output_in_registers
    assert backward_tile(128) == BackwardTile(128, 128, 128) and backward_tile(96).output_in_registers
    assert backward_tile(256) == BackwardTile(128, 64, 65536) and not backward_tile(256).output_in_registers


def test_the_key_split_heuristic():
    assert key_splits(1, 2, 1024, T64) == 16  # one CTA per key block
    assert key_splits(1, 1, 1024, backward_tile(128)) == 8
    assert key_splits(1, 2, 1000, T64) == 16  # a partial last block is a block
    assert key_splits(16, 16, 128, T64) == 1  # enough heads and at most two key blocks: one CTA per head
    assert key_splits(16, 16, 192, T64) == 3
    wide = backward_tile(256)  # dK, dV through the workspace: at most 200 / (batch·heads) splits
    assert key_splits(2, 4, 1024, wide) == 16 and key_splits(4, 16, 1024, wide) == 3
    assert key_splits(8, 32, 1024, wide) == 1
    assert key_splits(1, 2, 1024, T64, deterministic=True) == 1


def test_each_cta_walks_from_its_shift_and_wraps_without_a_mask():
    assert cta_walk(0, 4, 256, 256, T64, causal=False) == [(0, 0), (64, 0), (128, 0), (192, 0)]
    assert cta_walk(1, 4, 256, 256, T64, causal=False) == [(64, 64), (128, 64), (192, 64), (0, 64)]
    assert cta_walk(3, 4, 256, 256, T64, causal=False) == [(192, 192), (0, 192), (64, 192), (128, 192)]
    # two CTAs for four key blocks: CTA 1 takes key blocks 1 and 3, each walk starting at query block 1
    assert cta_walk(1, 2, 256, 256, T64, causal=False) == [(q, key) for key in (64, 192) for q in (64, 128, 192, 0)]
    # causal: from the diagonal, no shift; one CTA: every walk ascending from 0
    assert cta_walk(1, 4, 256, 256, T64, causal=True) == [(64, 64), (128, 64), (192, 64)]
    assert cta_walk(0, 1, 128, 128, T64, causal=False) == [(0, 0), (64, 0), (0, 64), (64, 64)]


def test_the_tile_order_gives_every_sum_its_kernel_order():
    order = tile_order(256, 256, T64, splits=4, causal=False)
    assert sorted(order) == [(i, j) for i in range(4) for j in range(4)]
    dq_block_1 = [j for i, j in order if i == 1]  # the order the CTAs reach query block 1
    assert dq_block_1 == [1, 0, 3, 2]
    assert [i for i, j in order if j == 2] == [2, 3, 0, 1]  # key block 2's walk: its dK, dV sum
    causal = tile_order(256, 256, T64, splits=4, causal=True)
    assert [j for i, j in causal if i == 3] == [3, 2, 1, 0]  # under the mask: descending key blocks
    assert [j for i, j in tile_order(256, 256, T64, splits=1, causal=False) if i == 1] == [0, 1, 2, 3]


def _inputs(T=328, D=32):
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, T, D, generator=g).to(torch.bfloat16).float() for _ in range(4))
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    o = (torch.softmax(s, -1) @ v).to(torch.bfloat16).float()
    return q, k, v, do, o, torch.logsumexp(s, -1)


def test_the_split_count_changes_the_bits_not_the_gradients():
    """The key splits only reorder fp32 sums: the gradients of one CTA per head and of the heuristic's six
    (T 328: six blocks of 64, the last partial) differ in some bits and agree within a few ulps of the output."""
    q, k, v, do, o, lse = _inputs()
    cfg = ReplayConfig.preset("sdpa-efficient")
    split = kernel_backward(q, k, v, do, o, lse, cfg, causal=False, scale=32 ** -0.5)
    one = kernel_backward(q, k, v, do, o, lse, cfg.with_(bwd_key_splits=1), causal=False, scale=32 ** -0.5)
    for a, b in zip(split[1:], one[1:]):
        assert not torch.equal(a, b)
        assert ((a - b).abs() <= 2 ** -6 * b.abs().amax()).all()
    assert torch.equal(split[0], one[0])  # δ does not depend on the schedule


def test_the_split_count_is_a_config_knob():
    assert ReplayConfig.preset("sdpa-efficient@bwd_key_splits=1").bwd_key_splits == 1
    assert ReplayConfig.preset("sdpa-efficient").bwd_key_splits is None  # PyTorch's heuristic
    for bad in (0, 1025, True, 2.0):
        with pytest.raises(ConfigError, match="must be an integer from 1 to 1024"):
            ReplayConfig.preset("sdpa-efficient").with_(bwd_key_splits=bad)
    with pytest.raises(ConfigError, match="needs backward_kernel=sdpa-efficient, not flash-attention-2"):
        ReplayConfig.preset("sdpa-flash@bwd_key_splits=2")
    reference = ReplayConfig.preset("sdpa-efficient@bwd_key_splits=2").with_reference_backward()
    assert reference.backward_kernel.value == "reference" and reference.bwd_key_splits is None


def test_the_split_count_follows_the_launch_s_batch_and_heads():
    """PyTorch's heuristic reads the launch's batch and heads: 16 x 16 heads of 128 keys (two key tiles) run one
    CTA per head, one batch row of them two."""
    assert key_splits(16, 16, 128, backward_tile(32)) == 1 and key_splits(1, 16, 128, backward_tile(32)) == 2


@pytest.mark.slow  # the backward of 16 x 16 heads of 128 keys, replayed three times: about 5 s of CPU
def test_the_replay_takes_the_split_count_from_the_whole_launch():
    """The replay cuts the launch into work items of one batch row, yet runs the launch's split count (one CTA per
    head for 16 x 16 heads of 128 keys), not a batch row's."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(16, 16, 128, 32, generator=g).to(torch.bfloat16) for _ in range(4))
    config = ReplayConfig.preset("sdpa-efficient")
    default = replay(q, k, v, config, do, causal=False)
    one, two = (replay(q, k, v, config.with_(bwd_key_splits=n), do, causal=False) for n in (1, 2))
    for name in ("dq", "dk", "dv"):
        assert torch.equal(getattr(default, name), getattr(one, name)), name
    assert not torch.equal(default.dq, two.dq)
