"""Engines: which implementation runs the emulator's arithmetic. Every engine gives the spec's bits.

The emulator's arithmetic is written once as readable torch code, the specification (`Engine.SPEC`); a
faster engine computes the same IEEE operations in the same order where its domain holds and hands every
other call to the spec, so the choice changes the time a replay takes and never a bit of its result. The
golden corpus (`replay/corpus.py`) is the test of that promise: tests/unit/replay/test_engines_golden.py
replays it under every available engine and compares every output with the spec's, bit for bit.

Choosing one: `with use_engine(Engine.SPEC): ...` for a block of code, or the `engine=` argument of
`replay`, `emulate_replay` and `numerics.matmul`; unset, `Engine.COMPILED` runs. The choice is a context
variable: it holds in the thread (and asyncio task) that set it; worker threads and processes started
inside the block run the default.

Triton is not an engine but a replay backend (`Backend.TRITON`): its kernels do not give the spec's bits
(exp as exp2(x·log2 e); on a GPU the tensor cores' own accumulation), refuse masks, stochastic rounding
and the GPU kernel models, and run on a GPU; tests/triton compares them with the emulator under the
differences replay/triton/backend.py states.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Union

from fa_forensics.enums import ENGINES, Engine
from fa_forensics.errors import InvalidSetting

EngineLike = Union[Engine, str, None]

# matmul's own names of the two engines: "auto" (compiled where eligible) and "torch" (the spec's kernels)
_ALIASES = {"auto": Engine.COMPILED, "torch": Engine.SPEC}
DEFAULT = Engine.COMPILED
_CURRENT: ContextVar[Engine] = ContextVar("fa_forensics_engine", default=DEFAULT)


class SpecEngine:
    """The torch code, the readable specification of every operation of a replay.

    Covers every input and configuration: the accumulation models' torch kernels (`numerics.accumulate`,
    `accumulate_tiles`, fp64 reference steps where fp32 ones cannot be exact), the emulator's torch stages
    (`replay/emulate/forward.py`, `backward.py`, the GPU kernel models). Never falls back; always available."""

    engine = Engine.SPEC

    def available(self) -> bool:
        return True


class CompiledEngine:
    """numba kernels with the spec's arithmetic, compiled for the host CPU on first use (cached on disk).

    Covers, call by call:
    - matrix products (`numerics.accumulate_jit`, register tiles in LLVM IR: `numerics.register_tiles`) where
      every operand and the starting accumulator are finite fp32 numbers; a product with NaN, inf or fp64
      values that are not fp32 numbers runs the spec's kernels;
    - the forward's and the backward's per-row elementwise stages (`replay/emulate/fused.py`) where
      `fused.eligible` holds: nearest-even rounding, finite inputs whose scores stay far inside fp32's range,
      no NaN or +inf in an additive mask; the forward also needs an fp32 exponential, no given scores or
      per-block observer and not a GPU kernel model. Otherwise that forward or backward runs the spec's stages
      (its matrix products still compiled).
    Available where numba and llvmlite import (declared dependencies: wheels for the common platforms) and the
    kernels compile with them (importing `accumulate_jit` compiles or loads them)."""

    engine = Engine.COMPILED

    def available(self) -> bool:
        return _imports("numba", "llvmlite", "fa_forensics.numerics.accumulate_jit")


@functools.cache
def _imports(*modules: str) -> bool:
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception:  # a module that does not import, or whose kernels do not compile here
        return False
    return True


IMPLEMENTATIONS = {Engine.SPEC: SpecEngine(), Engine.COMPILED: CompiledEngine()}


def resolve_engine(engine: EngineLike = None) -> Engine:
    """The Engine of a name or enum ("auto" and "torch", matmul's names, included); None: the current one."""
    if engine is None:
        return _CURRENT.get()
    if isinstance(engine, Engine):
        return engine
    name = str(engine).strip().lower()
    if name in _ALIASES:
        return _ALIASES[name]
    try:
        return Engine(name)
    except ValueError:
        raise InvalidSetting("engine", f"{engine!r} is not one of: {', '.join(ENGINES)}") from None


def current_engine() -> Engine:
    """The engine of this context: the innermost `use_engine`, else DEFAULT."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_engine(engine: EngineLike) -> Iterator[Engine]:
    """Run the block under `engine` (None keeps the current one); restores the previous engine after."""
    chosen = resolve_engine(engine)
    token = _CURRENT.set(chosen)
    try:
        yield chosen
    finally:
        _CURRENT.reset(token)


def available(engine: EngineLike = None) -> bool:
    """True when `engine` (None: the current one) can run here; where it cannot, the spec runs instead."""
    return IMPLEMENTATIONS[resolve_engine(engine)].available()


def available_engines() -> tuple[Engine, ...]:
    """Every engine that can run here, the spec first."""
    return tuple(e for e in Engine if IMPLEMENTATIONS[e].available())


def runs_compiled(engine: EngineLike = None) -> bool:
    """True when the compiled kernels may run for a call under `engine` (None: the current one)."""
    chosen = resolve_engine(engine)
    return chosen is Engine.COMPILED and IMPLEMENTATIONS[chosen].available()
