"""replay(..., mask=...): SDPA's attn_mask (bool or additive) applied by the emulator, forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fa_forensics.errors import ConfigError
from fa_forensics.replay import replay
from fa_forensics.replay.api import BackendUnavailable
from fa_forensics.replay.config import ReplayConfig

B, H, T, D = 2, 2, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :5] = False  # left padding of sample 1: its rows 0..4 see no key under causal & padding
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]  # (B, 1, T, T)
    return q, k, v, do, mask


def _sdpa_grads(q, k, v, do, mask):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    o.backward(do)
    return o.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("kind", [pytest.param("bool", marks=pytest.mark.slow), "additive"])  # bool: about 3 s
def test_fp32_replay_under_a_mask_is_sdpa(kind):
    q, k, v, do, mask = _inputs()
    if kind == "additive":  # a bias on allowed keys, -inf elsewhere
        bias = 0.3 * torch.randn(B, 1, T, T, generator=torch.Generator().manual_seed(1))
        mask = bias.masked_fill(~mask, float("-inf"))
    o_ref, (dq_ref, dk_ref, dv_ref) = _sdpa_grads(q, k, v, do, mask)
    out = replay(q, k, v, ReplayConfig.preset("fp32"), do, causal=False, mask=mask)
    for got, ref in ((out.o, o_ref), (out.dq, dq_ref), (out.dk, dk_ref), (out.dv, dv_ref)):
        torch.testing.assert_close(got.float(), ref, atol=1e-6, rtol=1e-5)
    # rows with no allowed key: O = 0 and no gradient, as SDPA gives
    assert torch.all(out.o[1, :, :5] == 0) and torch.all(o_ref[1, :, :5] == 0)
    assert torch.all(out.dq[1, :, :5] == 0)
    # without the mask the replay is another attention: the mask is really applied
    assert (replay(q, k, v, ReplayConfig.preset("fp32"), causal=True).o - o_ref).abs().max() > 0.1


def test_mask_errors_are_one_line():
    q, k, v, _, mask = _inputs()
    with pytest.raises(ConfigError, match="does not broadcast"):
        replay(q, k, v, ReplayConfig.preset("fp32"), causal=False, mask=mask[..., :3])
    with pytest.raises(BackendUnavailable, match="does not apply attention masks"):
        replay(q, k, v, ReplayConfig.preset("fp32"), causal=False, mask=mask, backend="triton")


def test_streamed_replay_under_a_mask_has_the_bits_of_one_pass():
    from fa_forensics.replay.emulate.run import StreamPlan, emulate_replay

    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(2, 2, 64, 8, generator=g).bfloat16() for _ in range(4))
    keep = torch.rand(2, 64, generator=g) > 0.3  # random key padding
    mask = keep[:, None, None, :]  # (B, 1, 1, Tk)
    config = ReplayConfig.preset("bf16")
    whole = emulate_replay(q, k, v, config, do, causal=True, scale=0.35, mask=mask,
                           plan=StreamPlan(heads=2, block_m=None))
    parts = emulate_replay(q, k, v, config, do, causal=True, scale=0.35, mask=mask,
                           plan=StreamPlan(heads=1, block_m=32))
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert torch.equal(getattr(whole, name), getattr(parts, name)), name


def test_a_broadcast_additive_mask_reuses_the_compiled_kernels(monkeypatch):
    """An fp32 additive mask broadcast over heads reaches the compiled stages as a contiguous array: a strided
    one made numba compile a second specialization of each kernel (minutes on a first use: a fully masked dump
    took 100 s to match instead of 15 s)."""
    from fa_forensics.replay.emulate import fused

    seen = []

    def watching(kernel):
        def call(buf, mask_np, *rest):
            seen.append((kernel.__name__, mask_np.flags.c_contiguous))
            return kernel(buf, mask_np, *rest)
        call.__name__ = kernel.__name__
        return call

    monkeypatch.setattr(fused, "_forward_block", watching(fused._forward_block))
    monkeypatch.setattr(fused, "_backward_probs", watching(fused._backward_probs))
    q, k, v, do, mask = _inputs()
    additive = torch.zeros(1, 1, T, T).masked_fill(~mask[:1], float("-inf"))  # (1, 1, T, T): broadcast over B and H
    out = replay(q, k, v, ReplayConfig.preset("bf16-autocast-stabilized"), do, causal=False, mask=additive)
    assert torch.all(out.o[0, :, 0, :].float().isfinite())
    assert {name for name, _ in seen} == {"_forward_block", "_backward_probs"}, "the compiled stages did not run"
    assert all(contiguous for _, contiguous in seen), f"a mask block reached a kernel strided: {seen}"
