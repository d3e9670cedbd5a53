"""The compiled kernels (numba) against the torch kernels they replace, bit for bit, and their domain."""
import zlib
import math

import pytest
import torch

from fa_forensics.numerics import matmul, round_to, tensor_core_params
from fa_forensics.numerics import accumulate


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _values(kind: str, shape, fmt: str, g: torch.Generator) -> torch.Tensor:
    """fp32 tensors of `fmt` values of one kind: plain, wide exponent gaps, tiny (subnormal
    products), mostly zeros, full fp32 significands that cancel."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "wide":
        x = x * torch.exp2(torch.randint(-60, 30, shape, generator=g).double())
    elif kind == "tiny":
        x = x * torch.exp2(torch.randint(-140, -60, shape, generator=g).double())
    elif kind == "zeros":
        x = torch.where(torch.rand(*shape, generator=g) < 0.6, 0.0, x)
    elif kind == "cancel":
        x[..., 1::2] = -x[..., 0::2][..., : x[..., 1::2].shape[-1]]
    return round_to(x, fmt).float()


@pytest.mark.parametrize("gpu,fmt", [("h100", "bf16"), ("a100", "fp16"), ("h100", "fp8_e4m3"), ("h100", "fp32")])
@pytest.mark.parametrize("kind", ["normal", "wide", "tiny", "zeros", "cancel"])
def test_compiled_kernels_equal_the_torch_kernels(gpu, fmt, kind):
    g = torch.Generator().manual_seed(zlib.crc32(repr((gpu, fmt, kind)).encode()))
    for (L, M, K, N), with_acc in (((2, 5, 70, 9), False), ((1, 3, 33, 4), True), ((3, 1, 64, 1), True)):
        a = _values(kind, (L, M, K), fmt, g)
        b = _values("normal" if kind != "tiny" else "tiny", (L, K, N), fmt, g)
        acc = _values(kind, (L, M, N), "fp32", g) if with_acc else None
        for model in ("ieee", "tensor-core"):
            got = matmul(a, b, model, gpu=gpu, in_format=fmt, acc=acc)
            want = matmul(a, b, model, gpu=gpu, in_format=fmt, acc=acc, engine="torch")
            assert torch.equal(_bits(got), _bits(want)), (model, L, M, K, N)


def test_compiled_kernels_take_strided_operands_and_leave_the_accumulator_alone():
    g = torch.Generator().manual_seed(4)
    a = round_to(torch.randn(2, 48, 40, generator=g), "bf16").transpose(-1, -2)  # (2, 40, 48) a strided view
    b = round_to(torch.randn(48, 7, generator=g), "bf16")  # broadcast over the lead dimension
    acc = torch.randn(2, 40, 7, generator=g)
    before = acc.clone()
    for model in ("ieee", "tensor-core"):
        got = matmul(a, b, model, acc=acc)
        assert torch.equal(_bits(got), _bits(matmul(a, b, model, acc=acc, engine="torch")))
    assert torch.equal(acc, before)


def test_ieee_kernel_is_one_fused_multiply_add_per_term():
    """fp32 × fp32 products near a power of two whose fp64 sum with the accumulator lands on an fp32
    midpoint: a multiply then an add (or an fp64 sum rounded to fp32) rounds twice and gets it wrong."""
    acc = torch.tensor([[1.0]])
    a = torch.tensor([[641 * 2.0**-10]])
    b = torch.tensor([[6700417 * 2.0**-46]])
    assert matmul(a, b, "ieee", in_format="fp32", acc=acc).item() == 1.0 + 2.0**-23  # exact: 1 + 2^-24 + 2^-56
    assert (acc + a * b).item() == 1.0  # the two-rounding answer


def test_non_finite_and_non_fp32_operands_take_the_torch_kernels(monkeypatch):
    """NaN, inf and fp64 values that are not fp32 numbers are outside the compiled kernels' domain:
    matmul gives exactly the torch kernels' answer for them."""
    from fa_forensics.numerics import accumulate_jit

    calls = []
    original = accumulate_jit.ieee_matmul
    monkeypatch.setattr(accumulate_jit, "ieee_matmul", lambda *args: calls.append(1) or original(*args))
    g = torch.Generator().manual_seed(2)
    b = round_to(torch.randn(6, 3, generator=g), "bf16")
    for bad in (math.inf, math.nan, 1.0 + 2.0**-40):
        a = torch.randn(4, 6, generator=g, dtype=torch.float64).float().double()
        a[1, 2] = bad
        got = matmul(a, b, "ieee", in_format="fp32")
        want = matmul(a, b, "ieee", in_format="fp32", engine="torch")
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert not calls
    matmul(a[:, :0].float(), b[:0], "ieee")  # an empty product is in the domain
    assert calls


def test_unknown_engine_is_a_config_error():
    from fa_forensics.errors import ConfigError

    with pytest.raises(ConfigError, match="engine"):
        matmul(torch.ones(1, 1), torch.ones(1, 1), engine="fast")


def test_tensor_core_groups_cross_k_chunks_like_one_pass():
    """Carrying the accumulator from one K chunk to the next (chunks a multiple of F) is one pass."""
    g = torch.Generator().manual_seed(8)
    a = round_to(torch.randn(5, 96, generator=g) * 4, "bf16")
    b = round_to(torch.randn(96, 6, generator=g), "bf16")
    F = tensor_core_params("h100", "bf16").F
    whole = matmul(a, b, "tensor-core")
    part = matmul(a[:, : 2 * F], b[: 2 * F], "tensor-core")
    assert torch.equal(_bits(matmul(a[:, 2 * F :], b[2 * F :], "tensor-core", acc=part)), _bits(whole))
    assert accumulate.DEFAULT_ENGINE == "auto"


@pytest.mark.parametrize("model", ["ieee", "tensor-core"])
def test_a_band_skips_zero_terms_and_zeroes_unwanted_outputs_without_changing_a_bit(model):
    """Causal attention's products: a[i, k] is zero outside [i + k_lo, i + k_hi) (P̄ of unseen keys,
    the rows before a key); the band's product equals the whole product on every engine, and the
    outputs j ≥ i + n_hi are 0."""
    g = torch.Generator().manual_seed(9)
    L, M, K, N = 2, 37, 45, 40
    rows, cols = torch.arange(M).unsqueeze(-1), torch.arange(K).unsqueeze(0)
    acc = _values("normal", (L, M, N), "fp32", g)
    for band in (accumulate.Band(k_hi=5), accumulate.Band(k_lo=-8), accumulate.Band(k_lo=-3, k_hi=4)):
        inside = (cols >= rows + (band.k_lo if band.k_lo is not None else -K)) & (cols < rows + (band.k_hi or K))
        a = torch.where(inside, _values("normal", (L, M, K), "bf16", g), torch.zeros(()))
        for strided in (False, True):
            a_in = a.transpose(-1, -2).contiguous().transpose(-1, -2) if strided else a
            b = _values("normal", (L, K, N), "bf16", g)
            for start in (None, acc):
                whole = matmul(a_in, b, model, acc=start, engine="torch")
                for engine in ("auto", "torch"):
                    got = matmul(a_in, b, model, acc=start, engine=engine, band=band)
                    assert torch.equal(_bits(got), _bits(whole)), (band, strided, engine)
    b = _values("normal", (L, 8, N), "bf16", g)
    a = _values("normal", (L, M, 8), "bf16", g)
    whole = matmul(a, b, model, engine="torch")
    wanted = torch.arange(N).unsqueeze(0) < rows + 3  # (M, N)
    for engine in ("auto", "torch"):
        got = matmul(a, b, model, engine=engine, band=accumulate.Band(n_hi=3), assume_finite=True)
        assert torch.equal(_bits(got), _bits(torch.where(wanted, whole, torch.zeros(())))), engine
