"""Preset bf16-autocast-cpu: the paper-style pure-PyTorch FlashAttention-2 (tests/data/custom_attention)
run under torch's real CPU bf16 autocast, whose op lists leave exp and sum in bf16 (CUDA's run them
in fp32), is reproduced bit for bit; the CUDA-autocast preset is not."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fa_forensics.replay.api import replay
from fa_forensics.replay.config import ReplayConfig

CUSTOM = Path(__file__).resolve().parents[2] / "data" / "custom_attention"


@pytest.fixture
def blocked_attention(monkeypatch):
    monkeypatch.syspath_prepend(str(CUSTOM))
    from blocked_attention import BlockedAttention

    yield BlockedAttention
    sys.modules.pop("blocked_attention", None)


def _autocast_call(fn, T, block, seed):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(16, 48)
    x = torch.randn(2, T, 16) * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = (t.view(2, T, 2, 8).transpose(1, 2) for t in lin(x).split(16, 2))
        o = fn.apply(q, k, v, None, True, block)
    assert q.dtype == o.dtype == torch.bfloat16
    return q.detach(), k.detach(), v.detach(), o.detach()


def _share_equal(config, q, k, v, o) -> float:
    r = replay(q, k, v, config, causal=True).o.to(o.dtype)
    return float((r.view(torch.int16) == o.view(torch.int16)).float().mean())


@pytest.mark.parametrize("softmax", ["standard", "stabilized"])
@pytest.mark.parametrize("T, block", [(20, 512), (40, 8)])
def test_cpu_autocast_reference_is_reproduced_bit_for_bit(blocked_attention, monkeypatch, softmax, T, block):
    monkeypatch.setenv("TINY_STABLE", "1" if softmax == "stabilized" else "0")
    q, k, v, o = _autocast_call(blocked_attention, T, block, seed=T)
    cpu = ReplayConfig.preset("bf16-autocast-cpu").with_(block_n=block, softmax=softmax)
    assert _share_equal(cpu, q, k, v, o) == 1.0
    cuda = ReplayConfig.preset("bf16-autocast-train").with_(block_n=block, softmax=softmax)
    assert _share_equal(cuda, q, k, v, o) < 0.99  # CUDA autocast's op lists give other bits


def test_triton_backend_refuses_cpu_autocast_exp():
    from fa_forensics.errors import BackendUnsupported
    from fa_forensics.replay.triton.backend import _check_supported

    with pytest.raises(BackendUnsupported, match="exp_dtype=bf16"):
        cpu = ReplayConfig.preset("bf16-autocast-cpu").with_(masked_blocks="skip", row_sum_floor=0.0)
        _check_supported(cpu, backward=False)
