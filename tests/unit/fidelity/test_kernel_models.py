"""The kernel-model knobs of ReplayConfig: tile suffixes on preset names, refused combinations, the row-sum layout."""
from __future__ import annotations

import pytest
import torch

from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.errors import ConfigError
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.kernel_ops import (
    fold_lane_sums, lane_block_sums, lane_row_sums, reduce_lane_pairs, reduce_lanes, warp_row_sums,
)
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


def test_lanes_fma_fuses_the_rescale_and_reduces_in_pairs():
    """cuDNN's row sum: each thread's block sum from 0, fused into its partial as fma(α, ℓ_q, s_q) (one rounding where
    fp32(α·ℓ_q) + s_q rounds twice), the partials reduced as (ℓ₀ + ℓ₁) + (ℓ₂ + ℓ₃)."""
    p = torch.zeros(1, 1, 1, 16)
    p[..., 0], p[..., 2], p[..., 8] = 2.0 ** -30, 1.0, 2.0 ** -24  # threads 0, 1 and 0
    assert lane_block_sums(p).flatten().tolist() == [2.0 ** -30 + 2.0 ** -24, 1.0, 0.0, 0.0]
    partials = torch.full((1, 1, 1, 4), 1.0 + 2.0 ** -12)
    alpha = torch.full((1, 1, 1, 1), 1.0 + 2.0 ** -12)  # α·ℓ_q = 1 + 2^-11 + 2^-24, half an ulp over 1 + 2^-11
    s = torch.tensor([[[[2.0 ** -30, 0.0, 0.0, 0.0]]]])
    folded = fold_lane_sums(partials, alpha, s).flatten().tolist()
    assert folded[0] == 1.0 + 2.0 ** -11 + 2.0 ** -23  # the exact sum is over the half: rounded up
    assert (alpha * partials + s).flatten()[0].item() == 1.0 + 2.0 ** -11  # the tie of the product went to even
    tiny = 2.0 ** -24
    partials = torch.tensor([1.0, 0.0, tiny, tiny])
    assert reduce_lane_pairs(partials).item() == 1.0 + 2.0 ** -23  # (1 + 0) + (2^-24 + 2^-24)
    assert reduce_lanes(partials).item() == 1.0  # (1 + 2^-24) + (0 + 2^-24): both lost to ties-to-even


def test_warp_row_sums_follow_the_cutlass_kernels_order():
    """The memory-efficient kernel: thread q of a quad adds keys 8t + 2q, 8t + 2q + 1 (t = 0..3) of its 32-key warp
    tile in order, the quad reduces (s0 + s1) + (s2 + s3), and ℓ adds the warp tiles one by one."""
    tiny = 2.0 ** -24
    zero = torch.zeros(1)
    p = torch.zeros(1, 32)
    p[0, 0], p[0, 4], p[0, 6] = 1.0, tiny, tiny  # threads 0, 2, 3: (1 + 0) + (2^-24 + 2^-24) = 1 + 2^-23
    assert warp_row_sums(p, zero).item() == 1.0 + 2.0 ** -23
    assert reduce_lanes(lane_row_sums(p[None], torch.zeros(1, 1, 4))).item() == 1.0  # FlashAttention-2's pairing
    p = torch.zeros(1, 32)
    p[0, 0], p[0, 1], p[0, 8] = 1.0, tiny, tiny  # one thread, in order: each 2^-24 is lost to ties-to-even
    assert warp_row_sums(p, zero).item() == 1.0
    p = torch.zeros(1, 40)  # two warp tiles (the second one padded with zeros), added to the rescaled ℓ in turn
    p[0, 0], p[0, 32] = 1.0, tiny
    assert warp_row_sums(p, torch.tensor([tiny])).item() == 1.0  # (2^-24 + 1) + 2^-24
    assert (p.double().sum() + tiny) == 1.0 + 2.0 ** -23


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


@pytest.mark.parametrize("name,backward,mma_k", [
    ("sdpa-cudnn-sm90", "sdpa-cudnn", None), ("sdpa-cudnn-sm90-fp16", "sdpa-cudnn", None),
    ("sdpa-efficient", "sdpa-efficient", 8), ("sdpa-efficient-fp16", "sdpa-efficient", 8),
    ("sdpa-flash", "flash-attention-2", None), ("sdpa-flash-fp16", "flash-attention-2", None),
    ("flash-attn-2", "flash-attention-2", None),
])
def test_kernel_presets_model_forward_and_backward(name, backward, mma_k):
    """A kernel preset replays that kernel's backward too: replay(..., dO) gives the named backward's gradients
    on the replay's own O and lse, which are not the emulator's reference backward's."""
    from fa_forensics.replay import replay
    from fa_forensics.replay.emulate.backward_kernels import kernel_backward

    cfg = ReplayConfig.preset(name)
    assert (cfg.backward_kernel.value, cfg.mma_k) == (backward, mma_k)
    dtype = torch.float16 if name.endswith("fp16") else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 128, 32, generator=g).to(dtype) * s for s in (1.5, 1.5, 1.0))
    do = (torch.randn(1, 1, 128, 32, generator=g) * 0.01).to(dtype)
    out = replay(q, k, v, cfg, do, causal=True, scale=32 ** -0.5)
    _, dq, dk, dv = kernel_backward(*(x.float() for x in (q, k, v, do)), out.o.float(), out.lse, cfg, causal=True,
                                    scale=32 ** -0.5)
    assert torch.equal(out.dq, dq) and torch.equal(out.dk, dk) and torch.equal(out.dv, dv)
    ref = replay(q, k, v, cfg.with_(backward_kernel="reference"), do, causal=True, scale=32 ** -0.5)
    assert not torch.equal(ref.dq.to(dtype), out.dq.to(dtype))


def test_mma_k_sets_the_tensor_core_groups_of_every_product():
    """mma_k = 8 (an m16n8k8 instruction) regroups the products of forward and backward; 16 is the H100's own
    group for bf16, so it changes nothing; it is a kernel-model knob (refused with the reference code's)."""
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, 1, 64, 64, generator=g).bfloat16() * s for s in (1.5, 1.5, 1.0, 0.01))
    from fa_forensics.replay import replay

    base = ReplayConfig.preset("bf16-hw")
    outs = {m: replay(q, k, v, base.with_(mma_k=m), do, causal=True, scale=0.125) for m in (None, 16, 8)}
    for name in ("o", "dq", "dk", "dv"):
        assert torch.equal(getattr(outs[None], name), getattr(outs[16], name))
    assert not torch.equal(outs[None].dq, outs[8].dq) and not torch.equal(outs[None].dk, outs[8].dk)
    for bad in (0, 65, 8.0):
        with pytest.raises(ConfigError, match="mma_k"):
            ReplayConfig(mma_k=bad, pv_dtype="fp32")
    with pytest.raises(ConfigError, match="kernel-model knobs"):
        ReplayConfig.preset("bf16-autocast").with_(mma_k=8)
