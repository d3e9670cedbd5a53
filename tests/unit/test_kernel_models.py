"""The kernel-model knobs of ReplayConfig: tile suffixes on preset names, refused combinations, the row-sum layout."""
from __future__ import annotations

import pytest
import torch

from fa_forensics.analyses.recipe import Recipe
from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.kernel_ops import lane_row_sums, reduce_lanes
from fa_forensics.replay.emulate.forward import forward
from fa_forensics.replay.kernel_recipes import kernel_presets


def test_a_preset_name_carries_its_tile():
    cfg = ReplayConfig.preset("sdpa-flash@block_m=64,block_n=256,kv_splits=4")
    assert (cfg.block_m, cfg.block_n, cfg.kv_splits, cfg.kv_order.value) == (64, 256, 4, "reverse")
    assert Recipe(preset="sdpa-cudnn-sm90@block_n=64").base_config().block_n == 64
    for bad in ("sdpa-flash@block_q=64", "sdpa-flash@block_n=big", "sdpa-nope@block_n=64"):
        with pytest.raises(ConfigError) as e:
            Recipe(preset=bad)
        assert "\n" not in str(e.value)


def test_kernel_models_refuse_the_reference_codes_knobs():
    with pytest.raises(ConfigError, match="kernel-model knobs"):
        ReplayConfig.preset("sdpa-flash").with_(softmax="stabilized")
    with pytest.raises(ConfigError, match="kv_splits without block_n"):
        ReplayConfig(kv_splits=2, pv_dtype="fp32")


def test_lane_row_sums_follow_the_mma_register_layout():
    """Thread q adds columns 8t + 2q, 8t + 2q + 1 in order; the quad all-reduce pairs threads (0, 2) and (1, 3)."""
    p = torch.zeros(1, 1, 1, 16)
    p[..., 0], p[..., 2], p[..., 6] = 1.0, 2.0 ** -24, 2.0 ** -24  # threads 0, 1 and 3
    partials = lane_row_sums(p, torch.zeros(1, 1, 1, 4))
    assert partials.flatten().tolist() == [1.0, 2.0 ** -24, 0.0, 2.0 ** -24]
    # (1 + 0) + (2^-24 + 2^-24) = 1 + 2^-23, where a left-to-right sum of the row loses both to ties-to-even
    assert reduce_lanes(partials).item() == 1.0 + 2.0 ** -23
    carried = lane_row_sums(p, partials * 0.5)  # the partials rescaled and carried into the next block
    assert carried.flatten().tolist() == [1.5, 1.5 * 2.0 ** -24, 0.0, 1.5 * 2.0 ** -24]


def test_flash_walks_keys_backwards_and_splits_change_the_bits():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 256, 64, generator=g).bfloat16().float() * s for s in (1.5, 1.5, 1.0))
    base = ReplayConfig.preset("sdpa-flash").with_(accumulation="tensor-core", block_n=64)
    outs = [forward(q, k, v, c, causal=True, scale=0.125, generator=None).o
            for c in (base, base.with_(kv_order="forward"), base.with_(kv_splits=2))]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert (outs[0] == outs[2]).float().mean() > 0.5  # the same kernel, a different summation


def test_match_candidates_per_head_dim():
    assert kernel_presets(64, 1024)[:2] == ["sdpa-cudnn-sm90@block_m=128,block_n=128",
                                            "sdpa-cudnn-sm90@block_m=128,block_n=64"]
    assert "sdpa-efficient@block_m=64,block_n=128" in kernel_presets(128, 1024)
    assert "sdpa-flash@block_m=64,block_n=256,kv_splits=4" in kernel_presets(64, 1024)
    assert not any("kv_splits" in n for n in kernel_presets(64, 256))  # one 256-key block: nothing to split
    assert all(n.startswith(("sdpa-cudnn-sm90-fp16", "sdpa-efficient-fp16", "sdpa-flash-fp16"))
               for n in kernel_presets(64, 1024, "float16"))
