"""The GPU's special function unit on sm_90 (H100, H200): 2^x as `ex2.approx.ftz.f32` and log2 as
`lg2.approx.ftz.f32` compute them, and `__logf`, the fast log kernels take of the row sum.

Flash-attention kernels form P̄ with `exp2f` / `ex2.approx`, which compile to one MUFU.EX2 instruction: an
approximation within 2 ulp of 2^x, not the correctly rounded value (`numerics.exp2_fp32`). Tabulated on an
H200 over every fp32 x in [-128, 0] (benchmarks/gpu_special_functions.cu), the unit behaves exactly as:

    |x|·2²³ truncated to an integer X;  n = X >> 23,  f = X mod 2²³;   ex2(x) = 2^∓n · T±[f]

with T-[f] = ex2(-f·2⁻²³) and T+[f] = ex2(+f·2⁻²³) two tables of 2²³ entries, and results below 2⁻¹²⁶ flushed to
0 (ftz). `exp2f` of CUDA's math library gave the same bits on every input whose result is normal. The law was
checked on all 1.1·10⁹ inputs in [-128, 0]; for x > 0 (P̄'s argument is positive only by a rounding of the row
max) the same law with T+ holds, checked on all 1.1·10⁹ inputs in [0, 128). The tables are stored as int8
differences to the correctly rounded values (data/ex2_sm90_*.i8.xz, ~130 KB each).

log2 of x = 2^e·m (m in [1, 2)): lg2(x) = RZ(e + L[m]), the exact sum rounded toward zero to fp32, with L the unit's
lg2 on [1, 2) (2²³ entries, data/lg2_sm90.i32.xz, ~370 KB); checked for every m and every e in [1, 126]; inputs
below 1 (e < 0) follow the same law by assumption (row sums are at least 1). `__logf(x)` is fp32(lg2(x)·fp32(ln 2))
(the same bits on every input in [1, 8192)). All tables: benchmarks/make_sfu_tables.py from the GPU runs.
"""
from __future__ import annotations

import functools
import lzma
from pathlib import Path

import numpy as np
import torch

_DATA = Path(__file__).resolve().parent / "data"
_FRACTION_BITS = 23
_FLT_MIN = 2.0 ** -126
_LN2_F32 = 0.69314718246459960938  # fp32(ln 2), the constant __logf multiplies by


@functools.lru_cache(maxsize=1)
def _joined_table() -> torch.Tensor:
    """T- then T+ in one tensor (2²⁴ entries): one gather per input."""
    return torch.cat(load_tables())


@functools.lru_cache(maxsize=1)
def load_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(T-, T+) as fp32 tensors of 2²³ entries: ex2.approx.ftz at -i·2⁻²³ and +i·2⁻²³."""
    grid = torch.arange(1 << _FRACTION_BITS, dtype=torch.float64) * 2.0 ** -_FRACTION_BITS
    out = []
    for name, x in (("neg", -grid), ("pos", grid)):
        diff = np.frombuffer(lzma.decompress((_DATA / f"ex2_sm90_{name}.i8.xz").read_bytes()), dtype=np.int8)
        bits = torch.exp2(x).float().view(torch.int32) + torch.from_numpy(diff.astype(np.int32))
        out.append(bits.view(torch.float32))
    return out[0], out[1]


def ex2_approx(x: torch.Tensor) -> torch.Tensor:
    """2^x for fp32 x as sm_90's ex2.approx.ftz.f32 returns it (fp32 tensor of x's shape). In fp32 and int32
    throughout: |x|·2²³ is exact in fp32 (a power-of-two scaling) and, clamped at 200, fits an int32."""
    table = _joined_table()
    x = x.float()
    magnitude = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=200.0)  # beyond |x| = 200 the result is 0 or inf
    X = (magnitude * float(1 << _FRACTION_BITS)).to(torch.int32)  # truncation toward zero, as the unit's
    n = X >> _FRACTION_BITS
    negative = x < 0
    f = (X & ((1 << _FRACTION_BITS) - 1)) + torch.where(negative, 0, 1 << _FRACTION_BITS)
    mantissa = table[f.long()]
    y = mantissa * torch.exp2(torch.where(negative, -n, n).float())  # exact, or 0 / inf beyond fp32's range
    y = torch.where(y < _FLT_MIN, torch.zeros_like(y), y)  # ftz
    y = torch.where(torch.isnan(x), x, y)
    y = torch.where(torch.isinf(x) & (x > 0), torch.full_like(y, float("inf")), y)
    return torch.where(torch.isinf(x) & (x < 0), torch.zeros_like(y), y)


@functools.lru_cache(maxsize=1)
def load_lg2_table() -> torch.Tensor:
    """L as an fp32 tensor of 2²³ entries: lg2.approx.ftz at 1 + i·2⁻²³."""
    x = (torch.arange(1 << _FRACTION_BITS, dtype=torch.int32) + 0x3F800000).view(torch.float32)
    diff = np.frombuffer(lzma.decompress((_DATA / "lg2_sm90.i32.xz").read_bytes()), dtype=np.int32)
    bits = torch.log2(x.double()).float().view(torch.int32) + torch.from_numpy(diff.copy())
    return bits.view(torch.float32)


def lg2_approx(x: torch.Tensor) -> torch.Tensor:
    """log2(x) for fp32 x as sm_90's lg2.approx.ftz.f32 returns it."""
    table = load_lg2_table()
    x = x.float()
    bits = x.view(torch.int32)
    e = ((bits >> _FRACTION_BITS) & 0xFF) - 127
    exact = e.double() + table[(bits & ((1 << _FRACTION_BITS) - 1)).long()].double()
    y = exact.float()
    y = torch.where(y.double().abs() > exact.abs(), torch.nextafter(y, torch.zeros_like(y)), y)  # toward zero
    flushed = e == -127  # ±0 and subnormals (flushed to ±0 by ftz)
    y = torch.where(flushed, torch.full_like(y, float("-inf")), y)
    y = torch.where((x < 0) & ~flushed, torch.full_like(y, float("nan")), y)
    return torch.where(torch.isnan(x) | (torch.isinf(x) & (x > 0)), x, y)


def logf_fast(x: torch.Tensor) -> torch.Tensor:
    """__logf(x): fp32(lg2.approx(x) · fp32(ln 2))."""
    return lg2_approx(x) * torch.tensor(_LN2_F32, dtype=torch.float32)
