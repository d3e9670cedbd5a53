"""A documented compatibility layer for Triton 3.9's CPU interpreter (TRITON_INTERPRET=1).

The interpreter runs kernels with numpy and has known numeric bugs:
- bf16 tl.dot multiplies the raw uint16 bit patterns (triton-lang/triton#11584);
- fp32 → bf16 casts truncate instead of rounding to nearest-even;
- fp32 → fp8 casts round ties away, lose the carry and do not saturate (#8322);
- bf16 elementwise arithmetic also works on bit patterns (the kernels avoid it: elementwise
  math is fp32 everywhere);
- fp32 tl.dot is numpy's matmul (BLAS order, not the sequential walk of an ieee dot);
- tl.exp2 / tl.log are numpy's, whose last bits differ from torch's (the emulator's libm); torch's own
  fp32 exp2 rounds some arguments differently in its vectorized body and its scalar tail, so
  even torch's result depends on where an element sits in its tensor.

`install()` replaces three methods of the interpreter's builder:
- casts between fp32/fp64 and bf16 / fp16 / fp8 go through torch (round to nearest-even; fp8
  e4m3 saturates at ±448 and e5m2 at ±57344, as sm_90's `cvt.rn.satfinite` does);
- tl.dot decodes its operands to their exact values and runs the `ieee` accumulation model of
  fa_forensics.numerics.matmul (acc ← fp32(acc + a_k·b_k), k = 0..K-1, one rounding per term,
  starting from the C operand), i.e. the emulator's own product; with `use_tensor_cores` a dot of
  bf16 / fp16 / fp8 operands runs the `tensor-core` model instead, as on a GPU;
- tl.exp2 is `numerics.exp2_fp32` (fp64 2ˣ rounded once to fp32: the same bits at any position in
  any tile) and tl.log is torch.log.
The emulator evaluates exp(x) with numerics.exp_fp32 (correctly rounded), the kernels as
exp2(x·log2 e); `with align_emulator_exp(monkeypatch):` makes the emulator use exp(x) := exp2_fp32(fp32(x·log2 e)),
so that a test can demand bit-exact agreement of everything downstream of the exponential.
With it an interpreter run computes what the kernel's source says, in the emulator's order, so
interpreter-vs-emulator tests check the kernels' logic bit for bit. It changes nothing outside
the interpreter; `uninstall()` restores the originals.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

_ORIGINAL: dict = {}


def _torch_dtype(tt):
    import triton.language as tl

    return {
        tl.float32: torch.float32, tl.float64: torch.float64, tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
    }.get(tt)


_SATURATE = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def decode(data: np.ndarray, tt) -> torch.Tensor:
    """A handle's numpy data (bit patterns for bf16/fp8) → a torch tensor of its dtype."""
    dt = _torch_dtype(tt)
    if dt in _BITS_VIEW:
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.int16 if dt == torch.bfloat16 else np.uint8))
        return raw.view(dt)
    return torch.from_numpy(np.ascontiguousarray(data))


def encode(x: torch.Tensor) -> np.ndarray:
    """A torch tensor → numpy data in the interpreter's storage convention (bit patterns)."""
    if x.dtype in _BITS_VIEW:
        bits = x.view(_BITS_VIEW[x.dtype]).numpy()
        return bits.view(np.uint16) if x.dtype == torch.bfloat16 else bits
    return x.numpy()


def _convert(src, dst_type):
    """Value-preserving (widening) or nearest-even (narrowing) float conversion via torch."""
    from triton.runtime.interpreter import TensorHandle

    x = decode(src.data, src.dtype.scalar)
    dst = _torch_dtype(dst_type.scalar)
    if dst in _SATURATE:
        x = x.double().clamp(-_SATURATE[dst], _SATURATE[dst])  # exact in fp64, then one rounding
    y = x.to(dst)
    return TensorHandle(encode(y), dst_type.scalar)


def _is_float_pair(src, dst_type) -> bool:
    return (_torch_dtype(src.dtype.scalar) is not None and _torch_dtype(dst_type.scalar) is not None
            and src.dtype.scalar != dst_type.scalar)


def _cast_impl(self, src, dst_type):
    if _is_float_pair(src, dst_type):
        return _convert(src, dst_type)
    return _ORIGINAL["cast_impl"](self, src, dst_type)


def _fp_to_fp(self, src, dst_type, rounding_mode):
    if _is_float_pair(src, dst_type):
        return _convert(src, dst_type)
    return _ORIGINAL["create_fp_to_fp"](self, src, dst_type, rounding_mode)


_DOT_MODEL = {"accumulation": "ieee", "gpu": "h100"}  # see `use_tensor_cores`
_FORMAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8_e4m3",
                 torch.float8_e5m2: "fp8_e5m2"}
_WIDTH = {"fp8_e4m3": 0, "fp8_e5m2": 0, "fp16": 1, "bf16": 1}


def _dot_format(a_dtype, b_dtype):
    """The MMA format of a dot of these operand dtypes (the wider one), or None where either is not a
    tensor-core format (fp32 operands: a GPU runs those dots as fp32 FMAs, the `ieee` model)."""
    names = [_FORMAT_NAMES.get(_torch_dtype(t)) for t in (a_dtype, b_dtype)]
    if None in names:
        return None
    return max(names, key=_WIDTH.__getitem__)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """tl.dot(a, b, d) under the selected model: exact operands; `ieee` (default) is the sequential
    fp32 FMA walk over K; `tensor-core` (`use_tensor_cores`) gives dots of bf16 / fp16 / fp8
    operands the tensor-core model of numerics.matmul, as a GPU's MMA units run them."""
    from triton.runtime.interpreter import TensorHandle

    from fa_forensics.numerics import matmul

    a_t = decode(a.data, a.dtype.scalar).double()  # (M, K) exact values
    b_t = decode(b.data, b.dtype.scalar).double()  # (K, N)
    acc = decode(d.data, d.dtype.scalar).float()  # (M, N) the C operand
    fmt = _dot_format(a.dtype.scalar, b.dtype.scalar)
    if _DOT_MODEL["accumulation"] == "tensor-core" and fmt is not None:
        out = matmul(a_t.float(), b_t.float(), accumulation="tensor-core", gpu=_DOT_MODEL["gpu"], in_format=fmt,
                     acc=acc)
    else:
        out = matmul(a_t, b_t, accumulation="ieee", in_format="fp32", acc=acc)
    return TensorHandle(out.float().numpy().astype(np.float32), d.dtype.scalar)


def use_tensor_cores(monkeypatch, gpu: str = "h100") -> None:
    """For one test: dots of bf16 / fp16 / fp8 operands run the `tensor-core` accumulation model of
    `gpu` (what the hardware's MMA does), fp32 dots stay `ieee`."""
    monkeypatch.setitem(_DOT_MODEL, "accumulation", "tensor-core")
    monkeypatch.setitem(_DOT_MODEL, "gpu", gpu)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    from fa_forensics.numerics import exp2_fp32

    return exp2_fp32(x).to(x.dtype)


def _unary_torch(fn):
    """An interpreter unary op evaluated by torch (so kernels and emulator share one libm)."""
    def op(self, arg):
        from triton.runtime.interpreter import TensorHandle

        x = decode(arg.data, arg.dtype.scalar)
        return TensorHandle(encode(fn(x)), arg.dtype.scalar)

    return op


def install() -> None:
    """Patch the interpreter builder (idempotent)."""
    from triton.runtime.interpreter import InterpreterBuilder

    if _ORIGINAL:
        return
    patches = (("cast_impl", _cast_impl), ("create_fp_to_fp", _fp_to_fp), ("create_dot", _dot),
               ("create_exp2", _unary_torch(_exp2)), ("create_log", _unary_torch(torch.log)))
    for name, fn in patches:
        _ORIGINAL[name] = getattr(InterpreterBuilder, name)
        setattr(InterpreterBuilder, name, fn)
    # the lambdas bound at class creation call self.cast_impl, so they pick up the patch


def uninstall() -> None:
    """Restore the interpreter's own methods."""
    from triton.runtime.interpreter import InterpreterBuilder

    for name, fn in _ORIGINAL.items():
        setattr(InterpreterBuilder, name, fn)
    _ORIGINAL.clear()


def aligned_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) evaluated as the kernels do: exp2(fp32(x · log2 e)) (fp32 in, fp32 out), 2ˣ rounded once
    (`numerics.exp2_fp32`, the interpreter's tl.exp2 here)."""
    from fa_forensics.numerics import exp2_fp32
    from fa_forensics.numerics.elementary import LOG2E

    return exp2_fp32(x * torch.tensor(LOG2E, dtype=x.dtype))


@contextlib.contextmanager
def align_emulator_exp(monkeypatch) -> Iterator[None]:
    """Make the emulator's exponential the kernels' one (`aligned_exp`) inside the block (a fixture's
    body). The compiled engine's row stages (replay/emulate/fused.py) carry the emulator's own exp inside,
    so the emulator runs the spec engine here, whose exp can be swapped (the engines are bit-identical
    otherwise, tests/unit/replay/test_engines_golden.py)."""
    from fa_forensics.enums import Engine
    from fa_forensics.numerics.engines import use_engine
    from fa_forensics.replay.emulate import backward, forward

    for module in (forward, backward):
        monkeypatch.setattr(module, "exp_fp32", aligned_exp)
    with use_engine(Engine.SPEC):
        yield
