"""fix-check: does the stabilized softmax (paper §4, Algorithm 3) remove the bias, and do the
alternatives (App. C's fixed offset, stochastic rounding, P̄V in fp32)?

Every variant is the recipe's low-precision config (default preset "auto": per layer-step the one that
reproduces the stored O; e.g. "bf16-autocast", the paper's reference code, or "bf16-hw", hardware kernels) with
one change, derived by dataclasses.replace and keeping the preset's tiling, replayed forward only and compared
with the fp32 replay of the same stored inputs:
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
bf16-autocast, where scores within a bf16 ulp of the row max tie exactly). Max P̄ is taken over the
rows whose maximum repeats within ε, the rows the stabilized shift is meant for.

Collapse of the fix: the stabilized shift m = β·r_m leaves a row sum of about k·e^(−(β−1)·r_m) for
k tied maxima. A preset that clamps block row sums from below (the paper's reference code:
row_sum_floor 1e-10, presets bf16-autocast-train and bf16-autocast-stabilized) then divides by the
floor instead of the row sum once r_m > ln(1/floor)/(β−1) (≈ 23.0 at β = 2): O shrinks by the
factor row sum / floor (0.002 at r_m = 30). Such rows are found from the untiled scores (the fix's
own shift, row sum < floor) and their |O|/|O_fp32| measured on the replay; under a preset without a
floor they are reported as a warning (the reference code would collapse there).

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.analyses.bitdiff.compute import BiasCell, LayerStepDiff, compare_layer_step, summarize
from fa_forensics.analyses.contract import BiasClaim, RecipeResult, claim, common_keys, recipe_keys, replay_fidelity
from fa_forensics.layers.fanout import Workers, map_layers
from fa_forensics.enums import Backend
from fa_forensics.fidelity.auto import resolve
from fa_forensics.fidelity.recipe import FALLBACK_PRESET, Recipe, hp_config, preset_at
from fa_forensics.fidelity.pair import lp_of
from fa_forensics.layers.selection import LayerSelection, LayerTensors, as_seen_by, replay_layer
from fa_forensics.enums import Precision, Rounding, Softmax
from fa_forensics.replay.config import ReplayConfig

ALPHA = 0.01
MIN_REDUCTION = 10.0
REFERENCE_ROW_SUM_FLOOR = 1e-10  # the paper's reference code: block row sums .clamp(min=1e-10)


@dataclass(frozen=True)
class FixVariant:
    """One replay configuration of the fix check."""

    name: str
    role: str  # "baseline" | "fixed" | "alternative"
    config: ReplayConfig
    what: str  # one line for tables


def fix_variants(base: ReplayConfig = ReplayConfig(), preset: str = FALLBACK_PRESET, *, beta: float = 2.0,
                 eps: float = 1e-3, offset: float = 1.0) -> list[FixVariant]:
    """Baseline (`base`, the low-precision config named `preset`), the stabilized fix and the
    alternatives, in that order."""
    fp32 = Precision.FP32
    return [
        FixVariant("baseline", "baseline", base, f"preset {preset}"),
        FixVariant("stabilized", "fixed", base.with_(softmax=Softmax.STABILIZED, beta=beta, eps=eps),
                f"stabilized softmax β={beta:g}, ε={eps:g}"),
        FixVariant("fixed-offset", "alternative", base.with_(softmax=Softmax.FIXED_OFFSET, offset=offset),
                f"m = rowmax + {offset:g} (App. C)"),
        FixVariant("stochastic", "alternative", base.with_(rounding=Rounding.STOCHASTIC),
                   "stochastic rounding of P̄ and O casts"),
        FixVariant("fp32-pv", "alternative", base.with_(pv_dtype=fp32, rescale_dtype=fp32),
                   "P̄V product and accumulator in fp32"),
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
    repeated_rows: int = 0  # rows whose maximum repeats within ε (the rows max P̄ is taken over)
    collapsed_rows: int = 0  # rows whose row sum under the fix's shift is below the row-sum floor
    collapse_max_score: float = math.nan  # largest row maximum among them
    collapse_min_ratio: float = math.nan  # smallest |O_v| / |O_fp32| among them


def measure_variant(o_v: torch.Tensor, o_hp: torch.Tensor, do: Optional[torch.Tensor], stats, *, step: int, layer: int,
                    heads: list[int], max_p_bar_repeated: float = math.nan, repeated_rows: int = 0,
                    collapse: Optional[RowCollapse] = None) -> VariantLayerStep:
    """Compare one variant's O (B, h, T, D) with the fp32 replay's; δ error from dO when given;
    `collapse`: the rows where the row-sum floor takes over, whose |O_v| / |O_fp32| is measured here."""
    v64, h64 = o_v.to(torch.float64), o_hp.to(torch.float64)
    diff = compare_layer_step(o_v, o_hp, step=step, layer=layer, heads=heads, top_k=0)
    delta_err = None
    if do is not None:
        delta_err = (do.to(torch.float64) * (v64 - h64)).sum(dim=-1)  # (B, h, T) δ_v − δ_hp
    err = (v64 - h64).abs()
    t = stats.total()
    n_collapsed, top_score, min_ratio = 0, math.nan, math.nan
    if collapse is not None and bool(collapse.rows.any()):
        n_collapsed = int(collapse.rows.sum())
        top_score = float(collapse.row_max[collapse.rows].max())
        ratio = v64.norm(dim=-1)[collapse.rows] / h64.norm(dim=-1)[collapse.rows]
        min_ratio = float(ratio.nan_to_num(nan=0.0).min())
    return VariantLayerStep(
        diff=diff, delta_err=delta_err,
        max_abs_err=float(err.nan_to_num(0.0).max()) if err.numel() else 0.0,
        nan_count=int(torch.isnan(v64).sum()), p_zeroed=t["p_zeroed"], p_one_count=t["p_one_count"],
        stabilized_rows=t["stabilized_rows"], repeated_max_rows=t["repeated_max_rows"],
        max_p_bar_repeated=max_p_bar_repeated, repeated_rows=repeated_rows,
        collapsed_rows=n_collapsed, collapse_max_score=top_score, collapse_min_ratio=min_ratio,
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


def repeated_within_eps(s: torch.Tensor, config: ReplayConfig) -> torch.Tensor:
    """(B, h, T) bool: rows whose maximum is attained more than once, exactly or within ε by the
    stabilized rule of `config` (Algorithm 3's test, `replay.emulate.softmax.block_shift`, on the
    whole row as one block). These are the rows the fix acts on."""
    from fa_forensics.replay.emulate.softmax import block_shift

    r_m = s.amax(dim=-1)
    exact = (s == r_m[..., None]).sum(dim=-1) > 1
    stabilized = config.with_(softmax=Softmax.STABILIZED)
    fired = block_shift(torch.full_like(r_m, -math.inf), s, stabilized).fired
    return (exact | fired) & (r_m > -math.inf)


@dataclass(frozen=True)
class RowCollapse:
    """Rows of one layer-step where the fix's row sum falls below a row-sum floor."""

    rows: torch.Tensor  # (B, h, T) bool
    row_max: torch.Tensor  # (B, h, T) fp32 row maximum of the scaled scores
    floor: float
    applies: bool  # the floor is the replayed preset's own (O collapses there); False: the reference code's


def collapsed_rows(s: torch.Tensor, config: ReplayConfig) -> Optional[RowCollapse]:
    """Rows where the stabilized shift of `config` leaves a row sum below the row-sum floor, on the
    scores s (B, h, T, T) from `scores_fp32` taken as one block. The floor is the preset's own
    (row_sum_floor) or, for a preset without one, the paper's reference code's 1e-10. None when
    `config` does not use the stabilized softmax."""
    from fa_forensics.numerics import exp_fp32
    from fa_forensics.replay.emulate.softmax import block_shift

    if config.softmax is not Softmax.STABILIZED:
        return None
    applies = config.row_sum_floor > 0
    floor = config.row_sum_floor if applies else REFERENCE_ROW_SUM_FLOOR
    r_m = s.amax(dim=-1)
    shift = block_shift(torch.full_like(r_m, -math.inf), s, config)
    m = torch.where(torch.isfinite(shift.m), shift.m, torch.zeros_like(shift.m))
    row_sum = exp_fp32(s - m[..., None]).double().sum(dim=-1)  # (B, h, T); masked scores give 0
    rows = shift.fired & (row_sum < floor) & (r_m > -math.inf)
    return RowCollapse(rows=rows, row_max=r_m, floor=floor, applies=applies)


def collapse_threshold(floor: float, beta: float) -> float:
    """The repeated maximum above which one pair of tied maxima leaves a row sum below `floor`
    under the stabilized shift β·r_m: ln(1/floor)/(β − 1) (≈ 23.0 for 1e-10 at β = 2)."""
    return math.log(1.0 / floor) / (beta - 1.0) if floor > 0 and beta > 1 else math.inf


def max_p_bar_in_repeated_rows(s: torch.Tensor, config: ReplayConfig, rows: Optional[torch.Tensor] = None) -> float:
    """Max P̄ (after the P̄ cast) over rows whose maximum score is attained more than once
    (`rows`, (B, h, T) bool, e.g. `repeated_within_eps`; default: exact ties).

    Untiled, on the scores s (B, h, T, T) from `scores_fp32`: r_m = rowmax S; the shift m is the
    replay's own rule for one block (`replay.emulate.softmax.block_shift`: standard r_m; stabilized
    β·r_m or 0 where the maximum repeats within ε, Algorithm 3; fixed offset r_m + offset); the row's
    largest P̄ is cast(exp(r_m − m)). nan when no row has a repeated maximum.
    """
    from fa_forensics.numerics import exp_fp32, round_to
    from fa_forensics.replay.emulate.softmax import block_shift

    r_m = s.amax(dim=-1)  # (B, h, T)
    if rows is None:
        rows = ((s == r_m[..., None]).sum(dim=-1) > 1) & (r_m > -math.inf)  # a row that sees no key has no maximum
    repeated = rows
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
    max_p_bar: float  # max P̄ in rows with a repeated maximum (nan when no row has one)
    still_biased: bool  # significant (p < 0.01) bias left in the target cell
    repeated_rows: int = 0  # rows whose maximum repeats within ε (max P̄ is taken over them)
    collapsed_rows: int = 0  # rows whose row sum under this variant's shift is below the row-sum floor
    collapse_max_score: float = math.nan  # largest row maximum among them
    collapse_min_ratio: float = math.nan  # smallest |O_v| / |O_fp32| among them


@dataclass(frozen=True)
class FixCheckResult(RecipeResult):
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
    # rows where the fix's row sum is below the row-sum floor: {rows, max_score, threshold, floor,
    # applies (the preset's own floor: O collapses), min_ratio (|O|/|O_fp32|, measured)}
    collapse: dict = dataclasses.field(default_factory=dict)


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
    collapsed = [p for p in parts if p.collapsed_rows]
    return VariantResult(
        name=v.name, role=v.role, what=v.what, o_bias=cell.mean, o_bias_se=cell.se, o_bias_p=cell.p_value,
        delta_err_sum=dsum, delta_err_se=dse, delta_p=dp,
        max_abs_err=max(p.max_abs_err for p in parts), nan_count=sum(p.nan_count for p in parts),
        underflow=sum(p.p_zeroed for p in parts), p_one_count=sum(p.p_one_count for p in parts),
        triggered_rows=sum(p.stabilized_rows for p in parts), repeated_max_rows=sum(p.repeated_max_rows for p in parts),
        max_p_bar=max(maxp) if maxp else math.nan, still_biased=cell.p_value < ALPHA,
        repeated_rows=sum(p.repeated_rows for p in parts), collapsed_rows=sum(p.collapsed_rows for p in collapsed),
        collapse_max_score=max((p.collapse_max_score for p in collapsed), default=math.nan),
        collapse_min_ratio=min((p.collapse_min_ratio for p in collapsed), default=math.nan),
    )


def layer_part(t: LayerTensors, recipe: Recipe, backend: Backend, beta: float, eps: float, offset: float):
    """(warnings, the variants, [(variant name, VariantLayerStep)]) of one layer-step (its selected heads)."""
    lp = lp_of(t, recipe)
    t = as_seen_by(t, lp)  # both sides replay the inputs as the recipe sees them
    variants = fix_variants(lp, preset_at(t.source, t.step, t.layer, recipe), beta=beta, eps=eps, offset=offset)
    hp = replay_layer(t, hp_config(), backward=False, backend=backend)
    s = scores_fp32(t.q, t.k, t.scale, t.causal, variants[0].config.s_dtype.value, t.mask)  # (B, h, T, T)
    fixed = next(v for v in variants if v.role == "fixed")
    repeated = repeated_within_eps(s, fixed.config)
    measured = []
    for v in variants:
        out = replay_layer(t, v.config, backward=False, backend=backend)
        maxp = max_p_bar_in_repeated_rows(s, v.config, repeated)
        measured.append((v.name, measure_variant(out.o, hp.o, t.do, out.stats, step=t.step, layer=t.layer,
                                                 heads=list(t.heads), max_p_bar_repeated=maxp,
                                                 repeated_rows=int(repeated.sum()),
                                                 collapse=collapsed_rows(s, v.config))))
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
    collapse = _collapse_summary(fixed, next(v for v in variants if v.role == "fixed").config)

    where = f"layer {target.layer} head {target.head} feature {target.feature}"
    numbers = (f"O bias {baseline.o_bias:+.3e} ± {baseline.o_bias_se:.1e} (p={baseline.o_bias_p:.2g}) → "
               f"{fixed.o_bias:+.3e} ± {fixed.o_bias_se:.1e} (p={fixed.o_bias_p:.2g}), reduction {reduction:.1f}x")
    still = [a.name for a in alternatives if a.still_biased]
    broken = [f"{a.name} ({a.nan_count} NaN)" for a in alternatives if a.nan_count]
    tail = f"; still biased: {', '.join(still)}" if still else "; no alternative left a significant bias"
    if broken:
        tail += f"; produced NaN: {', '.join(broken)}"
    if fixed.nan_count:
        removed, verdict = False, (f"FIX FAILS: the stabilized replay produced {fixed.nan_count} NaN (β too large?) at "
                                   f"{where}")
    elif collapse["rows"] and collapse["applies"]:
        removed, verdict = False, f"FIX FAILS: it collapses O in {collapse_text(collapse)}"
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
        removed=removed, verdict=verdict, exit_code=0 if removed else 1, n_cells=len(cells), collapse=collapse,
    )


def _collapse_summary(fixed: VariantResult, config: ReplayConfig) -> dict:
    """The fixed variant's collapsed rows with the floor and the threshold that explain them."""
    applies = config.row_sum_floor > 0
    floor = config.row_sum_floor if applies else REFERENCE_ROW_SUM_FLOOR
    return {"rows": fixed.collapsed_rows, "max_score": fixed.collapse_max_score,
            "threshold": collapse_threshold(floor, config.beta), "floor": floor, "beta": config.beta,
            "applies": applies, "min_ratio": fixed.collapse_min_ratio if applies else math.nan}


def collapse_text(c: dict) -> str:
    """'N rows: their repeated maximum (up to X) is above about ln(1/floor)/(β−1) = T, ...' for a collapse summary.
    The threshold is approximate: k tied maxima collapse above (ln k + ln(1/floor))/(β−1); the rows counted are
    those whose shifted row sum is measured below the floor."""
    beta = f"{c['beta']:g}"
    text = (f"{c['rows']} row(s): their repeated maximum (up to {c['max_score']:.4g}) is above about "
            f"ln(1/{c['floor']:g})/(β−1) = {c['threshold']:.4g} at β = {beta} (more for more tied maxima: "
            f"ln(k/{c['floor']:g})/(β−1) for k of them), so the shifted row sum falls below "
            f"the {c['floor']:g} row-sum floor")
    if c["applies"] and math.isfinite(c["min_ratio"]):
        text += f" and |O|/|O_fp32| drops to {c['min_ratio']:.2g}"
    return text


def collapse_warning(c: dict) -> Optional[str]:
    """The warning for rows where the paper's reference code (not this preset) would collapse O."""
    if not c.get("rows") or c.get("applies"):
        return None
    return (f"the paper's reference code (block row sums clamped at {c['floor']:g}, presets bf16-autocast-train and "
            f"bf16-autocast-stabilized) would collapse O under the stabilized softmax in {collapse_text(c)}; "
            "this preset has no floor, so its replay does not")


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
    for warns, variants, measured in items:  # noqa: B007 - the variants of the last item are used below
        warnings.extend(w for w in warns if w not in warnings)
        for name, m in measured:
            parts.setdefault(name, []).append(m)
    result = summarize_fix(variants, parts)
    note = collapse_warning(result.collapse)
    if note:
        warnings.append(note)
    return dataclasses.replace(result, recipe=recipe, backend=Backend(backend),
                               settings={"beta": beta, "eps": eps, "offset": offset}, warnings=tuple(warnings),
                               replay_fidelity=replay_fidelity(dump, selections, recipe))


def bias_claim(r: FixCheckResult) -> BiasClaim:
    """The baseline's bias in the target cell (sign test, Bonferroni over the cells it was picked from)."""
    tg = r.target
    return claim("O", r.baseline.o_bias_p, r.n_cells, r.baseline.o_bias, layer=tg["layer"], head=tg["head"],
                 feature=tg["feature"])


def payload(r: FixCheckResult) -> dict:
    """The --json payload (keys documented in docs/json.md)."""
    return {
        "target": r.target, "baseline": r.baseline, "fixed": r.fixed, "alternatives": r.alternatives,
        "bias_reduction": r.bias_reduction, "max_p_bar": r.max_p_bar, "triggered_rows": r.triggered_rows,
        "nan_count": r.nan_count, "removed": r.removed, "verdict": r.verdict, "exit_code": r.exit_code,
        "collapse": r.collapse, "bias": bias_claim(r), **r.settings, **recipe_keys(r.recipe, r.backend),
        **common_keys(r),
    }
