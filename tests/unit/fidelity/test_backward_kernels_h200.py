"""The backward kernel models against gradients recorded on an H200 (tests/data/h200_bits, tests/data/h200_bwd).

Each model recomputes what the kernel wrote from the recorded inputs and the kernel's own O and lse, on the rows
the fixtures keep: dQ of the last query rows (they read every key block), dK and dV of keys 768..831 of the gpt2
set (rows 768..1023, every row that sees them: two query tiles of 128, four of 64). The shares asserted are the
measured ones rounded down (docs/gpu-fidelity.md has the full-size table); the exponentials' last bit (the GPU's
MUFU approximation against a correctly rounded exp) is what keeps some below 100 %.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fa_forensics.replay import ReplayConfig
from fa_forensics.replay.emulate.backward_kernels import kernel_backward
from fa_forensics.replay.gpu_fidelity import read_tensors

DATA = Path(__file__).resolve().parents[2] / "data"
KERNELS = {"cudnn": "sdpa-cudnn", "efficient": "sdpa-efficient", "flash": "flash-attention-2"}
PRESETS = {"cudnn": "sdpa-cudnn-sm90", "efficient": "sdpa-efficient", "flash": "sdpa-flash"}  # forward and backward


def _load(path: Path) -> tuple[dict, dict]:
    tensors, metadata = read_tensors(path)
    return tensors, json.loads(metadata["layout"])


def _config(kernel: str, dtype: torch.dtype) -> ReplayConfig:
    """The kernel's preset (its forward and backward model) for this input dtype."""
    config = ReplayConfig.preset(PRESETS[kernel] + ("-fp16" if dtype == torch.float16 else ""))
    assert config.backward_kernel.value == KERNELS[kernel]
    return config


def _share(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() == b.float()).float().mean().item()


def _dq_share(tag: str, kernel: str, model: str | None = None, **changes) -> float:
    t, layout = _load(DATA / "h200_bits" / f"{tag}.safetensors.xz")
    r0, r1 = layout["dq_rows"]
    assert layout["o_rows"] == [r0, r1]
    g = lambda name: t[f"{tag}.{name}"].float()  # noqa: E731
    q, k, v, do = g("q"), g("k"), g("v"), g("do")
    cfg = _config(model or kernel, t[f"{tag}.q"].dtype).with_(**changes)
    _, dq, _, _ = kernel_backward(q[..., r0:r1, :], k, v, do[..., r0:r1, :], g(f"{kernel}.o"), g(f"{kernel}.lse"),
                                  cfg, causal=True, scale=layout["scale"], row0=r0)
    return _share(dq, t[f"{tag}.{kernel}.dq"])


# (tag, kernel) -> measured share of bit-identical dQ elements, rounded down
DQ_FLOORS = {
    ("gpt2", "cudnn"): 1.0, ("gpt2", "efficient"): 1.0, ("gpt2", "flash"): 1.0,
    ("ties", "cudnn"): 1.0, ("ties", "efficient"): 1.0, ("ties", "flash"): 1.0,
    ("d128", "cudnn"): 1.0, ("d128", "efficient"): 1.0, ("d128", "flash"): 0.999,
    ("fp16", "cudnn"): 1.0, ("fp16", "efficient"): 1.0, ("fp16", "flash"): 1.0,
}


@pytest.mark.parametrize("tag,kernel", sorted(DQ_FLOORS), ids=[f"{t}-{k}" for t, k in sorted(DQ_FLOORS)])
def test_dq_reproduces_the_recorded_bits(tag, kernel):
    assert _dq_share(tag, kernel) >= DQ_FLOORS[tag, kernel]


@pytest.mark.parametrize("kernel,other", [("cudnn", "flash"), ("efficient", "cudnn"), ("flash", "efficient")])
def test_dq_tells_the_kernels_apart(kernel, other):
    """On a head dim whose scale is not a power of two, another kernel's model misses most of dQ: the models
    are not interchangeable, and the fixture can tell them apart."""
    assert _dq_share("d128", kernel, model=other) < 0.9 <= _dq_share("d128", kernel)


def test_the_efficient_kernel_needs_its_k8_instruction(monkeypatch):
    """The memory-efficient kernel issues mma.sync m16n8k8 (8 products per instruction): with the tensor core's
    own 16-term groups its model loses bits that the 8-term groups reproduce. Its preset carries mma_k 8; a
    config without mma_k still gets the kernel's own 8 in its backward."""
    import dataclasses

    from fa_forensics.enums import BackwardKernel
    from fa_forensics.replay.emulate import backward_kernels

    assert _dq_share("fp16", "efficient") == 1.0
    assert _dq_share("fp16", "efficient", mma_k=None) == 1.0
    assert _dq_share("fp16", "efficient", mma_k=16) < 0.999
    model = backward_kernels.MODELS[BackwardKernel.SDPA_EFFICIENT]
    monkeypatch.setitem(backward_kernels.MODELS, BackwardKernel.SDPA_EFFICIENT, dataclasses.replace(model, mma_k=None))
    assert _dq_share("fp16", "efficient", mma_k=None) < 0.999


def _dkdv(kernel: str):
    t, layout = _load(DATA / "h200_bits" / "gpt2.safetensors.xz")
    extra, extra_layout = _load(DATA / "h200_bwd" / "gpt2_keys768.safetensors.xz")
    (r0, r_mid), (k0, k1) = extra_layout["o_rows"], extra_layout["dkdv_keys"]
    assert r_mid == layout["o_rows"][0] and layout["o_rows"][1] == layout["T"]  # rows r0 .. T-1 are all there
    g = lambda name: t[f"gpt2.{name}"].float()  # noqa: E731
    o = torch.cat([extra[f"gpt2.{kernel}.o"].float(), g(f"{kernel}.o")], dim=-2)
    lse = torch.cat([extra[f"gpt2.{kernel}.lse"].float(), g(f"{kernel}.lse")], dim=-1)
    q, k, v, do = g("q"), g("k"), g("v"), g("do")
    _, _, dk, dv = kernel_backward(q[..., r0:, :], k, v, do[..., r0:, :], o, lse, _config(kernel, torch.bfloat16),
                                   causal=True, scale=layout["scale"], row0=r0)
    return (_share(dk[..., k0:k1, :], extra[f"gpt2.{kernel}.dk"]),
            _share(dv[..., k0:k1, :], extra[f"gpt2.{kernel}.dv"]))


DKDV_FLOORS = {"cudnn": (1.0, 1.0), "efficient": (1.0, 1.0), "flash": (1.0, 1.0)}


@pytest.mark.parametrize("kernel", sorted(DKDV_FLOORS))
def test_dk_dv_reproduce_the_recorded_bits(kernel):
    dk, dv = _dkdv(kernel)
    assert dk >= DKDV_FLOORS[kernel][0] and dv >= DKDV_FLOORS[kernel][1], (dk, dv)


def _small_inputs(T=80, D=32):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(1, 2, T, D, generator=g) for _ in range(4)]


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=pytest.mark.slow) if k == "flash-attention-2" else k
                                    for k in sorted(KERNELS.values())])  # flash-attention-2: about 3 s of CPU or more
def test_replay_runs_the_kernel_backward_on_its_own_forward(kernel):
    """replay(..., dO) with backward_kernel set: the named kernel's backward on the replay's own O and lse, whose
    gradients are what the kernel writes (input-dtype values), not the reference contract's fp32 ones."""
    from fa_forensics.replay import replay

    q, k, v, do = _small_inputs()
    cfg = ReplayConfig.preset("bf16-hw").with_(backward_kernel=kernel)
    out = replay(q, k, v, cfg, do, causal=True)
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    _, dq, dk, dv = kernel_backward(*(bf(x) for x in (q, k, v, do)), out.o.float(), out.lse, cfg, causal=True,
                                    scale=32 ** -0.5)
    assert torch.equal(out.dq, dq) and torch.equal(out.dk, dk) and torch.equal(out.dv, dv)
    assert torch.equal(bf(out.dq), out.dq) and out.dq.abs().sum() > 0
    reference = replay(q, k, v, cfg.with_(backward_kernel="reference"), do, causal=True)
    assert not torch.equal(reference.dq, out.dq)


def test_an_attn_mask_is_refused_in_one_line():
    from fa_forensics.errors import UserError
    from fa_forensics.replay import replay

    q, k, v, do = _small_inputs(T=32)
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    with pytest.raises(UserError, match="attn_mask; use backward_kernel=reference"):
        replay(q, k, v, ReplayConfig.preset("bf16-hw").with_(backward_kernel="sdpa-cudnn"), do, causal=False, mask=mask)


def test_row_delta_reduction_orders():
    """δ's reduction order: sequential per thread, then the butterfly; FA2's descending offsets and the
    xformers kernel's ascending ones are different trees (and neither is the plain sequential sum)."""
    from fa_forensics.replay.emulate.backward_kernels import row_delta

    g = torch.Generator().manual_seed(0)
    do, o = (torch.randn(4096, 64, generator=g).to(torch.bfloat16).float() for _ in range(2))
    seq = row_delta(do, o, 1, True)
    for r in range(4):  # one thread: every product added in column order, one fp32 rounding each
        acc = torch.tensor(0.0)
        for c in range(64):
            acc = acc + do[r, c] * o[r, c]
        assert seq[r] == acc
    desc, asc = row_delta(do, o, 8, True), row_delta(do, o, 8, False)
    exact = (do.double() * o.double()).sum(-1)
    for x in (seq, desc, asc):
        assert ((x.double() - exact).abs() <= 64 * 2**-23 * (do.double() * o.double()).abs().sum(-1)).all()
    assert not torch.equal(desc, asc) and not torch.equal(desc, seq)


@pytest.mark.parametrize("kernel", sorted(KERNELS.values()))
@pytest.mark.parametrize("causal", [True, False])
def test_the_gradients_are_attentions_gradients(kernel, causal):
    """Whatever their rounding, the models compute attention's gradients: within bf16 noise of fp64 autograd
    (causal or not, T not a multiple of any tile)."""
    q, k, v, do = (x.to(torch.bfloat16).float() for x in _small_inputs(T=80, D=32))
    scale = 32 ** -0.5
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(80, 80, dtype=torch.bool).triu(1), float("-inf"))
    o64 = torch.softmax(s, dim=-1) @ v64
    o64.backward(do.double())
    lse = torch.logsumexp(s.detach(), dim=-1).float()
    o = o64.detach().to(torch.bfloat16).float()
    cfg = ReplayConfig.preset("bf16-hw").with_(backward_kernel=kernel)
    _, dq, dk, dv = kernel_backward(q, k, v, do, o, lse, cfg, causal=causal, scale=scale)
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()


def test_only_16_bit_inputs_are_modelled():
    from fa_forensics.errors import UserError

    q, k, v, do = _small_inputs(T=16)
    cfg = ReplayConfig.preset("fp32").with_(backward_kernel="sdpa-cudnn")
    with pytest.raises(UserError, match="bf16 or fp16 inputs"):
        kernel_backward(q, k, v, do, q, torch.zeros(1, 2, 16), cfg, causal=True, scale=0.25)
