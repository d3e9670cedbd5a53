"""The golden corpus: fixed replays whose outputs pin the emulator's bits.

A case is a preset × accumulation model × causal or not × mask (none; bool; additive, with -inf where the
bool mask forbids; in both the first two rows see no key) on one of a few seeded inputs (one with coarse
q, k: tied scores and repeated row maxima), replayed forward and backward. Its outputs: O, lse, δ, dQ, dK,
dV and the P̄ statistics (`FIELDS`, `STATS`); a case a kernel model refuses (a GPU kernel's backward under
a mask) gives its one-line refusal instead.

Two uses, one definition:
- `small_cases()`: every preset, both models, every mask, causal and not (alternating), on small inputs; the
  test that every engine (numerics/engines.py) equals the spec bit for bit
  (tests/unit/replay/test_engines_golden.py);
- `full_cases()`: the whole product on larger inputs, digested by benchmarks/emulator_corpus.py to compare
  two versions of the emulator (it loads this file by path beside the package being compared, so the
  definition needs nothing at import time that older versions lack).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from fa_forensics.errors import ConfigError
from fa_forensics.replay.api import replay
from fa_forensics.replay.config import PRESETS, ReplayConfig
from fa_forensics.replay.out import ReplayOut

if TYPE_CHECKING:  # the benchmark loads this file beside older packages (benchmarks/emulator_corpus.py)
    from fa_forensics.numerics.engines import EngineLike

FIELDS = ("o", "lse", "delta", "dq", "dk", "dv")
STATS = ("repeated_max_rows", "p_one_count", "stabilized_rows", "p_zeroed", "rows")
MASKS = ("none", "bool", "add")
ACCUMULATIONS = ("ieee", "tensor-core")


@dataclass(frozen=True)
class Inputs:
    """One seeded input set: q, k, v, dO (B, H, T, D); `ties` rounds q and k to halves (tied scores)."""

    seed: int
    B: int
    H: int
    T: int
    D: int
    ties: bool

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        q, k, v, do = (torch.randn(self.B, self.H, self.T, self.D, generator=g) * s for s in (3.0, 3.0, 1.0, 1.0))
        if self.ties:
            q, k = torch.round(q * 2) / 2, torch.round(k * 2) / 2
        return q, k, v, do

    def mask(self, kind: str) -> Optional[torch.Tensor]:
        """The mask of `kind` (MASKS), (1, 1, T, T), seeded like the inputs; the first two rows see no key."""
        if kind == "none":
            return None
        g = torch.Generator().manual_seed(self.seed)
        allowed = torch.rand(1, 1, self.T, self.T, generator=g) > 0.3
        allowed[..., :2, :] = False
        if kind == "bool":
            return allowed
        return torch.where(allowed, torch.randn(1, 1, self.T, self.T, generator=g), torch.tensor(float("-inf")))


FULL_INPUTS = (Inputs(0, 1, 2, 80, 16, True), Inputs(1, 2, 3, 130, 32, False))
SMALL_INPUTS = (Inputs(0, 1, 2, 48, 16, True), Inputs(1, 2, 1, 40, 32, False))


@dataclass(frozen=True)
class Case:
    """One replay of the corpus: `key` names it ("inputs/preset/accumulation/causal/mask")."""

    inputs: Inputs
    inputs_index: int
    preset: str
    accumulation: str
    causal: bool
    mask: str

    @property
    def key(self) -> str:
        return f"{self.inputs_index}/{self.preset}/{self.accumulation}/{self.causal}/{self.mask}"

    def config(self) -> ReplayConfig:
        return ReplayConfig.preset(self.preset).with_(accumulation=self.accumulation)


def full_cases() -> list[Case]:
    """Every preset × both models × causal or not × every mask, on each of FULL_INPUTS."""
    return [Case(inp, i, name, acc, causal, mk) for i, inp in enumerate(FULL_INPUTS)
            for name, acc, causal, mk in itertools.product(PRESETS, ACCUMULATIONS, (True, False), MASKS)]


def small_cases(preset: str) -> list[Case]:
    """Six replays of one preset: both models × every mask, causal and not alternating so that each mask
    runs both ways; the tied inputs for the unmasked and additive cases, the others for the bool mask."""
    out = []
    for (ai, acc), (mi, mk) in itertools.product(enumerate(ACCUMULATIONS), enumerate(MASKS)):
        index = mi % 2
        out.append(Case(SMALL_INPUTS[index], index, preset, acc, (ai + mi) % 2 == 0, mk))
    return out


def run_case(case: Case, engine: EngineLike = None, *, forward_when_refused: bool = False) -> Union[ReplayOut, str]:
    """The case replayed forward and backward (under `engine`; None: the current one), or the refusal's line.

    forward_when_refused: where the backward is refused (a GPU kernel's backward model under a mask), the
    forward alone (no gradients), so that the kernel's masked forward is still compared."""
    q, k, v, do = case.inputs.tensors()
    mask = case.inputs.mask(case.mask)
    try:
        return replay(q, k, v, case.config(), do=do, causal=case.causal, mask=mask, engine=engine)
    except ConfigError as exc:  # a GPU kernel's model refuses what that kernel does not do
        refusal = f"refused: {exc}"
    if forward_when_refused:
        try:
            return replay(q, k, v, case.config(), causal=case.causal, mask=mask, engine=engine)
        except ConfigError:
            pass
    return refusal
