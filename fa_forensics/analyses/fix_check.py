"""fix-check: does the stabilized softmax (paper §4, Algorithm 3) remove the bias, and do the
alternatives (App. C's fixed offset, stochastic rounding, P̄V in fp32)?

Every variant is the recipe's low-precision config (default preset "bf16" = `ReplayConfig()`; e.g.
"bf16-autocast", the paper's reference code, or "bf16-hw", hardware kernels) with one change, derived by dataclasses.replace and keeping the preset's tiling, replayed forward
only and compared with the fp32 replay of the same stored inputs:
  - baseline:      the preset unchanged;
  - stabilized:    softmax = stabilized (β, ε): m = β·r_m (r_m > 0) or 0 (r_m < 0) in rows whose
                   maximum is repeated (within ε), so max P̄ < 1 there;
  - fixed-offset:  m = rowmax + offset in every row (App. C): the largest P̄ is e^(−offset), a
                   constant that the bf16 cast rounds the same way every time (for offset 1:
                   e^(−1) = 0.36788 → 0.36719, −0.19 %), so with same-sign V the bias comes back;
  - stochastic:    stochastic rounding of the P̄ and O casts (the blog's fix);
  - fp32-pv:       the P̄V product and its running accumulator kept in fp32 (pv_dtype and
                   rescale_dtype; the latter matters for bf16-autocast, whose accumulator is bf16);
                   under bf16-hw and fp8-* this is the baseline itself (they already accumulate in fp32).
Scores for the "repeated maximum" counts and max P̄ follow the preset's s_dtype (bf16 under
bf16-autocast, where scores within a bf16 ulp of the row max tie exactly).

The bias is measured where the baseline is most biased: the (layer, head, feature) cell with the
largest |mean(O_lp − O_hp)| among the cells whose sign test passes Bonferroni at 0.01 (else the
cell with the largest |z|). Each variant reports, in that cell, the mean O error ± se and its
sign-test p-value, and in that head Σ_T(δ_v − δ_hp) ± se with δ = rowsum(dO ∘ O) (exactly the
backward's δ for O_lp; no backward pass is run).

Verdict rule (exit code of the command): the fix removes the bias (0) when the baseline bias is
significant (p < 0.01), the fixed replay has no NaN, and either bias_reduction = |baseline bias| /
|fixed bias| ≥ 10 or the fixed bias is not significant (p ≥ 0.01). No significant baseline bias:
nothing to remove (0). Otherwise 1. An alternative is "still biased" when its bias in the target
cell is significant (p < 0.01).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fa_forensics.analyses.bitdiff import BiasCell, LayerStepDiff, compare_layer_step, summarize
from fa_forensics.analyses.contract import BiasClaim, claim, common_keys, recipe_keys, replay_fidelity
from fa_forensics.analyses.fanout import Workers, map_layers
from fa_forensics.analyses.recipe import FALLBACK_PRESET, Backend, Recipe, hp_config, preset_at, resolve
from fa_forensics.analyses.selection import LayerSelection, LayerTensors, as_seen_by, lp_of, replay_layer
from fa_forensics.replay.config import Precision, ReplayConfig, Rounding, Softmax

ALPHA = 0.01
MIN_REDUCTION = 10.0


@dataclass(frozen=True)
class FixVariant:
    """One replay configuration of the fix check."""

    name: str
    role: str  # "baseline" | "fixed" | "alternative"
    config: ReplayConfig
    what: str  # one line for tables


def fix_variants(base: ReplayConfig = ReplayConfig(), preset: str = FALLBACK_PRESET, *, beta: float = 2.0, eps: float = 1e-3,
                 offset: float = 1.0) -> list[FixVariant]:
    """Baseline (`base`, the low-precision config named `preset`), the stabilized fix and the
    alternatives, in that order."""
    fp32 = Precision.FP32
    return [
        FixVariant("baseline", "baseline", base, f"preset {preset}"),
        FixVariant("stabilized", "fixed", base.with_(softmax=Softmax.STABILIZED, beta=beta, eps=eps),
                f"stabilized softmax β={beta:g}, ε={eps:g}"),
        FixVariant("fixed-offset", "alternative", base.with_(softmax=Softmax.FIXED_OFFSET, offset=offset),
                f"m = rowmax + {offset:g} (App. C)"),
        FixVariant("stochastic", "alternative", base.with_(rounding=Rounding.STOCHASTIC), "stochastic rounding of P̄ and O casts"),
        FixVariant("fp32-pv", "alternative", base.with_(pv_dtype=fp32, rescale_dtype=fp32), "P̄V product and accumulator in fp32"),
    ]


@dataclass(frozen=True)
class VariantLayerStep:
    """What one variant gave on one layer-step (merged across steps by `summarize_fix`)."""

    diff: LayerStepDiff  # O_v vs O_hp sufficient statistics
    delta_err: Optional[torch.Tensor]  # (B, h, T) fp64 δ_v − δ_hp, None without dO
    max_abs_err: float
    nan_count: int
    p_zeroed: int
    p_one_count: int
    stabilized_rows: int
    repeated_max_rows: int
    max_p_bar_repeated: float  # max P̄ in rows with a repeated maximum (nan when none)


def measure_variant(o_v: torch.Tensor, o_hp: torch.Tensor, do: Optional[torch.Tensor], stats, *, step: int, layer: int,
                    heads: list[int], max_p_bar_repeated: float = math.nan) -> VariantLayerStep:
    """Compare one variant's O (B, h, T, D) with the fp32 replay's; δ error from dO when given."""
    v64, h64 = o_v.to(torch.float64), o_hp.to(torch.float64)
    diff = compare_layer_step(o_v, o_hp, step=step, layer=layer, heads=heads, top_k=0)
    delta_err = None
    if do is not None:
        delta_err = (do.to(torch.float64) * (v64 - h64)).sum(dim=-1)  # (B, h, T) δ_v − δ_hp
    err = (v64 - h64).abs()
    t = stats.total()
    return VariantLayerStep(
        diff=diff, delta_err=delta_err,
        max_abs_err=float(err.nan_to_num(0.0).max()) if err.numel() else 0.0,
        nan_count=int(torch.isnan(v64).sum()), p_zeroed=t["p_zeroed"], p_one_count=t["p_one_count"],
        stabilized_rows=t["stabilized_rows"], repeated_max_rows=t["repeated_max_rows"],
        max_p_bar_repeated=max_p_bar_repeated,
    )


def scores_fp32(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, s_dtype: str = "fp32",
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S = α·q·kᵀ (B, h, T, T) held in fp32, formed as the replay forms them
    (`replay.emulate.forward.scaled_scores`, ieee accumulation, one block); causal positions −inf,
    and the recorded attn_mask `mask` (broadcastable to (B, h, T, T)) applied as the replay applies it.
    Exact ties (identical keys) stay exact ties.

    With s_dtype below fp32 (bf16-autocast: "bf16") the scores are read as that preset computes
    them: S = round(q·kᵀ), s = round(S·α), nearest-even (values exact in s_dtype).
    """
    from fa_forensics.replay.emulate.forward import scaled_scores

    config = ReplayConfig(s_dtype=s_dtype)
    return scaled_scores(q.to(torch.float32), k.to(torch.float32), config, scale, causal, 0, 0, mask=mask)


def max_p_bar_in_repeated_rows(s: torch.Tensor, config: ReplayConfig) -> float:
    """Max P̄ (after the P̄ cast) over rows whose maximum score is attained more than once.

    Untiled, on the scores s (B, h, T, T) from `scores_fp32`: r_m = rowmax S; the shift m is the
    replay's own rule for one block (`replay.emulate.softmax.block_shift`: standard r_m; stabilized
    β·r_m or 0 where the maximum repeats within ε, Algorithm 3; fixed offset r_m + offset); the row's
    largest P̄ is cast(exp(r_m − m)). nan when no row has a repeated maximum.
    """
    from fa_forensics.numerics import exp_fp32, round_to
    from fa_forensics.replay.emulate.softmax import block_shift

    r_m = s.amax(dim=-1)  # (B, h, T)
    repeated = ((s == r_m[..., None]).sum(dim=-1) > 1) & (r_m > -math.inf)  # a row that sees no key has no maximum
    if not bool(repeated.any()):
        return math.nan
    m = block_shift(torch.full_like(r_m, -math.inf), s, config).m  # the replay's own shift rule, one block
    shift = r_m - m
    if config.s_dtype is not Precision.FP32:  # s − m is computed in the scores' dtype (autocast)
        shift = round_to(shift, config.s_dtype.value).to(torch.float32)
    p_max = exp_fp32(shift[repeated])  # (n,) fp32, the emulator's exp
    fmt = config.p_dtype.value
    p_max = p_max if fmt == "fp32" else round_to(p_max, fmt)
    return float(p_max.max())


@dataclass(frozen=True)
class VariantResult:
    """One variant's numbers over the whole selection."""

    name: str
    role: str
    what: str
    o_bias: float  # mean (O_v − O_hp) in the target cell
    o_bias_se: float
    o_bias_p: float  # sign test
    delta_err_sum: Optional[float]  # Σ_T (δ_v − δ_hp) in the target head, all steps and batch rows
    delta_err_se: Optional[float]
    delta_p: Optional[float]
    max_abs_err: float  # max |O_v − O_fp32| over the selection
    nan_count: int
    underflow: int  # P̄ entries > 0 zeroed by the cast
    p_one_count: int
    triggered_rows: int  # rows where the stabilized shift fired
    repeated_max_rows: int
    max_p_bar: float  # max P̄ in rows with a repeated maximum
    still_biased: bool  # significant (p < 0.01) bias left in the target cell


@dataclass(frozen=True)
class FixCheckResult:
    """The fix check's answer."""

    target: dict  # {layer, head, feature}
    baseline: VariantResult
    fixed: VariantResult
    alternatives: list[VariantResult]
    bias_reduction: float  # |baseline o_bias| / |fixed o_bias| (inf when the fixed bias is 0)
    max_p_bar: float
    triggered_rows: int
    nan_count: int
    removed: bool
    verdict: str
    exit_code: int
    n_cells: int = 0  # (layer, head, feature) cells the target was picked from
    recipe: Recipe = Recipe()  # the low-precision side every variant derives from
    backend: Backend = Backend.EMULATE
    settings: dict = dataclasses.field(default_factory=dict)  # beta, eps, offset
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[dict] = None

    @property
    def preset(self) -> str:
        return self.recipe.label


def pick_target(cells: list[BiasCell], alpha: float = ALPHA) -> BiasCell:
    """The baseline's most biased cell (see the module docstring)."""
    threshold = alpha / max(len(cells), 1)
    significant = [c for c in cells if c.p_value < threshold]
    if significant:
        return max(significant, key=lambda c: abs(c.mean))
    return max(cells, key=lambda c: abs(c.mean / c.se) if c.se > 0 else 0.0)


def _variant_result(v: FixVariant, parts: list[VariantLayerStep], target: BiasCell) -> VariantResult:
    from fa_forensics.analyses.stats import sign_test, sum_se

    cells = summarize([p.diff for p in parts], v.name, "fp32").mean_signed_error
    cell = next(c for c in cells if (c.layer, c.head, c.feature) == (target.layer, target.head, target.feature))
    dsum = dse = dp = None
    deltas = []
    for p in parts:
        if p.delta_err is not None and p.diff.layer == target.layer and target.head in p.diff.heads:
            deltas.append(p.delta_err[:, p.diff.heads.index(target.head)].reshape(-1))
    if deltas:
        d = torch.cat(deltas)
        s = sum_se(d)
        dsum, dse, dp = s.value, s.se, sign_test(d).p_value
    maxp = [p.max_p_bar_repeated for p in parts if not math.isnan(p.max_p_bar_repeated)]
    return VariantResult(
        name=v.name, role=v.role, what=v.what, o_bias=cell.mean, o_bias_se=cell.se, o_bias_p=cell.p_value,
        delta_err_sum=dsum, delta_err_se=dse, delta_p=dp,
        max_abs_err=max(p.max_abs_err for p in parts), nan_count=sum(p.nan_count for p in parts),
        underflow=sum(p.p_zeroed for p in parts), p_one_count=sum(p.p_one_count for p in parts),
        triggered_rows=sum(p.stabilized_rows for p in parts), repeated_max_rows=sum(p.repeated_max_rows for p in parts),
        max_p_bar=max(maxp) if maxp else math.nan, still_biased=cell.p_value < ALPHA,
    )


def layer_part(t: LayerTensors, recipe: Recipe, backend: Backend, beta: float, eps: float, offset: float):
    """(warnings, the variants, [(variant name, VariantLayerStep)]) of one layer-step (its selected heads)."""
    lp = lp_of(t, recipe)
    t = as_seen_by(t, lp)  # both sides replay the inputs as the recipe sees them
    variants = fix_variants(lp, preset_at(t.source, t.step, t.layer, recipe), beta=beta, eps=eps, offset=offset)
    hp = replay_layer(t, hp_config(), backward=False, backend=backend)
    s = scores_fp32(t.q, t.k, t.scale, t.causal, variants[0].config.s_dtype.value, t.mask)  # (B, h, T, T)
    measured = []
    for v in variants:
        out = replay_layer(t, v.config, backward=False, backend=backend)
        maxp = max_p_bar_in_repeated_rows(s, v.config)
        measured.append((v.name, measure_variant(out.o, hp.o, t.do, out.stats, step=t.step, layer=t.layer,
                                                 heads=list(t.heads), max_p_bar_repeated=maxp)))
    return t.warnings, variants, measured


def summarize_fix(variants: list[FixVariant], parts: dict[str, list[VariantLayerStep]]) -> FixCheckResult:
    """Merge every variant's layer-steps, pick the target cell from the baseline, decide the verdict."""
    base = next(v for v in variants if v.role == "baseline")
    cells = summarize([p.diff for p in parts[base.name]], base.name, "fp32").mean_signed_error
    target = pick_target(cells)
    results = {v.name: _variant_result(v, parts[v.name], target) for v in variants}
    baseline = results[base.name]
    fixed = results[next(v.name for v in variants if v.role == "fixed")]
    alternatives = [results[v.name] for v in variants if v.role == "alternative"]
    reduction = abs(baseline.o_bias) / abs(fixed.o_bias) if fixed.o_bias != 0 else math.inf

    where = f"layer {target.layer} head {target.head} feature {target.feature}"
    numbers = (f"O bias {baseline.o_bias:+.3e} ± {baseline.o_bias_se:.1e} (p={baseline.o_bias_p:.2g}) → "
               f"{fixed.o_bias:+.3e} ± {fixed.o_bias_se:.1e} (p={fixed.o_bias_p:.2g}), reduction {reduction:.1f}x")
    still = [a.name for a in alternatives if a.still_biased]
    broken = [f"{a.name} ({a.nan_count} NaN)" for a in alternatives if a.nan_count]
    tail = f"; still biased: {', '.join(still)}" if still else "; no alternative left a significant bias"
    if broken:
        tail += f"; produced NaN: {', '.join(broken)}"
    if fixed.nan_count:
        removed, verdict = False, f"FIX FAILS: the stabilized replay produced {fixed.nan_count} NaN (β too large?) at {where}"
    elif baseline.o_bias_p >= ALPHA:
        removed, verdict = True, f"NO BIAS TO REMOVE: the baseline shows no significant O bias at {where} ({numbers})"
    elif reduction >= MIN_REDUCTION or fixed.o_bias_p >= ALPHA:
        removed, verdict = True, f"FIX REMOVES THE BIAS at {where}: {numbers}{tail}"
    else:
        removed, verdict = False, f"FIX DOES NOT REMOVE THE BIAS at {where}: {numbers}{tail}"
    return FixCheckResult(
        target={"layer": target.layer, "head": target.head, "feature": target.feature},
        baseline=baseline, fixed=fixed, alternatives=alternatives, bias_reduction=reduction,
        max_p_bar=fixed.max_p_bar, triggered_rows=fixed.triggered_rows, nan_count=fixed.nan_count,
        removed=removed, verdict=verdict, exit_code=0 if removed else 1, n_cells=len(cells),
    )


def run(dump, selections: Sequence[LayerSelection], recipe: Recipe = Recipe(), backend: Backend = Backend.EMULATE, *,
        beta: float = 2.0, eps: float = 1e-3, offset: float = 1.0, progress=None,
        workers: Workers = Workers()) -> FixCheckResult:
    """Run the fix check on every selected layer-step: one batched forward replay per variant plus
    the fp32 replay; δ errors from the stored dO (when present). Work items are (step, layer, head
    group) on `workers`, reduced in item order (the same result for any N)."""
    recipe = resolve(dump, selections, recipe)
    items = map_layers(layer_part, dump, selections, workers, progress, args=(recipe, backend, beta, eps, offset))
    variants: list[FixVariant] = []
    parts: dict[str, list[VariantLayerStep]] = {}
    warnings: list[str] = []
    for warns, variants, measured in items:
        warnings.extend(w for w in warns if w not in warnings)
        for name, m in measured:
            parts.setdefault(name, []).append(m)
    return dataclasses.replace(summarize_fix(variants, parts), recipe=recipe, backend=Backend(backend),
                               settings={"beta": beta, "eps": eps, "offset": offset}, warnings=tuple(warnings),
                               replay_fidelity=replay_fidelity(dump, selections, recipe))


def bias_claim(r: FixCheckResult) -> BiasClaim:
    """The baseline's bias in the target cell (sign test, Bonferroni over the cells it was picked from)."""
    tg = r.target
    return claim("O", r.baseline.o_bias_p, r.n_cells, r.baseline.o_bias, layer=tg["layer"], head=tg["head"], feature=tg["feature"])


def payload(r: FixCheckResult) -> dict:
    """The --json payload (keys documented in the README)."""
    return {
        "target": r.target, "baseline": r.baseline, "fixed": r.fixed, "alternatives": r.alternatives,
        "bias_reduction": r.bias_reduction, "max_p_bar": r.max_p_bar, "triggered_rows": r.triggered_rows,
        "nan_count": r.nan_count, "removed": r.removed, "verdict": r.verdict, "exit_code": r.exit_code,
        "bias": bias_claim(r), **r.settings, **recipe_keys(r.recipe, r.backend), **common_keys(r),
    }
