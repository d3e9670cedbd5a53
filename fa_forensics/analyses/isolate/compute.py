"""isolate: which single repair removes the δ error? (paper §3.2, Claim 1)

Each (step, layer) is replayed once per variant with all selected heads batched: the low-precision
baseline and single repairs of it, each compared with the high-precision replay (preset "fp32") of
the same stored inputs. Per variant and head: the O bias (signed mean of O_var − O_hp ± se), the O
RMSE, Σ_T(δ_var − δ_hp), and the gradient errors ‖dQ_var − dQ_hp‖ and ‖dW_Q,var − dW_Q,hp‖.

Baseline and preset: the baseline is the recipe's low-precision config at the layer-step exactly as
every other analysis replays it (default preset "auto": the recipe that reproduces the stored O), tiles
included (bf16-autocast 512 x 512, bf16-hw 128 x 64, fp8-* 64 x 64; bf16, stabilized and stochastic are
untiled), so its Σ(δ_lp − δ_hp) per (step, layer, head) is the shared number of `analyses.quantities`.
The "no-tiling" repair sets block = sequence (the baseline itself under an untiled preset); every other
repair keeps the baseline's tiling. What each repair changes, derived from the preset with dataclasses.replace:
  - o-fp32:    the whole O path fp32: pv_dtype, rescale_dtype and o_dtype (for bf16-autocast the
               bf16 accumulator too; S, m and ℓ stay as the preset has them);
  - pv-fp32:   the P̄V product and its running accumulator fp32 (pv_dtype and rescale_dtype), O still
               stored in the preset's o_dtype: the hardware kernels' reading (bf16-hw already is);
  - stabilized, stochastic, delta-*: one knob each (softmax, rounding, delta source).
A repair that changes nothing under the preset (pv-fp32 under bf16-hw or fp8-*, stabilized under
"stabilized", ...) is kept in the table, marked "(= baseline under this preset)", and can never be
a culprit (its residual equals the baseline's).

Gradient errors use the paper's Eq. 1, exact when the two backward passes differ only in δ (the
§3.2 setting: an fp32 backward on the same inputs): dQ_var − dQ_hp = −α·diag(δ_var − δ_hp)·(P K),
dW_Q = dQᵀX, with P the fp32 attention matrix. δ itself comes from O (δ = rowsum(dO ∘ O), float64)
for forward repairs; the two backward repairs (δ from O recomputed, δ = rowsum(dP ∘ P)) run the
replay's backward and take its δ.

Culprits: the bias to remove is the baseline's Σ_T(δ_lp − δ_hp) in the (step, layer, head) items where
it is significant by the statistics policy (`analyses.significance`: Holm over the selection's family at
α = 0.01, and the effect floor; items with only noise define no bias). A repair's residual is its own Σδ
error projected on the baseline's sign per biased item, with its standard error (the items' in quadrature);
it is a culprit when the residual is at most 10% of the baseline's (reduction ≥ 0.9), or when it removes at
least half and what is left is not significant (Holm over the repairs tested, α = 0.01, and the effect floor, in
the biased items' rounding units): the rule by which fix-check says a fix removes a bias. With no biased item there
are no culprits.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch
from scipy.stats import norm

from fa_forensics.analyses.contract import RecipeResult, common_keys, recipe_keys, run_over_items
from fa_forensics.analyses.primitives import delta_error, delta_of, pk_rows
from fa_forensics.analyses.quantities import (BiasClaim, DeltaItem, count_text, decide_deltas, delta_claim,
                                              delta_units, family_of, flagged_subset, item_text, items_of_errors,
                                              run_biased_heads, run_claim_text, total_of)
from fa_forensics.analyses.significance import Family, effect, holm, removes, significant
from fa_forensics.analyses.units import layer_units
from fa_forensics.layers.fanout import Workers, layer_parts
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.planner import plan_for_layers
from fa_forensics.fidelity.recipe import FALLBACK_PRESET, Recipe, hp_config
from fa_forensics.fidelity.match import ReplayFidelity
from fa_forensics.enums import Backend
from fa_forensics.layers.selection import LayerSelection, LayerTensors, as_seen_by, replay_layer
from fa_forensics.fidelity.pair import input_cast_error
from fa_forensics.analyses.stats import sign_test
from fa_forensics.analyses.payloads import IsolatePayload
from fa_forensics.errors import DumpError, UserError
from fa_forensics.enums import (
    BackwardKernel, DeltaSource, Precision, Rounding, Softmax,
)
from fa_forensics.replay.config import ReplayConfig

Progress = Optional[Callable[[str], None]]


@dataclass(frozen=True)
class Repair:
    """One replay of the isolation table: a name, what it changes, its config, whether δ needs the backward."""

    name: str
    description: str
    config: ReplayConfig
    backward: bool


def baseline_config(T: int, lp: ReplayConfig = ReplayConfig()) -> ReplayConfig:
    """The baseline: the low-precision config as the recipe replays it everywhere (its own tiles, or none)."""
    return lp


def variants(T: int, lp: ReplayConfig = ReplayConfig(), preset: str = FALLBACK_PRESET) -> list[Repair]:
    """The baseline (`lp`, the low-precision config named `preset`, tiled) and its single repairs, in
    the order of the paper's §3.2."""
    base = baseline_config(T, lp)
    fp32 = Precision.FP32
    delta_base, delta_note = base, ""
    if base.backward_kernel is not BackwardKernel.REFERENCE:  # a kernel's backward fixes δ: the knob needs ours
        delta_base = base.with_reference_backward()
        delta_note = f" (the emulator's reference backward: {base.backward_kernel.value}'s own fixes δ)"
    # The kernel models (exp form, row sum, 1/ℓ, split-KV, MMA groups) describe the hardware kernel's standard
    # softmax with nearest-even casts: the stabilized and stochastic repairs run on the same tiles without them.
    plain, plain_note = base, ""
    if base.is_kernel_model:
        plain = base.without_kernel_model()
        plain_note = " (on the kernel's tiles, without its exp, row-sum and 1/ℓ model)"
    o_dt = base.o_dtype.value
    tiles = f"{base.block_m or T}x{base.block_n or T} tiles"
    repairs = [
        ("no-tiling", "block = sequence length", base.with_(block_m=None, block_n=None), False),
        ("o-fp32", "O path in fp32 (P̄V product, accumulator and stored O)",
         base.with_(pv_dtype=fp32, rescale_dtype=fp32, o_dtype=fp32), False),
        ("delta-o-recomputed", "δ from O recomputed as P̄V/ℓ in fp32 in the backward" + delta_note,
         delta_base.with_(delta=DeltaSource.O_RECOMPUTED), True),
        ("delta-dp-p", "δ = rowsum(dP ∘ P)" + delta_note, delta_base.with_(delta=DeltaSource.DP_P), True),
        ("pv-fp32", f"P̄V product and accumulator in fp32 (O still stored {o_dt})",
         base.with_(pv_dtype=fp32, rescale_dtype=fp32), False),
        *([("stats-fp32", "row max m and row sum ℓ kept in fp32", base.with_(stats_dtype=fp32), False)]
          if base.stats_dtype is not fp32 else []),
        *([("scores-fp32", "scores S = α·q·kᵀ kept in fp32", base.with_(s_dtype=fp32), False)]
          if base.s_dtype is not fp32 else []),
        *([("p-fp32", "normalized P kept in fp32 before P·V (attention written in torch ops)",
            base.with_(p_dtype=fp32), False)] if base.plain is not None and base.p_dtype is not fp32 else []),
        ("stabilized", f"stabilized softmax (Algorithm 3, β={base.beta:g})" + plain_note,
         plain.with_(softmax=Softmax.STABILIZED), False),
        ("stochastic", "stochastic rounding of the P̄, P̄V and O casts" + plain_note,
         plain.with_(rounding=Rounding.STOCHASTIC), False),
    ]
    out = [Repair("baseline", f"preset {preset}, " + (tiles if lp.block_n is not None else "untiled"), base, False)]
    for name, what, cfg, backward in repairs:
        same = cfg == base and not backward
        out.append(Repair(name, what + (" (= baseline under this preset)" if same else ""), cfg, backward))
    return out


# ---- pure per-head measurements -----------------------------------------------------------------

@dataclass(frozen=True)
class HeadMeasure:
    """Sums for one variant on one (step, layer, head), combined later across heads and steps."""

    n_o: int
    o_err_sum: float
    o_err_sumsq: float
    delta_err_sum: float
    dq_err_sq: float
    dwq_err_sq: Optional[float]


def measure_heads(
    o_var: torch.Tensor,
    o_hp: torch.Tensor,
    dd: torch.Tensor,
    pk: torch.Tensor,
    x: Optional[torch.Tensor],
    scale: float,
) -> list[HeadMeasure]:
    """Per head: sums of the O error and its square, Σδ error, ‖dQ error‖², ‖dW_Q error‖² (Eq. 1-2).

    o_var, o_hp (B, h, T, D); dd = δ_var − δ_hp (B, h, T); pk (B, h, T, D); x (B, T, C) or None.
    """
    err = o_var.to(torch.float64) - o_hp.to(torch.float64)  # (B, h, T, D)
    dq = -scale * dd.unsqueeze(-1) * pk  # (B, h, T, D): dQ_var − dQ_hp
    dq_sq = (dq**2).sum(dim=(0, 2, 3))  # (h,)
    dwq_sq = None
    if x is not None:
        dwq = torch.einsum("bhtd,btc->hdc", dq, x.to(torch.float64))  # (h, D, C)
        dwq_sq = (dwq**2).sum(dim=(1, 2))
    out = []
    for j in range(err.shape[1]):
        e = err[:, j]
        out.append(HeadMeasure(
            n_o=e.numel(), o_err_sum=float(e.sum()), o_err_sumsq=float((e * e).sum()),
            delta_err_sum=float(dd[:, j].sum()), dq_err_sq=float(dq_sq[j]),
            dwq_err_sq=None if dwq_sq is None else float(dwq_sq[j]),
        ))
    return out


# ---- results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RepairResult:
    name: str
    description: str
    o_bias: float  # mean of O_var − O_hp over every selected element
    o_bias_se: float
    o_rmse: float
    delta_err_sum: float  # Σ of its (step, layer, head) items' Σ_T (δ_var − δ_hp) (`quantities.total_of`)
    delta_err_se: float  # its standard error (the items' in quadrature)
    delta_err_residual: float  # |Σ over biased items of sign(baseline's Σδ)·Σ_T (δ_var − δ_hp)|
    reduction: float  # 1 − residual / Σ over biased items of |baseline's Σδ|: share of the bias removed
    residual_se: float  # standard error of the residual (the biased items' in quadrature)
    residual_p: float  # two-sided normal p of the residual, Holm over the repairs (nan for the baseline)
    delta_p_value: float  # sign test over tokens of δ_var − δ_hp
    dq_err: float  # ‖dQ_var − dQ_hp‖_F over the selection (Eq. 1)
    dwq_err: Optional[float]  # ‖dW_Q,var − dW_Q,hp‖_F (per head D x C blocks), None without X
    residual_effect: float = math.nan  # the residual in rounding units (Σ of the biased items' units)


@dataclass(frozen=True)
class LayerDelta:
    layer: int
    delta_err_sum: float  # Σ over steps and heads of the baseline's Σ_T (δ_lp − δ_hp)
    delta_err_abs: float  # Σ over (step, head) of |Σ_T (δ_lp − δ_hp)|


@dataclass(frozen=True)
class IsolateResult(RecipeResult):
    variants: list[RepairResult]
    heads: list[DeltaItem]  # the baseline's (step, layer, head) items, decided; most significant first
    layers: list[LayerDelta]  # largest delta_err_abs first
    culprits: list[str]  # repairs that remove the baseline's significant Σδ error (`removes`)
    baseline_block: int
    n_biased_heads: int  # (step, layer, head) items whose baseline Σδ error is significant (`significance`)
    recipe: Recipe  # the low-precision side the baseline and repairs derive from
    backend: Backend
    baseline_tiles: tuple = (0, 0)  # (block_m, block_n) of the baseline
    input_cast: Optional[RepairResult] = None  # the recipe's input cast alone (None when it changes nothing)
    family: Family = Family()
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None

    @property
    def biased(self) -> list[DeltaItem]:
        return [h for h in self.heads if h.found]

    @property
    def claim(self) -> BiasClaim:
        return delta_claim(self.heads, self.family)


def run(
    dump,
    selections: Sequence[LayerSelection],
    recipe: Recipe | Plan = Recipe(),
    backend: Backend = Backend.EMULATE,
    *,
    progress: Progress = None,
    workers: Workers = Workers(),
) -> IsolateResult:
    """Replay every selected layer-step under the baseline (the recipe) and each single repair; rank
    heads and layers by the baseline's Σδ error; name the repairs that remove ≥ 90% of it. Work items
    are (step, layer, head group), on `workers`, reduced in item order (the same result for any N);
    `progress` is called once per item."""
    family = family_of(dump, selections)
    return run_over_items(layer_part, lambda parts, r: combine_parts(parts, r, backend, family), dump, selections,
                          recipe, backend, workers=workers, progress=progress)


def isolate_layers(
    layers: Iterable[LayerTensors],
    recipe: Recipe = Recipe(),
    backend: Backend = Backend.EMULATE,
    *,
    progress: Progress = None,
) -> IsolateResult:
    """`run` on layer-steps already loaded (or built in memory)."""
    layers = list(layers)
    plan = plan_for_layers(layers, recipe)
    return combine_parts(layer_parts(layer_part, layers, (plan, backend), progress), plan.recipe, backend,
                         family_of(None, (), layers))


@dataclass(frozen=True)
class IsolatePart:
    """What one layer-step (or head group of it) contributes: per-head measures and δ errors of every
    variant, and of the input cast alone when the recipe rounds the stored inputs."""

    warnings: tuple[str, ...]
    variants: list  # [Repair] in order
    tiles: tuple[int, int]
    measures: dict  # variant name -> [HeadMeasure]
    signs: dict  # variant name -> δ error (flattened)
    items: dict  # variant name -> [DeltaItem] (`quantities.items_of_errors`, in the baseline's rounding units)
    cast_measures: list
    cast_sign: Optional[torch.Tensor]
    cast_items: list


def layer_part(t: LayerTensors, plan: Plan, backend: Backend) -> IsolatePart:
    """Replay one layer-step (its selected heads) under the baseline and every single repair."""
    if t.do is None:
        raise DumpError(f"{t.where}: the dump has no 'do' array; isolate needs dO to compute δ")
    planned = plan.at(t.step, t.layer)
    lp = planned.lp
    pk = pk_rows(t.q, t.k, t.scale, t.causal, t.mask)  # (B, h, T, D) from the stored inputs
    cast_only = input_cast_error(t, lp, backend)  # (O_fp32 stored inputs, O_fp32 cast inputs) or None
    fmt = lp.o_dtype.value
    cast_measures, cast_sign, cast_items = [], None, []
    if cast_only is not None:
        o_raw, o_cast = cast_only
        dd_cast = delta_error(t.do, o_cast, o_raw)
        cast_measures = measure_heads(o_cast, o_raw, dd_cast, pk, t.x, t.scale)
        cast_sign = dd_cast.reshape(-1)
    t = as_seen_by(t, lp)  # every replay below sees the inputs as the recipe does
    row_units = layer_units(t, lp)  # the independent units of the rows (every variant's tests count them)
    if cast_only is not None:
        cast_items = items_of_errors(t.step, t.layer, t.heads, dd_cast, delta_units(t.do, o_raw, fmt), row_units)
    vs = variants(t.q.shape[2], lp, planned.preset)
    tiles = (vs[0].config.block_m or t.q.shape[2], vs[0].config.block_n or t.q.shape[2])
    hp = replay_layer(t, planned.hp, backward=False, backend=backend)
    delta_hp = delta_of(t.do, hp.o)  # (B, h, T)
    units = delta_units(t.do, hp.o, fmt)  # (B, h, T): every variant's Σδ in the baseline's rounding units
    base_o, measures, signs, items = None, {}, {}, {}
    for v in vs:
        out = replay_layer(t, v.config, backward=v.backward, backend=backend)
        if v.name == "baseline":
            base_o = out.o
        if v.backward:  # backward repairs: forward O is the baseline's, δ is the replay's own
            o_var, dd = base_o, out.delta.to(torch.float64) - delta_hp
        else:
            o_var, dd = out.o, delta_error(t.do, out.o, hp.o)
        measures[v.name] = measure_heads(o_var, hp.o, dd, pk, t.x, t.scale)
        signs[v.name] = dd.reshape(-1)
        items[v.name] = items_of_errors(t.step, t.layer, t.heads, dd, units, row_units)
    return IsolatePart(t.warnings, vs, tiles, measures, signs, items, cast_measures, cast_sign, cast_items)


def combine_parts(parts: Sequence[IsolatePart], recipe: Recipe, backend: Backend, family: Family) -> IsolateResult:
    """The result of the parts of every selected layer-step, reduced in their order."""
    warnings: list[str] = []
    measures: dict[str, list[HeadMeasure]] = {}
    signs: dict[str, list[torch.Tensor]] = {}
    items: dict[str, list[DeltaItem]] = {}
    cast_measures: list[HeadMeasure] = []
    cast_signs: list[torch.Tensor] = []
    cast_items: list[DeltaItem] = []
    tiles, vs = (0, 0), []
    for part in parts:
        warnings.extend(w for w in part.warnings if w not in warnings)
        vs, tiles = part.variants, part.tiles
        for name, hm in part.measures.items():
            measures.setdefault(name, []).extend(hm)
            signs.setdefault(name, []).append(part.signs[name])
            items.setdefault(name, []).extend(part.items[name])
        cast_measures.extend(part.cast_measures)
        cast_items.extend(part.cast_items)
        if part.cast_sign is not None:
            cast_signs.append(part.cast_sign)
    if not vs:
        raise UserError("isolate: nothing selected to replay (no layer-step given)")

    heads = decide_deltas(items["baseline"], family)  # in measure order
    # the bias to remove: the heads whose Σδ bias holds for the run (pooled over steps where there are several), in
    # its sign, at every step of the head
    biased = run_biased_heads(heads, family)
    direction = [float(biased.get((h.layer, h.head), 0)) for h in heads]
    base_bias = max(sum(d * h.delta_err_sum for d, h in zip(direction, heads)), 0.0)
    results = _decide_residuals([_combine(v, measures[v.name], items[v.name], torch.cat(signs[v.name]), direction,
                                          base_bias) for v in vs])
    input_cast = None
    if cast_measures:
        what = Repair("input-cast", f"the recipe's rounding of the stored inputs to {vs[0].config.input_dtype.value} "
                                     "(fp32 replays of stored vs rounded inputs; not a kernel error)",
                      hp_config(), False)
        input_cast = _combine(what, cast_measures, cast_items, torch.cat(cast_signs), [0.0] * len(cast_measures), 0.0)
    culprits = [r.name for r in results if r.name != "baseline" and base_bias > 0 and culprit(r)]
    ranked = sorted(heads, key=lambda h: (h.adjusted_p, h.tested_p, -abs(h.delta_err_sum)))
    return IsolateResult(results, ranked, _rank_layers(ranked), culprits, int(tiles[1]),
                         sum(h.found for h in heads), recipe, Backend(backend), tuple(int(b) for b in tiles),
                         input_cast, family, tuple(warnings))


def culprit(r: RepairResult) -> bool:
    """The repair removes the baseline's bias (`significance.removes`; what is left is significant by the one rule:
    its Holm p over the repairs below α and at least the effect floor)."""
    return removes(r.reduction, significant(r.residual_p, r.residual_effect))


def _decide_residuals(results: list[RepairResult]) -> list[RepairResult]:
    """The repairs' residual p-values adjusted by Holm over the repairs (the baseline is not a test)."""
    tested = [r for r in results if r.name != "baseline" and math.isfinite(r.residual_p)]
    adjusted = dict(zip((r.name for r in tested), holm([r.residual_p for r in tested], len(tested))))
    return [replace(r, residual_p=adjusted.get(r.name, math.nan)) for r in results]


def _combine(v: Repair, hm: list[HeadMeasure], items: list[DeltaItem], dd_all: torch.Tensor, direction: list[float],
             base_bias: float) -> RepairResult:
    n = sum(m.n_o for m in hm)
    s = sum(m.o_err_sum for m in hm)
    ss = sum(m.o_err_sumsq for m in hm)
    mean = s / n
    var = max(ss / n - mean * mean, 0.0) * n / max(n - 1, 1)
    signed = sum(d * i.delta_err_sum for d, i in zip(direction, items))
    residual_se = math.sqrt(sum(i.delta_err_se ** 2 for d, i in zip(direction, items) if d and
                                math.isfinite(i.delta_err_se)))
    residual_p = float(2 * norm.sf(abs(signed) / residual_se)) if residual_se > 0 else math.nan
    residual_unit = sum(i.unit for d, i in zip(direction, items) if d)
    dwq = None if any(m.dwq_err_sq is None for m in hm) else sum(m.dwq_err_sq for m in hm) ** 0.5
    total = total_of(items)
    return RepairResult(
        name=v.name, description=v.description, o_bias=mean, o_bias_se=(var / n) ** 0.5,
        o_rmse=(ss / n) ** 0.5, delta_err_sum=total.value, delta_err_se=total.se,
        delta_err_residual=abs(signed), reduction=1.0 - abs(signed) / base_bias if base_bias > 0 else float("nan"),
        residual_se=residual_se, residual_p=residual_p,
        delta_p_value=sign_test(dd_all).p_value, dq_err=sum(m.dq_err_sq for m in hm) ** 0.5, dwq_err=dwq,
        residual_effect=effect(abs(signed), residual_unit),
    )


def _rank_layers(heads: list[DeltaItem]) -> list[LayerDelta]:
    by: dict[int, list[float]] = {}
    for h in heads:
        by.setdefault(h.layer, []).append(h.delta_err_sum)
    out = [LayerDelta(l, sum(v), sum(abs(x) for x in v)) for l, v in by.items()]
    return sorted(out, key=lambda l: -l.delta_err_abs)



def verdict(r: IsolateResult) -> str:
    """One sentence: where the baseline's Σδ bias is significant (what the count counts), the most significant
    item, and the repairs that remove it."""
    top = flagged_subset(r.heads)
    n = r.family.n_tests
    run = run_claim_text(r.heads, r.family)
    if r.n_biased_heads == 0 and not r.claim.found:
        return (f"{run}no significant Σ(δ_lp − δ_hp) in any of the {len(r.heads)} (step, layer, head) items (most "
                f"significant: {item_text(top, n)}); nothing to isolate")
    names = ", ".join(r.culprits) if r.culprits else "none"
    fixes = ("repairs that remove it (≥ 90 %, or ≥ 50 % leaving nothing significant): " + names if r.claim.found
             else "no bias of the run to isolate")
    at = "at single steps, " if run else ""
    return (f"{run}{at}Σ(δ_lp − δ_hp) is significant in {count_text(r.biased)} ({r.n_biased_heads} of {len(r.heads)} "
            f"(step, layer, head) items); most significant: {item_text(top, n)}; {fixes}")


def bias_claim(r: IsolateResult) -> BiasClaim:
    """The most significant (step, layer, head) item of the baseline, decided by the policy."""
    return r.claim


def payload(r: IsolateResult) -> IsolatePayload:
    """The --json payload (keys documented in docs/json.md)."""
    return {
        "variants": r.variants, "heads": r.heads, "layers": r.layers, "culprits": r.culprits,
        "baseline_block": r.baseline_block, "baseline_tiles": list(r.baseline_tiles),
        "n_biased_heads": r.n_biased_heads, "input_cast": r.input_cast, "bias": bias_claim(r),
        "family": r.family.as_dict(),
        **recipe_keys(r.recipe, r.backend), **common_keys(r), "verdict": verdict(r),
    }
