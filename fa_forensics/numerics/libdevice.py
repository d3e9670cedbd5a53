"""CUDA's accurate `expf` and `logf` (libdevice `__nv_expf` / `__nv_logf`), operation for operation.

A kernel built without fast math (PyTorch's FlashAttention-2 split-KV combine, the memory-efficient kernel's
backward) calls these for exp and log. They are not correctly rounded: `logf` differs from the correctly rounded
log in about 4.6 % of inputs in [1, 8192), `expf` in about 9 % of inputs in [-104, 0] (counted on an H200), so a
replay that rounds exp and log once cannot reproduce the kernel's bits. Both are short sequences of fp32
operations, transcribed here from libdevice.10.bc of CUDA 13.0:
`expf` reduces x to f = x·log2 e − j with two FMAs and returns ex2.approx(f)·2^j (the special function unit,
numerics.sfu); `logf` splits x = 2^e·m with m in [2/3, 4/3) and evaluates a degree-10 polynomial in m − 1 by FMAs.
Checked against the H200's per-binade census of both functions (benchmarks/gpu_special_functions.cu, part
`laws`; tests/unit/numerics/test_libdevice.py).
"""
from __future__ import annotations

import struct

import torch

from fa_forensics.numerics import sfu
from fa_forensics.numerics.elementary import fma_fp32


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor(struct.unpack("<f", struct.pack("<I", bits))[0], dtype=torch.float32)


def _f64_hex(text: str) -> torch.Tensor:
    """An LLVM float constant (the fp32 value written as a double's hex) as an fp32 tensor."""
    return torch.tensor(struct.unpack(">d", bytes.fromhex(text))[0], dtype=torch.float32)


_LOG2E_HI = _f32(0x3FB8AA3B)  # fp32(log2 e)
_LOG2E_LO = _f32(0x32A57060)  # log2 e − fp32(log2 e)
_SHIFTER = 12582912.0  # 1.5·2²³
_LOGF_POLY = [_f64_hex(h) for h in (
    "BFC0AA04E0000000", "3FC2073EC0000000", "BFBF19B980000000", "3FC1E52AA0000000", "BFC55B1720000000",
    "3FC99DA160000000", "BFCFFFE440000000", "3FD5554F00000000")]
_LN2 = _f64_hex("3FE62E4300000000")
_FLT_MIN = 2.0 ** -126


def expf(x: torch.Tensor) -> torch.Tensor:
    """e^x as CUDA's `expf` computes it (fp32 in, fp32 out)."""
    x = x.float()
    step = torch.tensor(float(_LOG2E_HI) / 252.0, dtype=torch.float32)  # fp32(fp32(log2 e) / 252)
    j = fma_fp32(x, step, torch.tensor(0.5)).nan_to_num(nan=0.0).clamp(0.0, 1.0)  # saturate
    k = torch.floor(j.double() * 252.0 + (_SHIFTER + 1.0)) - _SHIFTER  # fma round-down; 1 + ⌊252 j⌋ in [1, 253]
    shift = -(k - 127.0).float()
    f = fma_fp32(x, _LOG2E_HI, shift)
    f = fma_fp32(x, _LOG2E_LO, f)
    y = (sfu.ex2_approx(f).double() * torch.exp2(k - 127.0)).float()
    return torch.where(torch.isnan(x), x, y)


def logf(x: torch.Tensor) -> torch.Tensor:
    """The natural log as CUDA's `logf` computes it (fp32 in, fp32 out)."""
    x = x.float()
    tiny = x < _FLT_MIN
    a = torch.where(tiny, x * 8388608.0, x)
    i = torch.where(tiny, torch.tensor(-23.0), torch.tensor(0.0))
    ia = a.view(torch.int32)
    e = (ia - 0x3F2AAAAB) & -8388608
    m = (ia - e).view(torch.float32)
    t = fma_fp32(e.float(), torch.tensor(2.0 ** -23), i)
    f = m - 1.0
    p = fma_fp32(_LOGF_POLY[0], f, _LOGF_POLY[1])
    for c in _LOGF_POLY[2:] + [torch.tensor(-0.5)]:
        p = fma_fp32(p, f, c)
    p = p * f
    p = fma_fp32(p, f, f)
    r = fma_fp32(t, _LN2, p)
    special = ia.to(torch.int64) & 0xFFFFFFFF >= 0x7F800000  # inf, nan and negative inputs
    r = torch.where(special, fma_fp32(a, torch.tensor(float("inf")), torch.tensor(float("inf"))), r)
    return torch.where(a == 0, torch.tensor(float("-inf")), r)
