"""The training-speed forward's levers (fast_tiles.KernelOptions) under the interpreter: the one-pass tie test,
TMA descriptors and warp specialization compute the same bits as the default, on repeated maxima, on a
sequence end inside a tile, and on scores placed exactly at the tie threshold and one ulp below it."""
import pytest
import torch

from fa_forensics.replay.triton import fast_attention as fast
from fa_forensics.replay.triton.fast_tiles import KernelOptions

VARIANTS = {
    "top2": KernelOptions(tie_test="top2"),
    "tma": KernelOptions(tma=True),
    "warp_specialize": KernelOptions(warp_specialize=True),
    "all": KernelOptions(tie_test="top2", tma=True, warp_specialize=True),
}


def _planted(T, D, dtype, seed):
    """Keys 2j, 2j+1 identical and every query aligned with one pair: the block maxima repeat."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, D, generator=g) for _ in range(3))
    k[:, :, 1::2] = k[:, :, 0::2]
    pick = torch.div(torch.arange(T), 2, rounding_mode="floor") * 2
    q = 3.0 * k[:, :, pick] + 0.1 * q
    return tuple(x.to(dtype) for x in (q, k, v))


@pytest.mark.parametrize("T, D, causal", [(96, 64, True), (72, 32, False)], ids=["T96-causal", "T72-full"])
def test_every_lever_computes_the_default_bits_on_repeated_maxima(T, D, causal):
    q, k, v = _planted(T, D, torch.bfloat16, seed=T)
    o, lse2 = fast.forward(q, k, v, causal=causal, scale=D ** -0.5, stable=True, options=KernelOptions())
    o_plain, _ = fast.forward(q, k, v, causal=causal, scale=D ** -0.5, stable=False, options=KernelOptions())
    assert (o != o_plain).float().mean().item() > 0.1  # the rule fires: the tie test decides something here
    for name, options in VARIANTS.items():
        o_v, lse2_v = fast.forward(q, k, v, causal=causal, scale=D ** -0.5, stable=True, options=options)
        assert torch.equal(o_v, o) and torch.equal(lse2_v, lse2), name


def test_both_tie_tests_decide_alike_at_the_threshold_and_one_ulp_below():
    """fp32 inputs whose dots are exact: row 0 has its second score exactly at fp32(max − ε/α) (a tie), row 1
    one ulp below it (no tie), row 2 the maximum twice (a tie), row 3 a single maximum."""
    D, T = 16, 64
    scale, eps = 0.25, 0.125  # ε/α = 0.5 exactly
    top = 8.0
    below = torch.nextafter(torch.tensor(top - 0.5), torch.tensor(-1.0)).item()
    seconds = [top - 0.5, below, top, top - 4.0]
    q = torch.zeros(1, 1, T, D)
    k = torch.zeros(1, 1, T, D)
    k[0, 0, 2:, 1] = -1.0  # keys 2.. score −10 in rows 0-3: far below the maximum
    k[0, 0, 0, 0] = 1.0  # key 0 scores `top`
    k[0, 0, 1, 2] = 1.0  # key 1 scores the row's `second`
    for row, second in enumerate(seconds):
        q[0, 0, row, 0] = top  # q·k₀ = top
        q[0, 0, row, 2] = second  # q·k₁ = second
        q[0, 0, row, 1] = 10.0
    q[0, 0, 4:] = torch.randn(T - 4, D, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(1))
    outs = {tie: fast.forward(q, k, v, causal=False, scale=scale, stable=True, eps=eps,
                              options=KernelOptions(tie_test=tie))[0] for tie in ("count", "top2")}
    o_plain = fast.forward(q, k, v, causal=False, scale=scale, stable=False)[0]
    assert torch.equal(outs["count"], outs["top2"])
    moved = [not torch.equal(outs["count"][0, 0, row], o_plain[0, 0, row]) for row in range(4)]
    assert moved == [True, False, True, False]

