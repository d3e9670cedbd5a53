"""Which recipes may have computed a dump's O, and which of the tried ones to name, from what it records.

Every recipe has `Traits`: its precision (bf16, fp16, fp8, fp32), its softmax variant (standard, stabilized),
its family (the paper's reference code under CUDA or CPU autocast, a GPU kernel's model, or a reading that
is neither) with the device and entry point the family implies. The candidates of a layer-step are the
recipes whose traits agree with every recorded fact (`fidelity.run_facts`): the product precision × softmax ×
device and kernel family, so that a bf16 run is never matched to an FP8 recipe, a CPU run never to a GPU
kernel, and every combination of facts has its recipes. An unknown fact excludes nothing. Where no recipe
models a combination of recorded facts (FP8 with the stabilized softmax), the facts are relaxed one at a
time and `Admission.relaxed` names them. `Admission.excluded` keeps what each fact ruled out, so that `match`
can say when a fact excluded a recipe that would have won.

`implied` is the recipe the recorded settings point to, replayed where stored O cannot be matched (attention
dropout, no stored O, an fp32 run). `pick_best` prefers the accumulation model the recorded device implies
(tensor cores on a GPU, ieee on a CPU; none when the device is unknown) unless the other model is clearly
better, so layers of one run do not flip models on a few elements.

Recipes and candidates are any objects with `preset` and `accumulation` (a value of `Accumulation`); tried
candidates also carry `o_bits_equal` and `max_abs_err`.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from fa_forensics.enums import Accumulation, Precision
from fa_forensics.fidelity.layer_match import Candidate, CandidateRecipe
from fa_forensics.fidelity.run_facts import RunFacts
from fa_forensics.replay.config import PRESETS, ReplayConfig
from fa_forensics.replay.kernel_recipes import KERNEL_RECIPES, kernel_presets


# The other accumulation model is chosen only when it reproduces this share more of the stored O
# (or reproduces all of it where the preferred model does not).
CLEAR_MARGIN = 0.01

_FP8 = {Precision.FP8_E4M3, Precision.FP8_E5M2}
_KERNELS = {r.preset: r for r in KERNEL_RECIPES}
# The kernel models each recorded entry-point family may have run (SDPA picks one of its backends; xformers
# dispatches to its CUTLASS kernel or to FlashAttention); flex_attention and SDPA's math backend have no model.
_KERNELS_OF_FAMILY = {
    "sdpa": {"sdpa-cudnn", "sdpa-efficient", "sdpa-flash"},
    "sdpa-cudnn": {"sdpa-cudnn"}, "sdpa-efficient": {"sdpa-efficient"}, "sdpa-flash": {"sdpa-flash"},
    "sdpa-math": set(), "flash_attn": {"flash_attn"}, "xformers": {"sdpa-efficient", "flash_attn"},
    "flex_attention": set(),
}
# Most likely first: the reference code as it trains (CUDA autocast, then CPU autocast), with and without its
# fix, then the forward-only readings, and the rest; the GPU kernels' models follow the reference code on a GPU
# run, and come last on any other (a CPU run stops early). The recorded op sequence of attention written in torch
# ops comes first: only such layers admit it.
_PRESET_ORDER = ("eager-reexec", "eager", "bf16-autocast-train", "bf16-autocast-stabilized", "bf16-autocast",
                 "bf16-autocast-cpu", "bf16-autocast-cpu-stabilized", "bf16-hw", "bf16", "stabilized", "fp16",
                 "fp16-stabilized", "fp32",
                 "fp32-stabilized", "fp8-s1", "fp8-s256", "fp8-s448")
_KERNELS_AFTER = "bf16-autocast"
# The order in which facts are relaxed where no recipe models all of them together: the user's declarations
# first, the stored dtype's precision last.
_RELAX_ORDER = ("softmax", "kernel", "device", "precision")


@dataclass(frozen=True)
class Traits:
    """What a recipe computes, on the axes a dump's facts record."""

    precision: str  # bf16 | fp16 | fp8 | fp32 | recorded (a plain-ops recipe takes the layer's recorded dtypes)
    softmax: str  # standard | stabilized
    # reference (the paper's pure-PyTorch code under autocast) | kernel (a GPU kernel's model) | plain (the recorded
    # op sequence of attention written in torch ops) | reading
    family: str
    device: Optional[str]  # the device type the recipe's arithmetic runs on: cuda, cpu, or None (any)
    entry: Optional[str]  # a kernel model's entry point (sdpa-cudnn, sdpa-efficient, sdpa-flash, flash_attn)


@functools.cache
def traits(preset: str) -> Traits:
    """The traits of a preset (a tile suffix after '@' changes none of them)."""
    base = preset.partition("@")[0]
    cfg = ReplayConfig.preset(base)
    if cfg.plain is not None:  # re-execution runs on this CPU; the emulator's model stands for any device
        return Traits("recorded", cfg.softmax.value, "plain", "cpu" if cfg.plain_reexec else None, None)
    if cfg.p_dtype in _FP8 or cfg.input_dtype in _FP8:
        precision = "fp8"
    elif cfg.input_dtype is Precision.FP16:
        precision = "fp16"
    elif cfg.is_low_precision:
        precision = "bf16"
    else:
        precision = "fp32"
    softmax = cfg.softmax.value
    kernel = _KERNELS.get(base)
    if kernel is not None:
        return Traits(precision, softmax, "kernel", kernel.devices[0], kernel.entry)
    if cfg.s_dtype is not Precision.FP32:  # scores rounded below fp32: the reference code under autocast
        # CPU autocast's op lists (exp in bf16) run only on a CPU; CUDA autocast's arithmetic is also what an
        # emulation of it computes on a CPU (the demo trains so)
        return Traits(precision, softmax, "reference", "cpu" if cfg.exp_dtype is not Precision.FP32 else None, None)
    return Traits(precision, softmax, "reading", None, None)


def _precision_excludes(t: Traits, facts: RunFacts) -> Optional[str]:
    """A plain-ops recipe takes the dtypes of the layer's recorded op sequence."""
    if facts.precision is None or t.precision in ("recorded", facts.precision):
        return None
    return f"precision {facts.precision}"


def _softmax_excludes(t: Traits, facts: RunFacts) -> Optional[str]:
    if facts.softmax is None or t.softmax == facts.softmax:
        return None
    return f"softmax {facts.softmax}"


def _device_excludes(t: Traits, facts: RunFacts) -> Optional[str]:
    """A CPU run never ran a GPU kernel, and a GPU run never CPU autocast's arithmetic."""
    if facts.on_gpu is None or t.device is None or (t.device == "cuda") == facts.on_gpu:
        return None
    return f"device {facts.device}"


def _kernel_excludes(t: Traits, facts: RunFacts) -> Optional[str]:
    """A recorded built-in entry point (SDPA, flash_attn, xformers, flex_attention) is never the paper's reference
    code, and runs only its own kernels; custom code may run anything."""
    family = facts.kernel_family
    if family is None or t.family == "reading":
        return None
    if t.family == "kernel" and t.entry in _KERNELS_OF_FAMILY[family]:
        return None
    return f"kernel {facts.kernel}"


def _ops_excludes(t: Traits, facts: RunFacts) -> Optional[str]:
    """A plain-ops recipe replays a recorded op sequence, which only attention written in torch ops has (it is the
    one recipe that needs a fact to be a candidate: without the sequence it would replay an op order the run may
    never have had); a soft-cap in that sequence is applied by no other recipe."""
    if t.family == "plain" and not facts.plain_ops:
        return "no recorded op sequence"
    if t.family != "plain" and facts.softcap:
        return "soft-cap"
    return None


_CHECKS = {"ops": _ops_excludes, "precision": _precision_excludes, "softmax": _softmax_excludes,
           "device": _device_excludes, "kernel": _kernel_excludes}


def exclusions(preset: str, facts: RunFacts, ignore: Sequence[str] = ()) -> list[str]:
    """The recorded facts that rule `preset` out ("device cpu", "precision bf16"); [] when it is a candidate."""
    t = traits(preset)
    return [why for name, check in _CHECKS.items() if name not in ignore and (why := check(t, facts)) is not None]


@dataclass(frozen=True)
class Admission:
    """The candidate recipes of a layer-step, what the facts excluded (with the facts that did), and the facts
    relaxed because no recipe models them together."""

    recipes: list
    excluded: list  # (recipe, [fact, ...]) pairs
    relaxed: tuple[str, ...] = ()


def admit(recipes: Sequence[CandidateRecipe], facts: RunFacts) -> Admission:
    """The recipes the recorded precision, softmax variant, device and kernel allow (all of them when nothing is
    recorded); where none is left, the facts relaxed in `_RELAX_ORDER` until some are."""
    for n in range(len(_RELAX_ORDER) + 1):
        ignore = _RELAX_ORDER[:n]
        kept, excluded = [], []
        for r in recipes:
            why = exclusions(r.preset, facts, ignore)
            (excluded.append((r, why)) if why else kept.append(r))
        if kept:
            relaxed = tuple(name for name in ignore if getattr(facts, name) is not None)
            return Admission(kept, excluded, relaxed)
    return Admission(list(recipes), [])


def admissible(recipes: Sequence[CandidateRecipe], facts: RunFacts) -> list[CandidateRecipe]:
    """`admit(recipes, facts).recipes`."""
    return admit(recipes, facts).recipes


def preferred_accumulation(facts: RunFacts) -> Optional[Accumulation]:
    """Tensor cores on a recorded GPU device, ieee on another recorded device; None when the device is unknown."""
    if facts.on_gpu is None:
        return None
    return Accumulation.TENSOR_CORE if facts.on_gpu else Accumulation.IEEE


def implied(facts: RunFacts, fallback: str) -> tuple[str, Accumulation, str]:
    """(preset, accumulation, why): the recipe the recorded settings imply, for layer-steps whose
    stored O cannot be matched. Torch's SDPA kernels (a recorded source "sdpa", or attention dropout,
    an argument of SDPA) round P̄ once to bf16 and accumulate in fp32 (preset bf16-hw)."""
    acc = preferred_accumulation(facts) or Accumulation.IEEE
    if facts.is_fp32_run:
        return fallback, Accumulation.IEEE, "trained in fp32: the replay shows what bf16 would do on these inputs"
    if facts.precision == "fp8":
        return "fp8-s1", Accumulation.IEEE, "recorded fp8 inputs"
    if facts.softmax == "stabilized":
        preset = "bf16-autocast-cpu-stabilized" if facts.on_gpu is False else "bf16-autocast-stabilized"
        return preset, acc, "recorded stabilized softmax"
    if (facts.has_dropout or facts.kernel_family is not None) and facts.precision in ("bf16", "fp16"):
        return "bf16-hw", acc, f"{facts.precision} SDPA"
    return fallback, acc, "nothing recorded points to another recipe"


def _rank(c, order: int) -> tuple:
    err = c.max_abs_err if c.max_abs_err is not None and math.isfinite(c.max_abs_err) else math.inf
    return c.o_bits_equal, -err, -order


def _best(cands: Sequence[Candidate]) -> Optional[Candidate]:
    if not cands:
        return None
    return max(zip(cands, range(len(cands))), key=lambda pair: _rank(pair[0], pair[1]))[0]


def pick_best(tried: Sequence[Candidate], facts: RunFacts) -> Candidate:
    """The candidate to name: the best under the preferred accumulation model, unless the best under
    the other model reproduces all of the stored O where it does not, or CLEAR_MARGIN more of it. Without a
    preferred model (the device not recorded) the best of all; ties go to the candidate tried first.
    `tried` holds at least one candidate measured on every element."""
    best = _best(tried)
    if best is None:
        raise ValueError("pick_best: no candidate was tried")
    preferred = preferred_accumulation(facts)
    if preferred is None:
        return best
    mine = _best([c for c in tried if Accumulation(c.accumulation) is preferred])
    other = _best([c for c in tried if Accumulation(c.accumulation) is not preferred])
    if mine is None or other is None:  # one accumulation model only: its best is the best of all
        return best
    exact = other.o_bits_equal == 1.0 and mine.o_bits_equal < 1.0
    return other if exact or other.o_bits_equal - mine.o_bits_equal >= CLEAR_MARGIN else mine


def why_not_named(best, other, facts: RunFacts) -> Optional[str]:
    """Why `other`, which reproduces more of the stored O than `best`, is not the one named (None when it does
    not reproduce more)."""
    if other.o_bits_equal <= best.o_bits_equal:
        return None
    preferred = preferred_accumulation(facts)
    if preferred is not None and Accumulation(other.accumulation) is not preferred:
        return (f"the recorded device {facts.device} implies {preferred.value} accumulation; {other.accumulation} is "
                f"named only where it reproduces every element or {100 * CLEAR_MARGIN:g} % more")
    return None


def candidate_recipes(head_dim: int = 64, n_keys: int = 1024, dtype: str = "bfloat16",
                      on_gpu: Optional[bool] = None) -> list[CandidateRecipe]:
    """Every preset in `_PRESET_ORDER` (then any other non-stochastic one), each under ieee and
    tensor-core; tensor-core is left out where no product has low-precision operands (it would
    fall back to ieee and repeat the same replay). The hardware kernels' recipes for a layer of this
    head dim, key count and stored dtype (with their tiles, tensor-core only: they model tensor-core
    kernels) come after the reference code's on a GPU run, last on any other."""
    names = list(_PRESET_ORDER) + [n for n in PRESETS if n not in _PRESET_ORDER and n != "stochastic"
                                   and n not in _KERNELS]
    kernels = [CandidateRecipe(k, Accumulation.TENSOR_CORE.value) for k in kernel_presets(head_dim, n_keys, dtype)]
    recipes = []
    for name in names:
        cfg = ReplayConfig.preset(name)
        recipes.append(CandidateRecipe(name, Accumulation.IEEE.value))
        if cfg.input_dtype is not Precision.FP32 and cfg.plain is None:  # a plain recipe's GEMMs are the CPU's
            recipes.append(CandidateRecipe(name, Accumulation.TENSOR_CORE.value))
        if name == _KERNELS_AFTER and on_gpu:
            recipes += kernels
    return recipes if on_gpu else recipes + kernels


def catalogue(t, facts: RunFacts) -> list[CandidateRecipe]:
    """Every recipe for one loaded layer-step (its head dim, key count and stored O dtype), in search order."""
    dtype = str((t.o if t.o is not None else t.q).dtype).replace("torch.", "")
    return candidate_recipes(t.q.shape[-1], t.k.shape[-2], dtype, facts.on_gpu)


def layer_candidates(t, facts: RunFacts, accumulation: Optional[str] = None) -> Admission:
    """The recipes of the layer-step's catalogue that its recorded facts admit, under `accumulation` only when
    given."""
    return admit([r for r in catalogue(t, facts) if accumulation is None or r.accumulation == accumulation], facts)
