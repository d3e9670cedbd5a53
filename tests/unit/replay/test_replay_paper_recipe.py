"""The `bf16-autocast*` recipes against the explicit-cast transcription of the paper's reference
code (tests/helpers/paper_reference.py), bit for bit, forward and backward, at T > 512 (two query
and key blocks, the second ragged) with rows whose maximum score is negative."""
import pytest
import torch

from paper_reference import negative_max_inputs, paper_backward, paper_forward
from fa_forensics.replay import ReplayConfig, replay

T, D = 512 + 128, 16  # blocks of 512: two query and key blocks, the second ragged; α = 1/4


@pytest.fixture(scope="module")
def inputs():
    return negative_max_inputs(T, D, seed=7)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.to(torch.bfloat16).view(torch.int16), b.to(torch.bfloat16).view(torch.int16))


def test_the_inputs_have_rows_with_negative_maxima_and_repeated_maxima(inputs):
    q, k, v, _ = inputs
    s = (q.float() @ k.float().transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    row_max = s.amax(dim=-1)
    assert (row_max[..., :512] < 0).sum() > 300  # in the first query block, which visits hidden key blocks
    assert replay(q, k, v, ReplayConfig.preset("bf16-autocast"), causal=True).stats.repeated_max_rows.sum() > 300


@pytest.mark.parametrize("preset", ["bf16-autocast", "bf16-autocast-train"])
def test_standard_forward_equals_the_reference_code(inputs, preset):
    q, k, v, _ = inputs
    out = replay(q, k, v, ReplayConfig.preset(preset), causal=True)
    o_ref, lse_ref = paper_forward(q, k, v, stable=False)
    assert _bits_equal(out.o, o_ref)
    assert torch.equal(out.lse, lse_ref)


def test_the_fix_as_run_equals_the_reference_code_with_stable_1(inputs):
    q, k, v, _ = inputs
    o_ref, lse_ref = paper_forward(q, k, v, stable=True)
    out = replay(q, k, v, ReplayConfig.preset("bf16-autocast-stabilized"), causal=True)
    assert _bits_equal(out.o, o_ref) and torch.equal(out.lse, lse_ref)
    assert out.stats.stabilized_rows.sum() > 100  # the rule fired on visible ties
    # Algorithm 3 inside a loop that stops at the diagonal is a different kernel. In the reference,
    # a hidden block sets m = 0 in rows whose maximum is negative (ℓ and O rescaled), and adds the
    # 1e-10 floor to ℓ, which is tiny in tied rows with a large maximum (m = 2·r_m). Only query
    # blocks with hidden key blocks after them (rows < 512) can differ.
    skipping = ReplayConfig.preset("bf16-autocast").with_(softmax="stabilized")
    o_skip = replay(q, k, v, skipping, causal=True).o
    differs = (o_skip.view(torch.int16) != o_ref.view(torch.int16)).any(dim=-1)  # (1, H, T)
    s = (q.float() @ k.float().transpose(-1, -2)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    negative_rows = s.amax(dim=-1) < 0  # (1, H, T)
    assert (differs & negative_rows).sum() >= 2 and (differs & ~negative_rows).sum() >= 2
    assert not differs[..., 512:].any()


@pytest.mark.parametrize("stable", [False, True], ids=["standard", "stable"])
def test_backward_equals_the_reference_code(inputs, stable):
    q, k, v, do = inputs
    preset = "bf16-autocast-stabilized" if stable else "bf16-autocast-train"
    out = replay(q, k, v, ReplayConfig.preset(preset), do=do, causal=True)
    o_ref, lse_ref = paper_forward(q, k, v, stable=stable)
    dq, dk, dv = paper_backward(q, k, v, o_ref, do, lse_ref)
    for got, want in ((out.dq, dq), (out.dk, dk), (out.dv, dv)):
        assert _bits_equal(got, want)
    # the FA2 kernels' fp32 backward (preset bf16-autocast) gives other bits
    fp32_grads = replay(q, k, v, ReplayConfig.preset("bf16-autocast"), do=do, causal=True)
    assert not _bits_equal(fp32_grads.dq, dq) and not _bits_equal(fp32_grads.dk, dk)


@pytest.mark.parametrize("knob,value", [("dp_dtype", "fp32"), ("delta_dtype", "fp32"), ("grad_dtype", "fp32"),
                                        ("ds_alpha", False)])
def test_each_backward_knob_changes_the_gradients(knob, value):
    q, k, v, do = negative_max_inputs(256, 24, seed=8)  # α = 1/sqrt(24) is not a power of two
    cfg = ReplayConfig.preset("bf16-autocast-train").with_(block_m=64, block_n=64)
    base = replay(q, k, v, cfg, do=do, causal=True)
    changed = replay(q, k, v, cfg.with_(**{knob: value}), do=do, causal=True)
    assert any(not torch.equal(a, b) for a, b in ((base.dq, changed.dq), (base.dk, changed.dk), (base.dv, changed.dv)))
    assert torch.equal(base.o, changed.o)
