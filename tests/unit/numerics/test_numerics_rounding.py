"""round_to against torch's casts, exhaustive fp8 enumeration, toward-zero and stochastic rounding."""
import math

import pytest
import torch

from fa_forensics.errors import ConfigError
from fa_forensics.numerics import FORMATS, from_bits, round_to
from fa_forensics.numerics import rounding
from fa_forensics.numerics.exact import round_fraction
from fractions import Fraction

FP8 = ["fp8_e4m3", "fp8_e5m2"]


def _edge_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(20000, generator=g) * s for s in (1e-40, 1e-20, 1e-7, 1e-3, 1.0, 1e3, 6e4, 1e30)]
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504, 65519, 65520, 65536, 448, 464, 465, 480, 57344, 61439, 61440,
                            3.3895e38, 3.4e38, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-133, 2.0**-134, 1e-45])
    return torch.cat(parts + [special, -special])


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_bit_path_equals_torch_cast_rne(fmt):
    """torch's fp32 -> bf16 / fp16 / fp8 casts are RNE (fp8 after clamping); our bit path agrees everywhere."""
    x = _edge_values()
    spec = FORMATS[fmt]
    ours = rounding.round_bits(x, spec, "nearest-even")
    clamped = x.clamp(-spec.max_value, spec.max_value) if spec.saturates else x
    theirs = clamped.to(spec.torch_dtype).float()
    assert torch.equal(ours, theirs)
    assert torch.equal(rounding.round_bits(x.double(), spec, "nearest-even").float(), theirs)  # fp64 input too


def test_torch_fp8_casts_overflow_behaviour_is_what_we_document():
    """torch 2.13: float8_e4m3fn saturates (no inf in the format), float8_e5m2 overflows to inf; round_to saturates
    both."""
    big = torch.tensor([1000.0, float("inf")])
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()
    assert round_to(big, "fp8_e4m3").tolist() == [448.0, 448.0]
    assert round_to(-big * 1000, "fp8_e5m2").tolist() == [-57344.0, -57344.0]
    assert round_to(torch.tensor([float("nan")]), "fp8_e4m3").isnan().all()


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("mode", ["nearest-even", "toward-zero"])
def test_fp8_exhaustive_codes_and_midpoints(fmt, mode):
    """All 256 codes round to themselves; every midpoint and quarter point matches exact rational rounding."""
    spec = FORMATS[fmt]
    codes = from_bits(torch.arange(256), spec).double()
    finite = torch.sort(torch.unique(codes[torch.isfinite(codes)])).values
    assert torch.equal(round_to(finite, spec, mode), finite)
    lo, hi = finite[:-1], finite[1:]
    probes = torch.cat([(lo + hi) / 2, lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4, finite * 1.0001,
                        torch.tensor([spec.max_value * 1.03, spec.max_value * 3])])
    got = round_to(probes, spec, mode)
    want = torch.tensor([float(round_fraction(Fraction(v), spec, mode)) for v in probes.tolist()], dtype=torch.float64)
    assert torch.equal(got, want)


def test_nearest_even_ties_and_subnormals_in_bf16():
    one = 1.0
    ulp = 2.0**-7
    x = torch.tensor([one + ulp / 2, one + 3 * ulp / 2, -(one + ulp / 2), 2.0**-133 * 1.5, 2.0**-134,
                      2.0**-134 * 1.0000001], dtype=torch.float64)
    want = [one, one + 2 * ulp, -one, 2.0**-132, 0.0, 2.0**-133]
    assert round_to(x, "bf16").tolist() == want


def test_toward_zero_truncates_magnitude_and_clamps_overflow():
    x = torch.tensor([1.0 + 2.0**-8 * 1.99, -(1.0 + 2.0**-8 * 1.99), 3.4e38, -3.4e38, float("inf")])
    y = round_to(x, "bf16", "toward-zero")
    bmax = FORMATS["bf16"].max_value
    # 1 + 1.99 * 2^-8 = 1.00777..., just below 1 + 2^-7: toward zero gives 1.0, nearest gives 1.0078125
    assert y[0].item() == 1.0 and y[1].item() == -1.0
    assert round_to(x[:2], "bf16").tolist() == [1.0078125, -1.0078125]
    assert y[2].item() == bmax and y[3].item() == -bmax and math.isinf(y[4].item())


@pytest.mark.parametrize("x0", [1.0 + 2.0**-9, -(1.0 + 3 * 2.0**-10), 0.3])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(x0):
    n = 200_000
    x = torch.full((n,), x0, dtype=torch.float32)
    g = torch.Generator().manual_seed(1234)
    y = round_to(x, "bf16", "stochastic", generator=g).double()
    lo = round_to(x[:1], "bf16", "toward-zero").item()
    step = 2.0 ** (math.floor(math.log2(abs(x0))) - 7)
    hi = lo + math.copysign(step, x0)
    assert set(torch.unique(y).tolist()) <= {lo, hi}
    se = y.std().item() / math.sqrt(n)
    assert abs(y.mean().item() - float(x[0])) < 4 * se + 1e-12  # unbiased within 4 standard errors
    # and it is really random: both neighbours occur when x0 is not representable
    assert len(torch.unique(y)) == 2
    # seeded: same generator seed, same draws
    g2 = torch.Generator().manual_seed(1234)
    assert torch.equal(round_to(x, "bf16", "stochastic", generator=g2).double(), y)


def test_round_to_keeps_dtype_and_accepts_precision_enum():
    from fa_forensics.enums import Precision

    x = torch.randn(10, dtype=torch.float64)
    assert round_to(x, Precision.BF16).dtype == torch.float64
    assert round_to(x.float(), "fp16").dtype == torch.float32
    with pytest.raises(ConfigError, match="unknown float format 'fp7'"):
        round_to(x, "fp7")
