"""The tensor-core model against instruction-level outputs measured on A100, H100 and H200 tensor cores
(tests/data/tensor_core_mma: the published validation data of Khattak & Mikaitis, arXiv 2512.07004).

Every published output is reproduced bit for bit: bf16 and fp16 on the A100, H100 and H200, and fp8 (E4M3, E5M2)
on the H100 with the published parameters (F = 32, neab = −10) once the group's sum keeps 24 + neab = 14
significant bits (with fp32's 24: 71.7 % and 83.2 % of the full sets; docs/gpu-fidelity.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fa_forensics.enums import Engine
from fa_forensics.numerics import matmul

DATA = Path(__file__).resolve().parents[2] / "data" / "tensor_core_mma" / "published.safetensors"
FORMATS = {"bf16": "bf16", "fp16": "fp16", "E4M3": "fp8_e4m3", "E5M2": "fp8_e5m2"}
CASES = [("A100", "bf16"), ("A100", "fp16"), ("H100", "bf16"), ("H100", "fp16"), ("H200", "bf16"), ("H100", "E4M3"),
         ("H100", "E5M2")]


def _case(gpu: str, fmt: str):
    with safe_open(str(DATA), "pt") as f:
        layout = json.loads(f.metadata()["layout"])[f"{gpu}.{fmt}"]
        a, b, c, d = (f.get_tensor(f"{gpu}.{fmt}.{n}").float() for n in ("a", "b", "c", "d"))
    assert a.shape == (layout["rows"], layout["K"])
    return a, b, c, d


def _model(a, b, c, gpu: str, fmt: str, **kw) -> torch.Tensor:
    model_gpu = "a100" if gpu == "A100" else "h100"  # the H200 has the H100's tensor cores
    out = matmul(a.unsqueeze(1), b.unsqueeze(2), accumulation="tensor-core", gpu=model_gpu, in_format=FORMATS[fmt],
                 acc=c.view(-1, 1, 1), **kw)
    return out[:, 0, 0]


@pytest.mark.parametrize("gpu,fmt", CASES, ids=[f"{g}-{f}" for g, f in CASES])
def test_the_model_reproduces_the_published_outputs(gpu, fmt):
    a, b, c, d = _case(gpu, fmt)
    for engine in (Engine.COMPILED, Engine.SPEC):
        got = _model(a, b, c, gpu, fmt, engine=engine)
        assert torch.equal(got.view(torch.int32), d.view(torch.int32)), (engine, (got != d).sum())


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_fp8_sums_keep_14_significant_bits(fmt):
    """The H100's fp8 MMA rounds its sum toward zero to 14 significant bits, not fp32's 24: the published
    outputs have at most 14, and a sum that grows past its largest product loses the bits below."""
    a, b, c, d = _case("H100", fmt)
    nonzero = d[d != 0].double().abs()
    unit = torch.exp2(torch.floor(torch.log2(nonzero)) - 13)
    assert torch.equal(torch.remainder(nonzero, unit), torch.zeros_like(nonzero))
    # the published model: terms truncated at 2^(e_max − 13), the sum rounded toward zero to fp32's 24 bits
    a64, b64 = a.double(), b.double()
    lead = lambda x: torch.where(x == 0, -1000.0, torch.floor(torch.log2(x.abs())))  # noqa: E731
    e_max = (lead(a64) + lead(b64)).amax(dim=1, keepdim=True)
    aligned = torch.trunc(a64 * b64 / torch.exp2(e_max - 13)) * torch.exp2(e_max - 13)
    sum24 = aligned.sum(dim=1).float()  # exact: at most 19 significant bits
    assert (sum24 == d).double().mean() < 0.9
    assert torch.equal(_model(a, b, c, "H100", fmt).view(torch.int32), d.view(torch.int32))


@pytest.mark.parametrize("gpu,fmt", [("A100", "fp16"), ("H100", "bf16")])
def test_torch_and_compiled_engines_agree_on_the_published_inputs(gpu, fmt):
    a, b, c, _ = _case(gpu, fmt)
    compiled = _model(a, b, c, gpu, fmt, engine=Engine.COMPILED)
    reference = _model(a, b, c, gpu, fmt, engine=Engine.SPEC)
    assert torch.equal(compiled.view(torch.int32), reference.view(torch.int32))


def test_a_product_is_aligned_by_its_factors_exponents():
    """1.5 · 1.5 = 2.25 has exponent 0 + 0 = 0 for the alignment, not floor(log2 2.25) = 1: as the largest
    term it keeps the bits of weight 2^(0 − 23 − 2) = 2^-25 of the others, so eight terms of 2^-25 add up to
    one fp32 ulp of 2.25 (2^-22); aligned to exponent 1 they would be truncated away."""
    tiny = 2.0**-25
    a = torch.tensor([[1.5] + [tiny] * 8 + [0.0] * 7])
    b = torch.tensor([[1.5]] + [[1.0]] * 15)
    for engine in (Engine.COMPILED, Engine.SPEC):
        out = matmul(a, b, accumulation="tensor-core", gpu="h100", in_format="bf16", engine=engine)
        assert out.item() == 2.25 + 2.0**-22, engine


def test_an_instruction_k_shorter_than_the_group_cuts_the_groups():
    """mma_k = 8 on the H100 (an m16n8k8 MMA): groups of 8 with the H100's alignment width; it is the A100's
    grouping with two more kept bits, and it changes the bits of a 16-term sum."""
    from fa_forensics.numerics.accumulate import tensor_core_params

    assert (tensor_core_params("h100", "bf16", mma_k=8).F, tensor_core_params("h100", "bf16", mma_k=8).neab) == (8, 2)
    assert tensor_core_params("h100", "fp8_e4m3", mma_k=64).F == 32
    a, b, c, _ = _case("H100", "bf16")
    k16 = _model(a, b, c, "H100", "bf16")
    k8 = _model(a, b, c, "H100", "bf16", mma_k=8)
    k8_torch = _model(a, b, c, "H100", "bf16", mma_k=8, engine=Engine.SPEC)
    assert torch.equal(k8.view(torch.int32), k8_torch.view(torch.int32)) and not torch.equal(k8, k16)
