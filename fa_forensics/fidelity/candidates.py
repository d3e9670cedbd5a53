"""Which recipes may have computed a dump's O, and which of the tried ones to name, from what it records.

A bf16 run is never an FP8 run: `admissible` keeps the candidate recipes the recorded facts
(`fidelity.run_facts`) allow, so `match` and `--preset auto` never name a recipe on noise that the
run cannot have used. `implied` is the recipe the recorded settings point to, replayed where stored
O cannot be matched (attention dropout, no stored O, an fp32 run). `pick_best` prefers the
accumulation model the recorded device implies (tensor cores on a GPU, ieee otherwise) unless the
other model is clearly better, so layers of one run do not flip models on a few elements.

Recipes and candidates are any objects with `preset` and `accumulation` (a value of
`Accumulation`); tried candidates also carry `o_bits_equal` and `max_abs_err`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, TypeVar

from fa_forensics.fidelity.run_facts import RunFacts
from fa_forensics.enums import Accumulation, Precision, Softmax
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.kernel_recipes import KERNEL_RECIPES

R = TypeVar("R")

# The other accumulation model is chosen only when it reproduces this share more of the stored O
# (or reproduces all of it where the preferred model does not).
CLEAR_MARGIN = 0.01

_FP8 = {Precision.FP8_E4M3, Precision.FP8_E5M2}
_GPU_DEVICES = ("cuda", "hip", "rocm", "xpu")


def _config(preset: str) -> ReplayConfig:
    return ReplayConfig.preset(preset)


def _precision_allows(preset: str, facts: RunFacts) -> bool:
    cfg = _config(preset)
    fp8 = cfg.p_dtype in _FP8 or cfg.input_dtype in _FP8
    if facts.precision == "fp8":
        return fp8
    if facts.precision in ("bf16", "fp16"):
        return not fp8
    if facts.precision == "fp32":
        return preset == "fp32"
    return True


def _softmax_allows(preset: str, facts: RunFacts) -> bool:
    if facts.softmax is None:
        return True
    stabilized = _config(preset).softmax is Softmax.STABILIZED
    return stabilized == facts.softmax.startswith("stabil")


def _kernel_allows(preset: str, facts: RunFacts) -> bool:
    """A recorded torch SDPA call is never the paper's pure-PyTorch reference code (the bf16-autocast presets)."""
    return not (facts.kernel == "sdpa" and preset.startswith("bf16-autocast"))


_GPU_KERNEL_PRESETS = {r.preset for r in KERNEL_RECIPES}


def _device_allows(preset: str, facts: RunFacts) -> bool:
    """A run recorded on a CPU never ran a GPU kernel (the recipes named after SDPA's and flash_attn's kernels)."""
    if facts.device is None or facts.device.startswith(_GPU_DEVICES):
        return True
    return preset.split("@", 1)[0] not in _GPU_KERNEL_PRESETS


def admissible(recipes: Sequence[R], facts: RunFacts) -> list[R]:
    """The recipes the recorded precision, softmax variant, kernel and device allow (all of them when nothing is
    recorded)."""
    kept = [r for r in recipes
            if _precision_allows(r.preset, facts) and _softmax_allows(r.preset, facts)
            and _kernel_allows(r.preset, facts) and _device_allows(r.preset, facts)]
    return kept or list(recipes)


def preferred_accumulation(facts: RunFacts) -> Accumulation:
    """Tensor cores on a recorded GPU device, else ieee (a CPU, or nothing recorded)."""
    if facts.device is not None and facts.device.startswith(_GPU_DEVICES):
        return Accumulation.TENSOR_CORE
    return Accumulation.IEEE


def implied(facts: RunFacts, fallback: str) -> tuple[str, Accumulation, str]:
    """(preset, accumulation, why): the recipe the recorded settings imply, for layer-steps whose
    stored O cannot be matched. Torch's SDPA kernels (a recorded source "sdpa", or attention dropout,
    an argument of SDPA) round P̄ once to bf16 and accumulate in fp32 (preset bf16-hw)."""
    acc = preferred_accumulation(facts)
    if facts.is_fp32_run:
        return fallback, Accumulation.IEEE, "trained in fp32: the replay shows what bf16 would do on these inputs"
    if facts.precision == "fp8":
        return "fp8-s1", Accumulation.IEEE, "recorded fp8 inputs"
    if facts.softmax is not None and facts.softmax.startswith("stabil"):
        return "bf16-autocast-stabilized", acc, "recorded stabilized softmax"
    if (facts.has_dropout or facts.kernel == "sdpa") and facts.precision in ("bf16", "fp16"):
        return "bf16-hw", acc, f"{facts.precision} SDPA"
    return fallback, acc, "nothing recorded points to another recipe"


def _rank(c, order: int) -> tuple:
    err = c.max_abs_err if c.max_abs_err is not None and math.isfinite(c.max_abs_err) else math.inf
    return c.o_bits_equal, -err, -order


def _best(cands: Sequence[R]) -> Optional[R]:
    if not cands:
        return None
    return max(zip(cands, range(len(cands))), key=lambda pair: _rank(pair[0], pair[1]))[0]


def pick_best(tried: Sequence[R], facts: RunFacts) -> R:
    """The candidate to name: the best under the preferred accumulation model, unless the best under
    the other model reproduces all of the stored O where it does not, or CLEAR_MARGIN more of it."""
    preferred = preferred_accumulation(facts).value
    mine = _best([c for c in tried if Accumulation(c.accumulation).value == preferred])
    other = _best([c for c in tried if Accumulation(c.accumulation).value != preferred])
    if mine is None or other is None:
        return mine or other
    exact = other.o_bits_equal == 1.0 and mine.o_bits_equal < 1.0
    return other if exact or other.o_bits_equal - mine.o_bits_equal >= CLEAR_MARGIN else mine
