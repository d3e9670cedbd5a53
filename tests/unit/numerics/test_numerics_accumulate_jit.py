"""The compiled kernels (numba) against the torch kernels they replace, bit for bit, and their domain."""
import zlib
import math

import pytest
import torch

from fa_forensics.enums import Engine
from fa_forensics.numerics import matmul, round_to, tensor_core_params
from fa_forensics.numerics.engines import current_engine
from fa_forensics.numerics import accumulate, register_tiles


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
    shapes = (((2, 5, 70, 9), False), ((1, 3, 33, 4), True), ((3, 1, 64, 1), True),
              ((1, 9, 40, 2 * register_tiles.IEEE_COLS + 5), True))  # register tiles, leftover rows and columns
    for (L, M, K, N), with_acc in shapes:
        a = _values(kind, (L, M, K), fmt, g)
        b = _values("normal" if kind != "tiny" else "tiny", (L, K, N), fmt, g)
        acc = _values(kind, (L, M, N), "fp32", g) if with_acc else None
        for model in ("ieee", "tensor-core"):
            got = matmul(a, b, model, gpu=gpu, in_format=fmt, acc=acc)
            want = matmul(a, b, model, gpu=gpu, in_format=fmt, acc=acc, engine=Engine.SPEC)
            assert torch.equal(_bits(got), _bits(want)), (model, L, M, K, N)


def test_compiled_kernels_take_strided_operands_and_leave_the_accumulator_alone():
    g = torch.Generator().manual_seed(4)
    a = round_to(torch.randn(2, 48, 40, generator=g), "bf16").transpose(-1, -2)  # (2, 40, 48) a strided view
    b = round_to(torch.randn(48, 7, generator=g), "bf16")  # broadcast over the lead dimension
    acc = torch.randn(2, 40, 7, generator=g)
    before = acc.clone()
    for model in ("ieee", "tensor-core"):
        got = matmul(a, b, model, acc=acc)
        assert torch.equal(_bits(got), _bits(matmul(a, b, model, acc=acc, engine=Engine.SPEC)))
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
        want = matmul(a, b, "ieee", in_format="fp32", engine=Engine.SPEC)
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
    assert current_engine() is Engine.COMPILED


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
        lo = -K if band.k_lo is None else band.k_lo
        hi = K if band.k_hi is None else band.k_hi
        inside = (cols >= rows + lo) & (cols < rows + hi)
        a = torch.where(inside, _values("normal", (L, M, K), "bf16", g), torch.zeros(()))
        for strided in (False, True):
            a_in = a.transpose(-1, -2).contiguous().transpose(-1, -2) if strided else a
            b = _values("normal", (L, K, N), "bf16", g)
            for start in (None, acc):
                whole = matmul(a_in, b, model, acc=start, engine=Engine.SPEC)
                for engine in Engine:
                    got = matmul(a_in, b, model, acc=start, engine=engine, band=band)
                    assert torch.equal(_bits(got), _bits(whole)), (band, strided, engine)
    b = _values("normal", (L, 8, N), "bf16", g)
    a = _values("normal", (L, M, 8), "bf16", g)
    whole = matmul(a, b, model, engine=Engine.SPEC)
    wanted = torch.arange(N).unsqueeze(0) < rows + 3  # (M, N)
    for engine in Engine:
        got = matmul(a, b, model, engine=engine, band=accumulate.Band(n_hi=3), assume_finite=True)
        assert torch.equal(_bits(got), _bits(torch.where(wanted, whole, torch.zeros(())))), engine


@pytest.mark.parametrize("model", ["ieee", "tensor-core"])
def test_a_band_keeps_the_full_products_sign_of_zero(model):
    """Where a chain is −0 as skipped terms begin (a caller's −0 start before skipped leading
    terms, a tiny negative product rounded to −0 before skipped trailing ones), the full product
    turns it into +0 or keeps it, by the signs of the zero terms; a band must give those bits."""
    g = torch.Generator().manual_seed(13)
    L, M, K, N = 2, 9, 40, 2 * register_tiles.IEEE_COLS + 5
    tiny = torch.tensor(2.0**-80)

    def signed(shape, choices):
        return torch.tensor(choices)[torch.randint(len(choices), shape, generator=g)]

    rows, cols = torch.arange(M).unsqueeze(-1), torch.arange(K).unsqueeze(0)
    for band in (accumulate.Band(k_hi=3), accumulate.Band(k_lo=-2, k_hi=2), accumulate.Band(k_lo=-1, k_hi=20)):
        lo = -K if band.k_lo is None else band.k_lo
        hi = K if band.k_hi is None else band.k_hi
        inside = (cols >= rows + lo) & (cols < rows + hi)
        a = torch.where(inside, signed((L, M, K), (1.0, -1.0, 0.0)) * tiny, signed((L, M, K), (0.0, -0.0)))
        b = signed((L, K, N), (2.0**-80, -2.0**-80, 0.0, -0.0, 1.0, -1.0))  # tiny products underflow to ±0
        for start in (None, signed((L, M, N), (0.0, -0.0))):
            whole = matmul(a, b, model, acc=start, engine=Engine.SPEC)
            got = matmul(a, b, model, acc=start, band=band)
            assert torch.equal(_bits(got), _bits(whole)), (model, band, start is None)
            in_band_only = torch.cat([matmul(a[:, i:i + 1, ks], b[:, ks], model, engine=Engine.SPEC,
                                             acc=None if start is None else start[:, i:i + 1])
                                      for i in range(M) for ks in [slice(max(0, i + (band.k_lo or -K)),
                                                                         i + (band.k_hi or K))]], dim=1)
            flipped = (in_band_only == 0) & torch.signbit(in_band_only) & ~torch.signbit(whole)
            if model == "ieee":  # (the tensor-core model's groups differ in a slice: no such reference)
                assert bool(flipped.any()), "no −0 that the skipped terms turn into +0"


@pytest.mark.parametrize("model", ["ieee", "tensor-core"])
def test_a_band_turns_a_negative_zero_start_into_plus_zero_as_skipped_leading_terms_do(model):
    """A −0 accumulator meets +0 products before the band's first term: the full product is +0
    from there on (ieee: −0 + +0 = +0; tensor-core: a group of zero products sums to +0)."""
    L, M, K, N = 1, 5, 48, 2 * register_tiles.IEEE_COLS + 5  # K: whole groups of 16
    b = torch.ones(L, K, N)
    start = torch.full((L, M, N), -0.0)
    rows, cols = torch.arange(M).unsqueeze(-1), torch.arange(K).unsqueeze(0)
    for k_lo in (20, K):  # the band's terms are −0 products, or there are none
        a = torch.where(cols >= rows + k_lo, -0.0, 0.0).expand(L, M, K).contiguous()
        whole = matmul(a, b, model, acc=start, engine=Engine.SPEC)
        assert not bool(torch.signbit(whole).any())
        got = matmul(a, b, model, acc=start, band=accumulate.Band(k_lo=k_lo))
        assert torch.equal(_bits(got), _bits(whole)), (model, k_lo)


@pytest.mark.slow  # about 3 s of CPU or more
def test_the_avx2_register_tiles_equal_the_torch_kernels(tmp_path):
    """The tile shapes of an AVX2 host, run here in a process of their own."""
    import os
    import subprocess
    import sys

    script = """
import torch
from fa_forensics.enums import Engine
from fa_forensics.numerics import matmul, round_to, register_tiles
from fa_forensics.numerics.accumulate import Band
assert not register_tiles.AVX512 and register_tiles.IEEE_COLS == 16 and register_tiles.TC_ROWS == 2
g = torch.Generator().manual_seed(5)
for L, M, K, N in ((2, 7, 45, 37), (1, 16, 70, 33)):
    scales = torch.exp2(torch.randint(-60, 20, (L, M, K), generator=g).float())
    a = round_to(torch.randn(L, M, K, generator=g) * scales, "bf16")
    b = round_to(torch.randn(L, K, N, generator=g), "bf16")
    acc = torch.randn(L, M, N, generator=g)
    for model in ("ieee", "tensor-core"):
        for start, band in ((None, None), (acc, None), (acc, Band(n_hi=5))):
            got = matmul(a, b, model, acc=start, band=band)
            want = matmul(a, b, model, acc=start, band=band, engine=Engine.SPEC)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (model, L, M, K, N, band)
        t = a.transpose(-1, -2).contiguous().transpose(-1, -2)  # a strided view
        want = matmul(t, b, model, engine=Engine.SPEC)
        assert torch.equal(matmul(t, b, model).view(torch.int32), want.view(torch.int32))
print("ok")
"""
    env = {**os.environ, "FA_FORENSICS_AVX2_TILES": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "bf16"])
def test_a_band_changes_no_bit_even_where_a_row_has_no_term(fmt):
    """Rows whose band holds no term keep the starting accumulator under fp32's 24-bit sums, but the H100's fp8
    MMA cuts it to 14 bits even in a group of zeros: the compiled kernels, which skip zero groups, must still give
    the spec's bits."""
    g = torch.Generator().manual_seed(1)
    M = K = 96
    a = torch.tril(round_to(torch.randn(1, M, K, generator=g, dtype=torch.float64), fmt).float(), diagonal=-90)
    b = round_to(torch.randn(1, K, 8, generator=g, dtype=torch.float64), fmt).float()
    acc = torch.randn(1, M, 8, generator=g) * 3  # full 24-bit significands
    kw = dict(accumulation="tensor-core", gpu="h100", in_format=fmt, acc=acc)
    banded = matmul(a, b, band=accumulate.Band(k_hi=-89), engine="compiled", **kw)
    assert torch.equal(_bits(banded), _bits(matmul(a, b, engine="spec", **kw)))
