"""The special function unit model (numerics/sfu.py) against exp2 and log2 results recorded on an H200.

tests/data/sfu_h200/samples.npz holds inputs the tables were not read from (every binade but [-2, -1) and the grid
points is new to them): the model must give the recorded bits for every one.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fa_forensics.numerics import exp2_fp32, sfu

SAMPLES = np.load(Path(__file__).resolve().parents[2] / "data" / "sfu_h200" / "samples.npz")


def _f32(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).copy())


@pytest.mark.parametrize("binade", [-1, 0, 1, 3, 5])
def test_ex2_reproduces_the_recorded_bits(binade):
    x, want = _f32(SAMPLES[f"ex2_x_{binade}"]), _f32(SAMPLES[f"ex2_y_{binade}"])
    got = sfu.ex2_approx(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_ex2_is_not_the_correctly_rounded_exp2():
    """About 30 % of the recorded results differ from 2^x rounded once: a replay that rounds once cannot
    reproduce the kernels' P̄ (the reason this model exists)."""
    x, want = _f32(SAMPLES["ex2_x_0"]), _f32(SAMPLES["ex2_y_0"])
    differ = (exp2_fp32(x).view(torch.int32) != want.view(torch.int32)).double().mean().item()
    assert 0.2 < differ < 0.5


def test_ex2_scales_by_the_integer_part():
    """ex2(x − n) = ex2(x) / 2ⁿ for x in (-1, 0] on the 2⁻¹⁹ grid (so that x − n is exact): the unit works on |x|
    as a fixed-point number."""
    g = torch.Generator().manual_seed(0)
    x = -(torch.randint(0, 1 << 19, (4096,), generator=g).double() * 2.0 ** -19).float()
    for n in (1, 5, 20):
        assert torch.equal(sfu.ex2_approx(x - n), sfu.ex2_approx(x) * 2.0 ** -n)


def test_ex2_special_values():
    x = torch.tensor([0.0, -0.0, float("-inf"), float("inf"), float("nan"), -150.0, -126.5, 130.0])
    got = sfu.ex2_approx(x)
    assert got[:4].tolist() == [1.0, 1.0, 0.0, float("inf")]
    assert torch.isnan(got[4]) and got[5] == 0.0 and got[6] == 0.0 and torch.isinf(got[7])  # ftz: 2^-126.5 -> 0


def test_lg2_reproduces_the_recorded_bits():
    x, want = _f32(SAMPLES["lg2_x"]), _f32(SAMPLES["lg2_y"])
    assert torch.equal(sfu.lg2_approx(x).view(torch.int32), want.view(torch.int32))


def test_lg2_rounds_toward_zero_after_adding_the_exponent():
    """lg2(2^e·m) = RZ(e + lg2(m)): with round-to-nearest instead, about half of [1024, 2048) would differ."""
    x = _f32(SAMPLES["lg2_x"])
    mantissa = (x.view(torch.int32) & 0x7FFFFF | 0x3F800000).view(torch.float32)
    nearest = (10.0 + sfu.lg2_approx(mantissa).double()).float()
    differ = (nearest.view(torch.int32) != _f32(SAMPLES["lg2_y"]).view(torch.int32)).double().mean().item()
    assert 0.3 < differ < 0.7


def test_lg2_and_fast_log_special_values():
    x = torch.tensor([1.0, 2.0, 0.0, -1.0, float("inf"), float("nan"), 1e-40])
    got = sfu.lg2_approx(x)
    assert got[:3].tolist() == [0.0, 1.0, float("-inf")]
    assert (torch.isnan(got[3]) and torch.isinf(got[4]) and got[4] > 0 and torch.isnan(got[5])
            and got[6] == float("-inf"))
    assert torch.equal(sfu.logf_fast(x[:2]), sfu.lg2_approx(x[:2]) * torch.tensor(0.69314718246459960938))
