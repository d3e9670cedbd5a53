"""The replay entry point: argument checks, backend dispatch, result types."""
import dataclasses
import importlib.util

import pytest
import torch

from fa_forensics.errors import ConfigError, UserError
from fa_forensics.replay import PBarStats, ReplayConfig, ReplayOut, replay

CFG = ReplayConfig.preset("bf16")


def _qkv(B=2, H=3, T=8, D=4):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, T, D, generator=g) for _ in range(4))


def test_result_types_shapes_and_dtypes():
    q, k, v, do = _qkv()
    fwd = replay(q, k, v, CFG)
    assert isinstance(fwd, ReplayOut) and isinstance(fwd.stats, PBarStats)
    assert fwd.o.shape == (2, 3, 8, 4) and fwd.o.dtype == torch.bfloat16
    assert fwd.lse.shape == (2, 3, 8) and fwd.lse.dtype == torch.float32
    assert fwd.delta is None and fwd.dq is None and not fwd.has_backward
    assert fwd.backend == "emulate" and fwd.accumulation == "ieee" and fwd.config is CFG
    for name in ("repeated_max_rows", "p_one_count", "stabilized_rows", "p_zeroed", "rows"):
        t = getattr(fwd.stats, name)
        assert t.shape == (2, 3) and t.dtype == torch.int64
    assert int(fwd.stats.rows.sum()) == 2 * 3 * 8 == fwd.stats.total()["rows"]
    bwd = replay(q, k, v, CFG, do=do)
    assert bwd.delta.shape == (2, 3, 8)
    assert all(x.shape == q.shape and x.dtype == torch.float32 for x in (bwd.dq, bwd.dk, bwd.dv))
    assert torch.equal(bwd.o, fwd.o)  # the backward does not change the forward
    with pytest.raises(dataclasses.FrozenInstanceError):
        fwd.o = None


def test_inputs_of_any_float_dtype_and_strings_in_config():
    q, k, v, _ = _qkv()
    a = replay(q, k, v, CFG)
    b = replay(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), CFG)
    assert torch.equal(a.o, b.o)
    c = replay(q, k, v, ReplayConfig(accumulation="tensor-core", softmax="stabilized"))
    assert c.accumulation == "tensor-core"


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v, do: (q[0], k, v, None), "q must be a floating"),
        (lambda q, k, v, do: (q, k[..., :3], v, None), "shapes do not match"),
        (lambda q, k, v, do: (q, k, v, do[..., :5, :]), "do .* must have the shape of q"),
        (lambda q, k, v, do: (q.long(), k, v, None), "q must be a floating"),
    ],
)
def test_bad_inputs_raise_one_line_config_errors(mutate, match):
    q, k, v, do = mutate(*_qkv())
    with pytest.raises(ConfigError, match=match) as info:
        replay(q, k, v, CFG, do=do)
    assert "\n" not in str(info.value)


def test_causal_needs_square_attention_and_noncausal_does_not():
    q, k, v, _ = _qkv()
    k2, v2 = torch.cat([k, k], dim=2), torch.cat([v, v], dim=2)
    with pytest.raises(ConfigError, match="causal"):
        replay(q, k2, v2, CFG)
    out = replay(q, k2, v2, CFG, causal=False)
    assert out.o.shape == q.shape


def test_unknown_backend_and_config_errors():
    q, k, v, _ = _qkv()
    with pytest.raises(ConfigError, match="unknown backend"):
        replay(q, k, v, CFG, backend="cuda")
    with pytest.raises(ConfigError, match="must be a ReplayConfig"):
        replay(q, k, v, "bf16")
    with pytest.raises(ConfigError, match="scale"):
        replay(q, k, v, CFG, scale=-1.0)
    with pytest.raises(ConfigError, match="not one of"):
        ReplayConfig(delta="o-bogus")


@pytest.mark.skipif(importlib.util.find_spec("fa_forensics.replay.triton") is not None and torch.cuda.is_available(),
                    reason="the triton backend can run here")
def test_triton_backend_without_gpu_is_a_user_error_not_a_traceback(monkeypatch):
    # tests/triton's conftest sets TRITON_INTERPRET=1 for the whole worker process; without it
    # and without CUDA, the triton backend must refuse in one line
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, _ = _qkv()
    with pytest.raises(UserError):
        replay(q, k, v, CFG, backend="triton")
