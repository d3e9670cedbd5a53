"""The emulator streams heads and query-row blocks: the bits do not depend on how the work is cut,
nor on which engine (compiled or the torch specification) computes."""
import pytest
import torch

from fa_forensics.enums import Engine
from fa_forensics.replay import ReplayConfig
from fa_forensics.replay.emulate.backward import backward
from fa_forensics.replay.emulate.run import StreamPlan, emulate_replay

_FIELDS = ("o", "lse", "delta", "dq", "dk", "dv")
_STATS = ("repeated_max_rows", "p_one_count", "stabilized_rows", "p_zeroed", "rows")


def _inputs(B=2, H=3, T=70, D=16, spread=6.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) * (spread if i < 2 else 1.0) for i in range(4))
    return [x.to(torch.bfloat16) for x in (q, k, v, do)]


def _assert_same(a, b):
    for f in _FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), f
    for f in _STATS:
        assert torch.equal(getattr(a.stats, f), getattr(b.stats, f)), f


_CASES = [  # (preset, accumulation, delta, causal)
    ("bf16", "ieee", "o-lowp", True),
    ("bf16", "tensor-core", "dp-p", False),
    ("bf16-hw", "tensor-core", "o-highp", True),
    ("bf16-autocast", "ieee", "o-recomputed", True),
    ("stabilized", "ieee", "o-lowp", False),
    ("fp8-s448", "tensor-core", "o-lowp", True),
    ("fp32", "ieee", "o-highp", True),
]


@pytest.mark.parametrize("preset,acc,delta,causal", _CASES)
def test_streamed_replay_equals_one_pass_bit_for_bit(preset, acc, delta, causal):
    q, k, v, do = _inputs()
    cfg = ReplayConfig.preset(preset).with_(accumulation=acc, delta=delta)
    one_pass = emulate_replay(q, k, v, cfg, do, causal=causal, scale=0.25, plan=StreamPlan(heads=3, block_m=None))
    for plan in (StreamPlan(heads=1, block_m=32), StreamPlan(heads=2, block_m=64)):
        _assert_same(emulate_replay(q, k, v, cfg, do, causal=causal, scale=0.25, plan=plan), one_pass)


@pytest.mark.parametrize("preset,acc,delta,causal", _CASES[:4])
def test_compiled_engine_equals_the_spec_in_a_whole_replay(preset, acc, delta, causal):
    q, k, v, do = _inputs(B=1, H=2, T=48, seed=1)
    cfg = ReplayConfig.preset(preset).with_(accumulation=acc, delta=delta)
    compiled = emulate_replay(q, k, v, cfg, do, causal=causal, scale=0.25, engine=Engine.COMPILED)
    _assert_same(emulate_replay(q, k, v, cfg, do, causal=causal, scale=0.25, engine=Engine.SPEC), compiled)


def test_stochastic_rounding_runs_as_one_pass_whatever_the_plan():
    q, k, v, do = _inputs(T=40)
    cfg = ReplayConfig.preset("stochastic")
    one_pass = emulate_replay(q, k, v, cfg, do, causal=True, scale=0.25, plan=StreamPlan(heads=3, block_m=None))
    _assert_same(emulate_replay(q, k, v, cfg, do, causal=True, scale=0.25, plan=StreamPlan(heads=1, block_m=32)),
                 one_pass)


def test_plan_keeps_the_largest_temporary_within_the_budget():
    assert StreamPlan.for_shape(H=12, T=1024, n_keys=1024, budget=2**21) == StreamPlan(heads=2, block_m=None)
    plan = StreamPlan.for_shape(H=32, T=8192, n_keys=8192, budget=2**21)
    assert plan == StreamPlan(heads=1, block_m=256) and plan.block_m * 8192 <= 2**21
    assert StreamPlan.for_shape(H=4, T=100_000, n_keys=100_000, budget=2**21).block_m == 32  # never below one group
    assert list(StreamPlan(heads=2, block_m=None).items(B=2, H=3)) == [(0, slice(0, 2)), (0, slice(2, 3)),
                                                                       (1, slice(0, 2)), (1, slice(2, 3))]


def test_backward_refuses_row_blocks_that_split_a_tensor_core_group():
    q, k, v, do = (x.float() for x in _inputs(B=1, H=1, T=40))
    with pytest.raises(ValueError, match="multiple of 32"):
        backward(q, k, v, do, torch.zeros(1, 1, 40), ReplayConfig(), causal=True, scale=0.25, o_for_delta=q, block_m=20)
