"""matmul / dot_trace: the ieee model bit for bit against exact fmas; the tensor-core model on hand-worked cases."""
import zlib
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
        pairs = [(x, y) for x, y in zip(p[k0:k0 + F], v[k0:k0 + F]) if x != 0 and y != 0]
        terms = [Fraction(x) * Fraction(y) for x, y in pairs] + [acc]
        if not pairs and acc == 0:
            acc = Fraction(0)
            continue
        # a product's exponent is its factors' exponent sum (the significand product in [1, 4) is not
        # renormalized before the alignment); the accumulator's is its own
        exponents = [floor_log2(abs(Fraction(x))) + floor_log2(abs(Fraction(y))) for x, y in pairs]
        exponents += [floor_log2(abs(acc))] if acc != 0 else []
        q = Fraction(2) ** (max(exponents) - 23 - neab)
        total = sum(math.trunc(t / q) for t in terms) * q
        acc = round_fraction(total, "fp32", "toward-zero")
        if neab < 0 and acc != 0:  # the sum keeps 24 + neab significant bits (the H100's fp8 MMA: 14)
            unit = Fraction(2) ** (floor_log2(abs(acc)) - 23 - neab)
            acc = math.trunc(acc / unit) * unit
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
    """Accumulator 2^20 (q = 2^-5): each 0.046875 = 1.5 q keeps one q; exact 2^20 + 0.75, model 2^20 + 0.5,
    ieee 2^20."""
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


# ---------------------------------------------------------------------------------------------
# the fast tile kernels against the fp64 reference steps and the Fraction model, on edge cases


def _reference_matmul(a, b, model, F, neab, acc=None):
    """The plain fp64 algorithm: one `ieee_fma_step` per k, or one `tensor_core_group` per group
    of F, over whole (M, N) matrices. a (M, K), b (K, N) -> fp32 (M, N)."""
    from fa_forensics.numerics.accumulate import ieee_fma_step, lead_pow2, tensor_core_group

    a64, b64 = a.double(), b.double()
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64) if acc is None else acc.double()
    if model == "ieee":
        for k in range(a.shape[1]):
            out = ieee_fma_step(out, a64[:, k : k + 1] * b64[k : k + 1, :])
    else:
        for k0 in range(0, a.shape[1], F):
            prods = a64[:, k0 : k0 + F].T.unsqueeze(-1) * b64[k0 : k0 + F].unsqueeze(1)  # (n, M, N)
            leads = lead_pow2(a64[:, k0 : k0 + F]).T.unsqueeze(-1) * lead_pow2(b64[k0 : k0 + F]).unsqueeze(1)
            out = tensor_core_group(out, prods, neab, leads)
    return out.float()


def _edge_inputs(kind, shape, fmt, g):
    """Values of `fmt` (fp32 tensors) of one kind of trouble."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "wide":  # huge exponent gaps inside a group
        x = x * torch.exp2(torch.randint(-60, 30, shape, generator=g).double())
    elif kind == "tiny":  # products below 2^-100 and subnormal products: the fallback paths
        x = x * torch.exp2(torch.randint(-140, -60, shape, generator=g).double())
    elif kind == "zeros":
        x = torch.where(torch.rand(*shape, generator=g) < 0.6, 0.0, x)
    elif kind == "negative":
        x = -x.abs()
    return round_to(x, fmt).float()


_GPU_FMT = [("h100", "bf16"), ("a100", "bf16"), ("h100", "fp16"), ("h100", "fp8_e4m3"), ("h100", "fp8_e5m2"),
            ("h100", "fp32")]


@pytest.mark.parametrize("gpu,fmt", _GPU_FMT)
@pytest.mark.parametrize("kind", ["normal", "wide", "tiny", "zeros", "negative"])
def test_fast_kernels_equal_the_fp64_reference_bit_for_bit(gpu, fmt, kind):
    g = torch.Generator().manual_seed(zlib.crc32(repr((gpu, fmt, kind)).encode()))
    params = tensor_core_params(gpu, fmt)
    F, neab = (params.F, params.neab) if params else (1, 0)
    for M, K, N, with_acc in ((6, 70, 5, False), (3, 33, 4, True), (1, 40, 1, True)):
        a = _edge_inputs(kind, (M, K), fmt, g)
        b = _edge_inputs("normal" if kind != "negative" else "wide", (K, N), fmt, g)
        acc = _edge_inputs(kind, (M, N), "fp32", g) if with_acc else None
        for model in ("ieee", "tensor-core"):
            ref_model = model if params else "ieee"
            got = matmul(a, b, model, gpu=gpu, in_format=fmt, acc=acc)
            want = _reference_matmul(a, b, ref_model, F, neab, acc)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (model, M, K, N)


def test_cancellation_to_zero_and_exact_ties_match_the_fraction_model():
    """x, −x pairs cancel to +0 in both models; a term equal to the accumulator's half ulp (a tie) too."""
    p = [1.5, 2.0**-3, -1.5, -(2.0**-3)] * 8 + [2.0**-24, 1.0]
    v = [1.0] * 34
    for gpu, F, neab in (("h100", 16, 2), ("a100", 8, 1)):
        got = _dot(p[:32], v[:32], accumulation="tensor-core", gpu=gpu)
        assert got == 0.0 and math.copysign(1.0, got) == 1.0
        assert _dot(p, v, accumulation="tensor-core", gpu=gpu) == _tensor_core_reference(p, v, F, neab)
    assert _dot(p, v, accumulation="ieee") == 1.0  # 2^-24 then 1: exact sum 1 + 2^-24, a tie, rounds to even


def test_fp8_inputs_with_neab_minus_10_match_the_fraction_model():
    g = torch.Generator().manual_seed(11)
    for _ in range(6):
        scale = torch.exp2(torch.randint(-12, 6, (64,), generator=g).double())
        p = round_to(torch.randn(64, generator=g, dtype=torch.float64) * scale, "fp8_e4m3")
        v = round_to(torch.randn(64, generator=g, dtype=torch.float64), "fp8_e4m3")
        want = _tensor_core_reference(p.tolist(), v.tolist(), 32, -10)
        assert _dot(p.tolist(), v.tolist(), accumulation="tensor-core", in_format="fp8_e4m3") == want


def test_subnormal_products_take_a_correct_path():
    """Products below fp32's normal range (2^-140 · 2^-10): the fp32 kernels must not be used blindly."""
    p = [2.0**-140, 2.0**-141, 3 * 2.0**-142] * 6
    v = [2.0**-10, 1.0, 2.0**-3] * 6
    for gpu, F, neab in (("h100", 16, 2), ("a100", 8, 1)):
        assert _dot(p, v, accumulation="tensor-core", gpu=gpu) == _tensor_core_reference(p, v, F, neab)
    want = 0.0
    for x, y in zip(p, v):
        want = fma_fp32(want, x, y)
    assert _dot(p, v, accumulation="ieee") == want


# ---------------------------------------------------------------------------------------------
# the fast exact ieee kernel for fp32 operands (fp32 × bf16, fp32 × fp32): against Fraction fmas


@pytest.fixture
def no_fp64_reference(monkeypatch):
    """Make sure the fp32-operand kernel runs: the fp64 reference tile path raises if reached."""
    from fa_forensics.numerics import accumulate

    def fail(*args, **kwargs):
        raise AssertionError("the fp64 reference path ran; the fp32-operand kernel should have")

    monkeypatch.setattr(accumulate, "_ieee_tile_fp64", fail)


def _fp32_operand(kind, shape, g):
    """fp32 values (full 24-bit significands) of one kind of trouble."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "wide":  # exponent gaps of up to 90 binades between terms
        x = x * torch.exp2(torch.randint(-60, 30, shape, generator=g).double())
    elif kind == "cancel":  # every term followed by its negation, plus a few survivors
        x[..., 1::2, :] = -x[..., 0::2, :][..., : x[..., 1::2, :].shape[-2], :]
        x[..., -1, :] *= 2.0**-30
    elif kind == "tiny":  # sums in fp32's subnormal range
        x = x * torch.exp2(torch.randint(-80, -60, shape, generator=g).double())
    return round_to(x, "fp32").float()


@pytest.mark.parametrize("b_fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["normal", "wide", "cancel", "tiny"])
def test_fp32_operand_kernel_equals_exact_fmas(no_fp64_reference, b_fmt, kind):
    g = torch.Generator().manual_seed(zlib.crc32(repr((b_fmt, kind)).encode()))
    M, K, N = 8, 64, 6
    a = _fp32_operand(kind, (K, M), g).T  # (M, K); 'cancel' pairs consecutive k
    b = round_to(_fp32_operand("normal" if kind != "tiny" else "tiny", (K, N), g).double(), b_fmt).float()
    got = matmul(a, b, "ieee").double()
    assert torch.equal(got, _ieee_reference(a.double(), b.double()))


def _one_fma(acc, a, b):
    """fp32(acc + a·b) through matmul (K = 1 with a starting accumulator)."""
    out = matmul(torch.tensor([[a]], dtype=torch.float64), torch.tensor([[b]], dtype=torch.float64),
                 "ieee", acc=torch.tensor([[acc]], dtype=torch.float32))
    return out.item()


# 2^32 + 1 = 641 · 6700417 and 2^32 − 1 = 65535 · 65537: products of two fp32 numbers within
# 2^-32 of a power of two. Added to an fp32 accumulator, their fp64 sum lands exactly on an fp32
# midpoint while the exact sum does not: converting that sum to fp32 would round the tie to even.
_DOUBLE_ROUNDING_CASES = [
    # acc, a, b, correct fp32 sum; exact sums 1 + 2^-24 ± 2^-56 and 1 + 3·2^-24 ± 2^-56
    (1.0, 641 * 2.0**-10, 6700417 * 2.0**-46, 1.0 + 2.0**-23),  # just above the midpoint: up
    (1.0 + 2.0**-23, 65535 * 2.0**-20, 65537 * 2.0**-36, 1.0 + 2.0**-23),  # just below: down
    (-1.0, -641 * 2.0**-10, 6700417 * 2.0**-46, -(1.0 + 2.0**-23)),  # negative, away from zero
    (-(1.0 + 2.0**-23), 65535 * 2.0**-20, -65537 * 2.0**-36, -(1.0 + 2.0**-23)),
    # fp32 subnormal range: acc = 2^-127 + 2^-148, product 2^-150 + 2^-182 (56-bit exact sum)
    (2.0**-127 + 2.0**-148, 641 * 2.0**-91, 6700417 * 2.0**-91, 2.0**-127 + 2.0**-148 + 2.0**-149),
]


@pytest.mark.parametrize("acc,a,b,want", _DOUBLE_ROUNDING_CASES)
def test_fp64_sum_on_an_fp32_midpoint_is_not_double_rounded(no_fp64_reference, acc, a, b, want):
    assert fma_fp32(acc, a, b) == want  # the Fraction reference agrees with the hand-worked value
    naive = float(torch.tensor(acc, dtype=torch.float64) + a * b)  # fp64 sum, then to fp32 below
    assert torch.tensor(naive).float().item() != want  # the trap is real
    assert _one_fma(acc, a, b) == want


def test_exact_ties_round_to_even(no_fp64_reference):
    """a = 1 + 2^-23 (24 bits) times 1/2: 1 + a/2 = 1.5 + 2^-24 is an exact tie and stays at the
    even 1.5; (1 + 2^-23) + a/2 = 1.5 + 3·2^-24 goes up to the even 1.5 + 2^-22."""
    a = 1.0 + 2.0**-23
    assert _one_fma(1.0, a, 0.5) == fma_fp32(1.0, a, 0.5) == 1.5
    assert _one_fma(1.0 + 2.0**-23, a, 0.5) == fma_fp32(1.0 + 2.0**-23, a, 0.5) == 1.5 + 2.0**-22
    assert _one_fma(-1.0, -a, 0.5) == -1.5


def test_fp32_operand_kernel_tiles_agree(monkeypatch):
    """Tile boundaries (leads grouped, rows split) do not change a bit; the fp64 reference agrees."""
    from fa_forensics.numerics import accumulate

    g = torch.Generator().manual_seed(21)
    a = _fp32_operand("wide", (3, 37, 30), g)
    b = round_to(torch.randn(3, 30, 6, generator=g), "bf16")
    whole = matmul(a, b, "ieee")
    monkeypatch.setattr(accumulate, "_EXACT64_TILE_BYTES", 100)  # two rows per tile
    assert torch.equal(matmul(a, b, "ieee"), whole)
    monkeypatch.setattr(accumulate, "_fp32_valued", lambda x: False)  # force the fp64 reference steps
    assert torch.equal(matmul(a, b, "ieee"), whole)
