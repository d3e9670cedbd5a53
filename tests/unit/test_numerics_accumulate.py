"""matmul / dot_trace: the ieee model bit for bit against exact fmas; the tensor-core model on hand-worked cases."""
import math
from fractions import Fraction

import pytest
import torch

from fa_forensics.numerics import dot_trace, matmul, round_to, tensor_core_params
from fa_forensics.numerics.exact import floor_log2, fma_fp32, round_fraction


def _dot(p, v, **kw):
    """One dot product through matmul: p (K,), v (K,) -> float."""
    a = torch.tensor([p], dtype=torch.float64)  # (1, K)
    b = torch.tensor(v, dtype=torch.float64).unsqueeze(-1)  # (K, 1)
    return matmul(a, b, **kw)[0, 0].item()


def _ieee_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty(M, N, dtype=torch.float64)
    for i in range(M):
        for j in range(N):
            acc = 0.0
            for k in range(K):
                acc = fma_fp32(acc, a[i, k].item(), b[k, j].item())
            out[i, j] = acc
    return out


def _tensor_core_reference(p, v, F, neab):
    acc = Fraction(0)
    for k0 in range(0, len(p), F):
        terms = [Fraction(x) * Fraction(y) for x, y in zip(p[k0:k0 + F], v[k0:k0 + F])] + [acc]
        top = max(abs(t) for t in terms)
        if top == 0:
            acc = Fraction(0)
            continue
        q = Fraction(2) ** (floor_log2(top) - 23 - neab)
        total = sum(math.trunc(t / q) for t in terms) * q
        acc = round_fraction(total, "fp32", "toward-zero")
    return float(acc)


@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_ieee_matmul_equals_exact_fma_loop_bit_for_bit(fmt):
    g = torch.Generator().manual_seed(7)
    scale = torch.exp2(torch.randint(-6, 7, (3, 24), generator=g).double())
    a = round_to(torch.randn(3, 24, generator=g, dtype=torch.float64) * scale, fmt)
    b = round_to(torch.randn(24, 4, generator=g, dtype=torch.float64), fmt)
    got = matmul(a, b, "ieee", in_format=fmt).double()
    assert torch.equal(got, _ieee_reference(a, b))


def test_tensor_core_matmul_equals_fraction_model():
    g = torch.Generator().manual_seed(3)
    scale = torch.exp2(torch.randint(-20, 8, (40,), generator=g).double())
    p = round_to(torch.randn(40, generator=g, dtype=torch.float64) * scale, "bf16")
    v = round_to(torch.randn(40, generator=g, dtype=torch.float64), "bf16")
    for gpu, F, neab in (("h100", 16, 2), ("a100", 8, 1)):
        want = _tensor_core_reference(p.tolist(), v.tolist(), F, neab)
        assert _dot(p.tolist(), v.tolist(), accumulation="tensor-core", gpu=gpu) == want


def test_small_integers_are_exact_in_both_models():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (2, 5, 64), generator=g).float()
    b = torch.randint(-8, 9, (2, 64, 6), generator=g).float()
    exact = (a.double() @ b.double()).float()
    assert torch.equal(matmul(a, b, "ieee"), exact)
    assert torch.equal(matmul(a, b, "tensor-core"), exact)
    assert torch.equal(matmul(a, b, "tensor-core", gpu="a100"), exact)


def test_alignment_loss_truncates_small_products_below_the_kept_bits():
    """H100 bf16 keeps 26 bits below e_max = 10: 15 products of 2^-17 vanish; ieee keeps their sum (one ulp)."""
    p = [2.0**-17] * 15 + [2.0**10]
    v = [1.0] * 16
    assert _dot(p, v, accumulation="tensor-core") == 2.0**10
    assert _dot(p, v, accumulation="ieee") == 2.0**10 + 2.0**-13  # 15·2^-17 rounds up to one fp32 ulp


def test_round_toward_zero_at_normalization_where_ieee_rounds_up():
    """1 + 7·2^-25 = 1 + 1.75 ulp: kept exactly in the group, then RZ to 1 + 2^-23; ieee rounds to 1 + 2^-22."""
    p, v = [1.0, 7 * 2.0**-25], [1.0, 1.0]
    assert _dot(p, v, accumulation="tensor-core") == 1.0 + 2.0**-23
    assert _dot(p, v, accumulation="ieee") == 1.0 + 2.0**-22


def test_truncation_within_a_group_loses_part_of_each_small_product():
    """Accumulator 2^20 (q = 2^-5): each 0.046875 = 1.5 q keeps one q; exact 2^20 + 0.75, model 2^20 + 0.5, ieee 2^20."""
    a = torch.full((1, 16), 0.046875)
    b = torch.ones(16, 1)
    acc = torch.full((1, 1), 2.0**20)
    assert matmul(a, b, "tensor-core", acc=acc).item() == 2.0**20 + 0.5
    assert matmul(a, b, "ieee", acc=acc).item() == 2.0**20  # every add is below half an fp32 ulp


def test_fp8_accumulator_loses_bits_an_fp32_accumulator_keeps():
    """H100 fp8: neab = -10 keeps 14 bits (q = 2^-13 at 1.0): 31 products 2^-15 vanish; bf16 (26 bits) keeps them."""
    p = [1.0] + [2.0**-9] * 31
    v = [1.0] + [2.0**-6] * 31
    assert tensor_core_params("h100", "fp8_e4m3").neab == -10
    assert _dot(p, v, accumulation="tensor-core", in_format="fp8_e4m3") == 1.0
    assert _dot(p, v, accumulation="tensor-core", in_format="bf16") == 1.0 + 31 * 2.0**-15
    assert _dot(p, v, accumulation="ieee", in_format="fp8_e4m3") == 1.0 + 31 * 2.0**-15


def test_grouping_decides_what_survives():
    """Same 32 numbers: small terms grouped with 2^10 vanish; grouped alone they sum to 2^-12 first and survive."""
    big, small = 2.0**10, 2.0**-16
    mixed = [big] + [small] * 31  # group 1: big + 15 small (truncated); group 2: 16 small vs acc 2^10 (truncated)
    apart = [small] * 16 + [big] + [small] * 15  # group 1: 16 small = 2^-12 exactly; group 2 keeps it
    ones = [1.0] * 32
    assert _dot(mixed, ones, accumulation="tensor-core") == big
    assert _dot(apart, ones, accumulation="tensor-core") == big + 2.0**-12


def test_dot_trace_matches_matmul_and_is_constant_within_groups():
    g = torch.Generator().manual_seed(5)
    p = round_to(torch.rand(40, generator=g), "bf16")
    v = round_to(torch.randn(40, generator=g), "bf16")
    ieee = dot_trace(p, v)
    assert ieee[-1].item() == _dot(p.tolist(), v.tolist())
    assert ieee[0].item() == (p[0] * v[0]).item()
    tc = dot_trace(p, v, "tensor-core")
    assert tc[-1].item() == _dot(p.tolist(), v.tolist(), accumulation="tensor-core")
    assert torch.equal(tc[:16], tc[15].expand(16)) and torch.equal(tc[32:], tc[39].expand(8))


def test_matmul_broadcasts_batch_dims_and_chunks_rows(monkeypatch):
    from fa_forensics.numerics import accumulate

    g = torch.Generator().manual_seed(9)
    a = round_to(torch.randn(2, 3, 33, 20, generator=g), "bf16")
    b = round_to(torch.randn(20, 7, generator=g), "bf16")
    whole = {m: matmul(a, b, m) for m in ("ieee", "tensor-core")}
    monkeypatch.setattr(accumulate, "_CHUNK_BYTES", 1)  # one row per chunk
    for m, out in whole.items():
        assert out.shape == (2, 3, 33, 7)
        assert torch.equal(matmul(a, b, m), out)
    assert (whole["ieee"].double() - a.double() @ b.double()).abs().max() < 1e-5
