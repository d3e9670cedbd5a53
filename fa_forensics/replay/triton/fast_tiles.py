"""How the training-speed kernels (fast_attention.py) are launched: their tiles and their optional levers.

Tiles come from a fixed table per (head dim, causal, input dtype); Triton's autotuner is an option.
Why a table: the autotuner times every config at the first call of each shape and keeps the fastest,
so configs within noise of each other win at random from run to run (two H200 runs of
benchmarks/gpu_speed.py picked different tiles for the same rows: the D 64 causal backward ran at
0.49× SDPA in one and 0.96× in the other), and the stabilized and plain kernels, tuned apart, could
run different tiles, so their time ratio was not the fix's cost. The table gives every run, and
both kernels, the same tiles. Its entries are not measured picks: they are the largest tiles of
Triton's fused-attention settings for Hopper that compile for sm_90 without spilling registers
(`python -m fa_forensics.replay.triton.fast_compile_check` prints registers and spills per config:
the backward's earlier 4-warp tiles spilled 72-1040 bytes per thread, the 8-warp ones here none;
the fp32 forward at D 128 still spills 648 bytes, the least of the configs tried). `benchmarks/gpu_speed.py`
runs the autotuner beside the table and reports the config it settles on per shape, so one device
run can correct an entry.

No option changes a result: rows are independent of the row tile, and the KV block (64, the
stabilized rule's block) is fixed by the numerics contract. The levers (`KernelOptions`):
- `tie_test`: how the forward finds a repeated block maximum. "count": scores with qk ≥ max − ε counted
  as fp32 ones and zeros (an exact integer count; on sm_90 one FSET and one FADD per score, against
  FSETP, SEL and an integer add for an int32 count). "top2": one reduction carrying the two largest
  scores of each row (a tie is the second ≥ max − ε), no second pass over the scores. Both decide
  exactly as the contract's count does.
- `tma`: K and V tiles loaded by the Tensor Memory Accelerator from 3-D tensor descriptors
  (B·H, T, D) instead of pointer loads (Hopper and later; rows past T arrive as zeros).
- `warp_specialize`: Triton's warp specialization of the forward's KV loop (producer warps load,
  consumer warps compute: what FlashAttention-3 does by hand), where the device's Triton supports it.
- `tuning`: "table" or "autotune" (Triton's autotuner over the configs below, keyed by shape).
The environment variable FA_FORENSICS_TRITON_OPTIONS (comma-separated: autotune, top2, tma,
warp_specialize) sets the options `stable_attention` runs with.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fa_forensics.errors import ConfigError

ENV = "FA_FORENSICS_TRITON_OPTIONS"
TIE_TESTS = ("count", "top2")
TUNINGS = ("table", "autotune")


@dataclass(frozen=True)
class FwdTiles:
    """Forward: BLOCK_M query rows per program (a multiple of the contract's KV block of 64)."""

    block_m: int
    num_warps: int
    num_stages: int

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m}


@dataclass(frozen=True)
class BwdTiles:
    """Backward: dK/dV of BLOCK_N1 keys walking query blocks of BLOCK_M1; dQ of BLOCK_M2 (= BLOCK_N1) rows
    walking KV blocks of BLOCK_N2."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_m2 != self.block_n1 or self.block_n1 % self.block_m1 or self.block_m2 % self.block_n2:
            raise ConfigError(f"backward tiles {self}: BLOCK_M2 must equal BLOCK_N1, and BLOCK_N1 and BLOCK_M2 be "
                              "multiples of BLOCK_M1 and BLOCK_N2")

    def meta(self) -> dict:
        return {"BLOCK_M1": self.block_m1, "BLOCK_N1": self.block_n1, "BLOCK_M2": self.block_m2,
                "BLOCK_N2": self.block_n2}


# (head dim at most, 16-bit inputs) -> tiles; causal and not share an entry (the causal kernel skips blocks,
# its tiles are the same). fp32 inputs (IEEE dots, no tensor cores) take smaller tiles that fit shared memory.
_FWD_TABLE = {(64, True): FwdTiles(128, 4, 3), (128, True): FwdTiles(128, 8, 3),
              (64, False): FwdTiles(64, 8, 1), (128, False): FwdTiles(64, 8, 2)}
_BWD_TABLE = {(64, True): BwdTiles(32, 128, 128, 32, 8, 3), (128, True): BwdTiles(32, 128, 128, 32, 8, 3),
              (64, False): BwdTiles(16, 32, 32, 16, 4, 1), (128, False): BwdTiles(16, 32, 32, 16, 4, 1)}
# Under the interpreter: one small config (each tl.dot is evaluated in numpy).
INTERPRETER_FWD = FwdTiles(64, 4, 1)
INTERPRETER_BWD = BwdTiles(16, 32, 32, 16, 4, 1)


def _key(head_dim: int, dtype: torch.dtype) -> tuple[int, bool]:
    return (64 if head_dim <= 64 else 128), dtype != torch.float32


def fwd_tiles(head_dim: int, causal: bool, dtype: torch.dtype) -> FwdTiles:
    """The forward's tiles for this shape (the same for the stabilized and the plain kernel)."""
    return _FWD_TABLE[_key(head_dim, dtype)]


def bwd_tiles(head_dim: int, causal: bool, dtype: torch.dtype) -> BwdTiles:
    return _BWD_TABLE[_key(head_dim, dtype)]


def fwd_autotune_set() -> list[FwdTiles]:
    """What `tuning="autotune"` chooses among (Hopper-sized; the table's 16-bit entries are in it)."""
    return [FwdTiles(128, 8, 3), FwdTiles(128, 4, 3), FwdTiles(128, 8, 4), FwdTiles(64, 4, 4)]


def bwd_autotune_set() -> list[BwdTiles]:
    return [BwdTiles(32, 128, 128, 32, 8, 3), BwdTiles(32, 64, 64, 32, 8, 3), BwdTiles(64, 128, 128, 64, 8, 3),
            BwdTiles(32, 128, 128, 32, 4, 3)]


def table_entries() -> list[tuple[str, FwdTiles, BwdTiles]]:
    """Every (label, forward tiles, backward tiles) of the table, for the compile check."""
    return [(f"D<={d} {'16-bit' if half else 'fp32'}", _FWD_TABLE[(d, half)], _BWD_TABLE[(d, half)])
            for d, half in _FWD_TABLE]


@dataclass(frozen=True)
class KernelOptions:
    """How the kernels run; every choice computes the same numbers (the contract in fast_attention.py)."""

    tuning: str = "table"
    tie_test: str = "count"
    tma: bool = False
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        if self.tuning not in TUNINGS:
            raise ConfigError(f"kernel options: tuning={self.tuning!r}; use one of {', '.join(TUNINGS)}")
        if self.tie_test not in TIE_TESTS:
            raise ConfigError(f"kernel options: tie_test={self.tie_test!r}; use one of {', '.join(TIE_TESTS)}")

    @classmethod
    def parse(cls, text: str) -> KernelOptions:
        """From a comma-separated list of names: autotune, top2, tma, warp_specialize (empty: the defaults)."""
        names = [n.strip() for n in text.split(",") if n.strip()]
        known = {"autotune", "top2", "tma", "warp_specialize"}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(f"{ENV}={text!r}: unknown option(s) {', '.join(unknown)}; use a comma-separated list of "
                              f"{', '.join(sorted(known))}")
        return cls(tuning="autotune" if "autotune" in names else "table",
                   tie_test="top2" if "top2" in names else "count",
                   tma="tma" in names, warp_specialize="warp_specialize" in names)

    @classmethod
    def from_env(cls) -> KernelOptions:
        return cls.parse(os.environ.get(ENV, ""))

    def label(self) -> str:
        parts = [p for p, on in (("autotune", self.tuning == "autotune"), ("top2", self.tie_test == "top2"),
                                 ("tma", self.tma), ("warp_specialize", self.warp_specialize)) if on]
        return ",".join(parts) or "default"
