"""fix-check: does the stabilized softmax (paper §4, Algorithm 3) remove the bias, and do the
alternatives (App. C's fixed offset, stochastic rounding, P̄V in fp32)?

Every variant is the recipe's low-precision config (default preset "auto": per layer-step the one that
reproduces the stored O; e.g. "bf16-autocast", the paper's reference code, "bf16-hw", or a GPU kernel's model
such as "sdpa-cudnn-sm90") with one change, derived by dataclasses.replace and keeping the preset's tiling,
replayed forward only and compared with the fp32 replay of the same stored inputs:
  - baseline:        the preset unchanged;
  - stabilized:      softmax = stabilized (β, ε): m = β·r_m (r_m > 0) or 0 (r_m < 0) in rows whose
                     maximum is repeated (within ε), so max P̄ < 1 there; for a GPU kernel's model (whose
                     exp, row-sum and 1/ℓ forms describe its standard softmax) on the kernel's tiles without them;
  - stable_attention: the fix as users deploy it, `fa_forensics.stable_attention(q, k, v, β, ε)` (its numerics
                     contract, replay/stable_reference.py, on the inputs as the recipe sees them);
  - plain_attention: the same kernels without the fix (`fa_forensics.replay.stable.plain_attention`): what the
                     kernel change alone does;
  - fixed-offset:    m = rowmax + offset in every row (App. C): the largest P̄ is e^(−offset), a
                     constant that the bf16 cast rounds the same way every time (for offset 1:
                     e^(−1) = 0.36788 → 0.36719, −0.19 %), so with same-sign V the bias comes back;
  - stochastic:      stochastic rounding of the P̄ and O casts (the blog's fix);
  - fp32-pv:         the P̄V product and its running accumulator kept in fp32 (pv_dtype and
                     rescale_dtype; the latter matters for bf16-autocast, whose accumulator is bf16);
                     under bf16-hw, the kernel models and fp8-* this is the baseline itself.
The fix checked ("fixed") is the stabilized preset, or for a GPU kernel's model stable_attention (the kernel
cannot be changed, only replaced); stable_attention and plain_attention run where its contract applies (fp32,
bf16 or fp16 inputs, no attn_mask, q, k, v of one shape) and are otherwise left out with a warning.
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

The bias is measured where the baseline is most biased: the O claim's cell (`analyses.quantities`: the
(layer, head, feature) cell, over all rows or the tied rows, with the smallest Holm-adjusted p, the cell bitdiff
and pv-trace name). The baseline and every variant are decided in ONE family (`one_family`: the selection's tests
plus each variant's test in that cell), the family the command prints. Each variant reports, in that cell and
subset of rows, the mean O error ± se, its p-value (the cluster-robust t-test of the mean over the rows' units) and
its Holm-adjusted p in that family, and in that head Σ_T(δ_v − δ_hp) over its steps (`quantities.head_total`) with δ =
rowsum(dO ∘ O) (exactly the backward's δ for O_lp; no backward pass is run).

Verdict rule (exit code of the command), by the statistics policy (`analyses.significance`):
  - no significant baseline bias (the O claim is not found): nothing to remove (exit 0);
  - the fixed replay has NaN, or its row sum collapses under the preset's own floor: the fix fails (1);
  - the fix removes the bias (`significance.outcome`: ≥ 90 % of it gone, i.e. a reduction ≥ 10x, or
    ≥ 50 % gone with no significant residual): exit 0;
  - a significant bias remains (in the one family of the baseline's and the variants' tests) with less than 90 %
    of it gone: exit 1;
  - neither shown (less than half gone, the rest not significant: too few rows to tell): INCONCLUSIVE, exit 0,
    since exit 1 claims a remaining bias and a claim needs significance.
An alternative is "still biased" when the baseline has a bias to remove and the alternative's bias in the target
cell is significant in that one family: a residual is never claimed where the bias itself is not.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.analyses.contract import RecipeResult, common_keys, recipe_keys, replay_fidelity
from fa_forensics.analyses.primitives import scores_fp32
from fa_forensics.analyses.quantities import (BiasCell, BiasClaim, CellSums, cell_sums, delta_items,
                                              head_total, most_significant, o_cell, o_cells, o_claim, o_units,
                                              selection_family)
from fa_forensics.analyses.significance import (O_TESTS_PER_CELL, REMOVED_SHARE, Family, holm, outcome, p_text,
                                                significant)
from fa_forensics.analyses.payloads import FixCheckPayload
from fa_forensics.analyses.units import RowUnits, layer_units
from fa_forensics.layers.fanout import Workers, map_layers
from fa_forensics.enums import Backend
from fa_forensics.fidelity.match import ReplayFidelity
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.planner import plan_for
from fa_forensics.fidelity.recipe import FALLBACK_PRESET, Recipe
from fa_forensics.layers.selection import LayerSelection, LayerTensors, as_seen_by, replay_layer
from fa_forensics.enums import Precision, Rounding, Softmax
from fa_forensics.replay.config import ReplayConfig

REFERENCE_ROW_SUM_FLOOR = 1e-10  # the paper's reference code: block row sums .clamp(min=1e-10)


STABLE_INPUTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # what stable_attention takes
DEPLOYED = ("stable_attention", "plain_attention")


@dataclass(frozen=True)
class FixVariant:
    """One replay of the fix check: a ReplayConfig, or (`deployed`) stable_attention's kernels with the fix on or
    off, run on the inputs as the recipe sees them."""

    name: str
    role: str  # "baseline" | "fixed" | "control" | "alternative"
    config: ReplayConfig  # for a deployed variant: the baseline's (its input format)
    what: str  # one line for tables
    deployed: Optional[bool] = None  # True: stable_attention; False: plain_attention; None: the config's replay


def fix_variants(base: ReplayConfig = ReplayConfig(), preset: str = FALLBACK_PRESET, *, beta: float = 2.0,
                 eps: float = 1e-3, offset: float = 1.0) -> list[FixVariant]:
    """Baseline (`base`, the low-precision config named `preset`), the fix, stable_attention with the fix on and
    off, and the alternatives, in that order. The fix is the stabilized preset, or stable_attention for a GPU
    kernel's model (the kernel models describe a standard softmax; their stabilized and stochastic variants run
    on the kernel's tiles without the exp, row-sum and 1/ℓ model)."""
    fp32 = Precision.FP32
    kernel = base.is_kernel_model
    plain = base.without_kernel_model() if kernel else base
    on_tiles = " (kernel's tiles, emulator's exp)" if kernel else ""
    return [
        FixVariant("baseline", "baseline", base, f"preset {preset}"),
        FixVariant("stabilized", "alternative" if kernel else "fixed",
                   plain.with_(softmax=Softmax.STABILIZED, beta=beta, eps=eps),
                   f"stabilized softmax β={beta:g}, ε={eps:g}{on_tiles}"),
        FixVariant("stable_attention", "fixed" if kernel else "alternative", base,
                   f"stable_attention β={beta:g}, ε={eps:g} (as deployed)", deployed=True),
        FixVariant("plain_attention", "control", base, "stable_attention's kernels, fix off", deployed=False),
        FixVariant("fixed-offset", "alternative", plain.with_(softmax=Softmax.FIXED_OFFSET, offset=offset),
                   f"m = rowmax + {offset:g} (App. C){on_tiles}"),
        FixVariant("stochastic", "alternative", plain.with_(rounding=Rounding.STOCHASTIC),
                   f"stochastic rounding of P̄ and O casts{on_tiles}"),
        FixVariant("fp32-pv", "alternative", base.with_(pv_dtype=fp32, rescale_dtype=fp32),
                   "P̄V product and accumulator in fp32" + (" (= baseline)"
                                                          if base.with_(pv_dtype=fp32, rescale_dtype=fp32) == base
                                                          else "")),
    ]


def deployed_problem(t: LayerTensors, config: ReplayConfig) -> Optional[str]:
    """Why stable_attention's contract cannot run this layer-step (None: it can)."""
    if t.mask is not None:
        return "it takes no attn_mask and this layer recorded one"
    if config.input_dtype.value not in STABLE_INPUTS:
        return f"it runs fp32, bf16 or fp16 inputs, not the recipe's {config.input_dtype.value}"
    if not (t.q.shape == t.k.shape == t.v.shape):
        return f"it needs q, k, v of one shape (here {tuple(t.q.shape)}, {tuple(t.k.shape)}, {tuple(t.v.shape)})"
    return None


def deployed_o(t: LayerTensors, config: ReplayConfig, stable: bool, beta: float, eps: float) -> torch.Tensor:
    """O of stable_attention (stable) or plain_attention on the layer's inputs in the recipe's input format,
    through the public functions on their torch contract (what a CPU user runs; the GPU kernels follow it)."""
    from fa_forensics.replay.stable import plain_attention, stable_attention

    dtype = STABLE_INPUTS[config.input_dtype.value]
    q, k, v = (x.to(dtype) for x in (t.q, t.k, t.v))  # exact: as_seen_by rounded them to this format
    with torch.no_grad():
        if stable:
            return stable_attention(q, k, v, causal=t.causal, beta=beta, eps=eps, scale=t.scale, backend="torch")
        return plain_attention(q, k, v, causal=t.causal, scale=t.scale, backend="torch")


@dataclass(frozen=True)
class VariantLayerStep:
    """What one variant gave on one layer-step (merged across steps by `summarize_fix`)."""

    sums: CellSums  # O_v − O_hp per (head, feature): the O cells' sums
    step: int
    layer: int
    heads: list[int]
    items: Optional[list]  # [DeltaItem] per head (δ_v − δ_hp), None without dO
    max_abs_err: float
    nan_count: int
    p_zeroed: Optional[int]  # the replay's P̄ counts (None for a deployed variant: its kernels count nothing)
    p_one_count: Optional[int]
    stabilized_rows: Optional[int]
    repeated_max_rows: Optional[int]
    max_p_bar_repeated: float  # max P̄ in rows with a repeated maximum (nan when none)
    repeated_rows: int = 0  # rows whose maximum repeats within ε (the rows max P̄ is taken over)
    collapsed_rows: int = 0  # rows whose row sum under the fix's shift is below the row-sum floor
    collapse_max_score: float = math.nan  # largest row maximum among them
    collapse_min_ratio: float = math.nan  # smallest |O_v| / |O_fp32| among them


def measure_variant(o_v: torch.Tensor, o_hp: torch.Tensor, do: Optional[torch.Tensor], stats, *, step: int, layer: int,
                    heads: list[int], max_p_bar_repeated: float = math.nan, repeated_rows: int = 0,
                    collapse: Optional[RowCollapse] = None, o_format: str = "bf16",
                    row_units: Optional[RowUnits] = None) -> VariantLayerStep:
    """Compare one variant's O (B, h, T, D) with the fp32 replay's; δ error from dO when given; `stats` the replay's
    P̄ counts (None: not counted); `o_format` the baseline's O format (every variant is measured in its rounding
    units); `collapse`: the rows where the row-sum floor takes over, whose |O_v| / |O_fp32| is measured here;
    `row_units`: the rows' independent units (`analyses.units`; None: every row its own unit)."""
    v64, h64 = o_v.to(torch.float64), o_hp.to(torch.float64)
    sums = cell_sums(step, layer, heads, v64 - h64, o_units(h64, o_format), row_units)
    items = delta_items(step, layer, heads, do, o_v, o_hp, o_format, row_units) if do is not None else None
    err = (v64 - h64).abs()
    t = stats.total() if stats is not None else {}
    n_collapsed, top_score, min_ratio = 0, math.nan, math.nan
    if collapse is not None and bool(collapse.rows.any()):
        n_collapsed = int(collapse.rows.sum())
        top_score = float(collapse.row_max[collapse.rows].max())
        ratio = v64.norm(dim=-1)[collapse.rows] / h64.norm(dim=-1)[collapse.rows]
        min_ratio = float(ratio.nan_to_num(nan=0.0).min())
    return VariantLayerStep(
        sums=sums, step=step, layer=layer, heads=list(heads), items=items,
        max_abs_err=float(err.nan_to_num(0.0).max()) if err.numel() else 0.0,
        nan_count=int(torch.isnan(v64).sum()), p_zeroed=t.get("p_zeroed"), p_one_count=t.get("p_one_count"),
        stabilized_rows=t.get("stabilized_rows"), repeated_max_rows=t.get("repeated_max_rows"),
        max_p_bar_repeated=max_p_bar_repeated, repeated_rows=repeated_rows,
        collapsed_rows=n_collapsed, collapse_max_score=top_score, collapse_min_ratio=min_ratio,
    )


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
    o_bias_p: float  # the cell's t-test p over its units
    delta_err_sum: Optional[float]  # Σ_T (δ_v − δ_hp) in the target head over its steps (`quantities.head_total`)
    delta_err_se: Optional[float]
    delta_p: Optional[float]  # t-test p of that sum
    max_abs_err: float  # max |O_v − O_fp32| over the selection
    nan_count: int
    underflow: Optional[int]  # P̄ entries > 0 zeroed by the cast (None: not counted, a deployed variant)
    p_one_count: Optional[int]
    triggered_rows: Optional[int]  # rows where the stabilized shift fired
    repeated_max_rows: Optional[int]
    max_p_bar: float  # max P̄ in rows with a repeated maximum (nan when no row has one)
    still_biased: bool  # the baseline is biased and a significant bias is left in the target cell (one family)
    repeated_rows: int = 0  # rows whose maximum repeats within ε (max P̄ is taken over them)
    collapsed_rows: int = 0  # rows whose row sum under this variant's shift is below the row-sum floor
    collapse_max_score: float = math.nan  # largest row maximum among them
    collapse_min_ratio: float = math.nan  # smallest |O_v| / |O_fp32| among them
    o_bias_adjusted_p: float = math.nan  # Holm over the one family of the selection's and the variants' tests
    effect: float = math.nan  # |O bias| in rounding units of the baseline's O format
    removed_share: float = math.nan  # 1 − |O bias| / |baseline's O bias| (the baseline: nan)
    outcome: Optional[str] = None  # `significance.outcome`: removed | remains | inconclusive (None for the baseline)

    @property
    def removes(self) -> Optional[bool]:
        return None if self.outcome is None else self.outcome == "removed"


@dataclass(frozen=True)
class FixCheckResult(RecipeResult):
    """The fix check's answer."""

    target: dict  # {layer, head, feature}
    baseline: VariantResult
    fixed: VariantResult
    alternatives: list[VariantResult]  # every other variant measured, the control (plain_attention) included
    bias_reduction: float  # |baseline o_bias| / |fixed o_bias| (inf when the fixed bias is 0)
    max_p_bar: float
    triggered_rows: Optional[int]
    nan_count: int
    removed: bool  # the fix removes the bias, or there is none to remove
    verdict: str
    exit_code: int
    n_cells: int = 0  # (layer, head, feature) cells the target was picked from
    recipe: Recipe = Recipe()  # the low-precision side every variant derives from
    backend: Backend = Backend.EMULATE
    settings: dict = dataclasses.field(default_factory=dict)  # beta, eps, offset
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None
    # rows where the fix's row sum is below the row-sum floor: {rows, max_score, threshold, floor,
    # applies (the preset's own floor: O collapses), min_ratio (|O|/|O_fp32|, measured)}
    collapse: dict = dataclasses.field(default_factory=dict)
    claim: Optional[BiasClaim] = None  # the baseline's O claim (found or not)
    family: Family = Family()
    has_bias: bool = False  # the baseline's O claim is found: there is a bias to remove
    outcome: str = "no-bias"  # no-bias | fails | removed | inconclusive | remains (exit code 1: fails, remains)

    def variant(self, name: str) -> Optional[VariantResult]:
        return next((v for v in (self.baseline, self.fixed, *self.alternatives) if v.name == name), None)


def _cell(parts: list[VariantLayerStep], target: BiasCell) -> BiasCell:
    cell = o_cell([p.sums for p in parts], target.layer, target.head, target.feature, target.subset)
    if cell is None:  # summarize_fix measures only variants that ran on every layer-step of the baseline
        raise RuntimeError(f"fix-check: no measurement of layer {target.layer} head {target.head}")
    return cell


def _variant_result(v: FixVariant, parts: list[VariantLayerStep], target: BiasCell) -> VariantResult:
    cell = _cell(parts, target)
    items = [i for p in parts for i in (p.items or [])]
    dsum = dse = dp = None
    if items:
        total = head_total(items, target.layer, target.head)
        if total.n_items:
            dsum, dse, dp = total.value, total.se, total.t_p_value
    maxp = [p.max_p_bar_repeated for p in parts if not math.isnan(p.max_p_bar_repeated)]
    collapsed = [p for p in parts if p.collapsed_rows]

    def count(name: str) -> Optional[int]:
        values = [getattr(p, name) for p in parts]
        return None if any(x is None for x in values) else sum(values)

    return VariantResult(
        name=v.name, role=v.role, what=v.what, o_bias=cell.mean, o_bias_se=cell.se, o_bias_p=cell.tested_p,
        delta_err_sum=dsum, delta_err_se=dse, delta_p=dp,
        max_abs_err=max(p.max_abs_err for p in parts), nan_count=sum(p.nan_count for p in parts),
        underflow=count("p_zeroed"), p_one_count=count("p_one_count"), triggered_rows=count("stabilized_rows"),
        repeated_max_rows=count("repeated_max_rows"),
        max_p_bar=max(maxp) if maxp else math.nan, still_biased=False,
        repeated_rows=sum(p.repeated_rows for p in parts), collapsed_rows=sum(p.collapsed_rows for p in collapsed),
        collapse_max_score=max((p.collapse_max_score for p in collapsed), default=math.nan),
        collapse_min_ratio=min((p.collapse_min_ratio for p in collapsed), default=math.nan),
        effect=cell.effect,
    )


def layer_part(t: LayerTensors, plan: Plan, backend: Backend, beta: float, eps: float, offset: float):
    """(warnings, the variants, [(variant name, VariantLayerStep)], why stable_attention could not run here or None)
    of one layer-step (its selected heads)."""
    planned = plan.at(t.step, t.layer)
    lp = planned.lp
    t = as_seen_by(t, lp)  # both sides replay the inputs as the recipe sees them
    variants = fix_variants(lp, planned.preset, beta=beta, eps=eps, offset=offset)
    hp = replay_layer(t, planned.hp, backward=False, backend=backend)
    s = scores_fp32(t.q, t.k, t.scale, t.causal, variants[0].config.s_dtype.value, t.mask)  # (B, h, T, T)
    stabilized = next(v for v in variants if v.name == "stabilized")
    repeated = repeated_within_eps(s, stabilized.config)
    problem = deployed_problem(t, lp)
    units = layer_units(t, lp)  # every variant is measured over the same units of rows
    measured = []
    o_format = lp.o_dtype.value
    for v in variants:
        if v.deployed is not None:
            if problem is not None:
                continue
            o, stats = deployed_o(t, lp, v.deployed, beta, eps), None
            shift = (stabilized.config if v.deployed else stabilized.config.with_(softmax=Softmax.STANDARD))
            maxp, collapse = max_p_bar_in_repeated_rows(s, shift, repeated), None
        else:
            out = replay_layer(t, v.config, backward=False, backend=backend)
            o, stats = out.o, out.stats
            maxp, collapse = max_p_bar_in_repeated_rows(s, v.config, repeated), collapsed_rows(s, v.config)
        measured.append((v.name, measure_variant(o, hp.o, t.do, stats, step=t.step, layer=t.layer,
                                                 heads=list(t.heads), max_p_bar_repeated=maxp,
                                                 repeated_rows=int(repeated.sum()), collapse=collapse,
                                                 o_format=o_format, row_units=units)))
    return t.warnings, variants, measured, problem


def _fixed_variant(variants: list[FixVariant], parts: dict) -> FixVariant:
    """The fix checked: the "fixed" variant, or (where stable_attention could not run) the stabilized replay."""
    fixed = next(v for v in variants if v.role == "fixed")
    if parts.get(fixed.name):
        return fixed
    return dataclasses.replace(next(v for v in variants if v.name == "stabilized"), role="fixed")


def summarize_fix(variants: list[FixVariant], parts: dict[str, list[VariantLayerStep]],
                  family: Optional[Family] = None) -> FixCheckResult:
    """Merge every variant's layer-steps, pick the target cell from the baseline (the O claim's cell in `family`,
    default: the cells alone), decide each variant's residual and the verdict. A variant that did not run on every
    layer-step the baseline ran on (stable_attention where a layer-step is outside its contract) is left out: its
    rows would not be the baseline's."""
    base = next(v for v in variants if v.role == "baseline")
    everywhere = {(p.step, p.layer) for p in parts[base.name]}
    parts = {name: ps for name, ps in parts.items() if {(p.step, p.layer) for p in ps} == everywhere}
    fixed_v = _fixed_variant(variants, parts)
    measured = [fixed_v if v.name == fixed_v.name else v for v in variants if parts.get(v.name)]
    tested = [v.name for v in measured if v.role != "baseline"]
    sums = [p.sums for p in parts[base.name]]
    joint = one_family(family if family is not None else Family(o_cells=len(o_cells(sums))), len(tested))
    cells = o_cells(sums, joint)  # the baseline decided in the family its variants are decided in
    claim = o_claim(cells, joint)
    target = most_significant(cells)
    results = {v.name: _variant_result(v, parts[v.name], target) for v in measured}
    baseline = dataclasses.replace(results[base.name], o_bias_adjusted_p=target.adjusted_p)
    adjusted = _variants_in_family(cells, [results[n].o_bias_p for n in tested], joint)
    adjusted = dict(zip(tested, adjusted))
    for n in tested:
        r = results[n]
        share = 1.0 - abs(r.o_bias) / abs(baseline.o_bias) if baseline.o_bias else math.nan
        left = claim.found and significant(adjusted[n], r.effect)
        results[n] = dataclasses.replace(r, o_bias_adjusted_p=adjusted[n], still_biased=left, removed_share=share,
                                         outcome=outcome(share, left))
    fixed = results[fixed_v.name]
    alternatives = [results[n] for n in tested if n != fixed_v.name]
    reduction = abs(baseline.o_bias) / abs(fixed.o_bias) if fixed.o_bias != 0 else math.inf
    collapse = _collapse_summary(fixed, fixed_v.config if fixed_v.deployed is None else
                                 fixed_v.config.with_(row_sum_floor=0.0))
    result, verdict = _decide(baseline, fixed, alternatives, claim, joint, target, collapse, reduction)
    return FixCheckResult(
        target={"layer": target.layer, "head": target.head, "feature": target.feature},
        baseline=baseline, fixed=fixed, alternatives=alternatives, bias_reduction=reduction,
        max_p_bar=fixed.max_p_bar, triggered_rows=fixed.triggered_rows, nan_count=fixed.nan_count,
        removed=result in ("removed", "no-bias"), verdict=verdict, exit_code=1 if result in ("fails", "remains") else 0,
        n_cells=len(cells), collapse=collapse, claim=claim, family=joint, has_bias=claim.found, outcome=result,
    )


def one_family(selection: Family, n_variants: int) -> Family:
    """The one family fix-check decides in: the selection's tests and each variant's test in the target cell.
    A selection's family counts them already (`quantities.selection_family`, `significance.FIX_VARIANTS`), so every
    command prints the same size; a family built without them (a lone cell list) gets them added here. The
    baseline's claim and every variant's residual are decided in it, and it is the family the command prints."""
    counted = O_TESTS_PER_CELL * n_variants
    return selection if selection.extra >= counted else dataclasses.replace(selection, extra=selection.extra + counted)


def _variants_in_family(cells: Sequence[BiasCell], variant_p: list[float], family: Family) -> list[float]:
    """Each variant's p adjusted by Holm in `family` (`one_family`). The variants' p-values are ranked among the
    baseline's cells' (both subsets), so a variant's residual is judged on the same scale as the bias it is
    compared with."""
    base_p = [x.tested_p for c in cells for x in c.subsets]
    return holm(base_p + list(variant_p), family.n_tests)[len(base_p):]


def _decide(baseline: VariantResult, fixed: VariantResult, alternatives: list[VariantResult], claim: BiasClaim,
            family: Family, target: BiasCell, collapse: dict, reduction: float) -> tuple[str, str]:
    """(the outcome: no-bias | fails | removed | inconclusive | remains, the verdict sentence) by the rule of the
    module docstring."""
    where = f"layer {target.layer} head {target.head} feature {target.feature}"
    base_numbers = (f"O bias over {claim.subset} ({claim.n_units} units) {baseline.o_bias:+.3e} ± "
                    f"{baseline.o_bias_se:.1e}, {baseline.effect:.2g} of a rounding "
                    f"unit ({p_text(baseline.o_bias_p, baseline.o_bias_adjusted_p, family.n_tests)})")
    if fixed.nan_count:
        return "fails", f"FIX FAILS: {fixed.name} produced {fixed.nan_count} NaN (β too large?) at {where}"
    if collapse["rows"] and collapse["applies"]:
        return "fails", f"FIX FAILS: it collapses O in {collapse_text(collapse)}"
    broken = [f"{a.name} ({a.nan_count} NaN)" for a in alternatives if a.nan_count]
    if not claim.found:
        return "no-bias", (f"NO BIAS TO REMOVE: the baseline shows no significant O bias in any cell (most "
                           f"significant: {where}, {base_numbers})"
                           + (f"; produced NaN: {', '.join(broken)}" if broken else ""))
    turned = ", the opposite sign: it reverses the bias" if reverses(fixed, baseline) else ""
    numbers = (f"{base_numbers} → {fixed.name} {fixed.o_bias:+.3e} ± {fixed.o_bias_se:.1e} (p = "
               f"{fixed.o_bias_p:.2g}{turned}), {_share(fixed.removed_share)} of it removed (reduction "
               f"{reduction:.1f}x)")
    still = [_still_text(a, baseline) for a in alternatives if a.still_biased]
    tail = f"; still biased: {', '.join(still)}" if still else "; no alternative left a significant bias"
    if broken:
        tail += f"; produced NaN: {', '.join(broken)}"
    tail += _control_clause(fixed, alternatives)
    if fixed.outcome == "removed" and fixed.removed_share >= REMOVED_SHARE:
        return "removed", f"FIX REMOVES THE BIAS at {where}: {numbers}{tail}"
    if fixed.outcome == "removed":  # at least half gone, the rest not significant: the policy's "removes", said so
        return "removed", (f"FIX REMOVES MOST OF THE BIAS at {where}: {numbers}; what is left is not significant"
                           f"{tail}")
    if fixed.outcome == "inconclusive":
        return "inconclusive", (f"INCONCLUSIVE at {where}: {numbers}; what is left is not significant either: too "
                                f"few rows to tell whether the fix removes it (capture more steps or batch rows){tail}")
    return "remains", f"FIX DOES NOT REMOVE THE BIAS at {where}: {numbers}{tail}"


def reverses(variant: VariantResult, baseline: VariantResult) -> bool:
    """The variant leaves a significant bias of the opposite sign to the baseline's: it reverses the bias rather than
    leaving part of it."""
    return (significant(variant.o_bias_adjusted_p, variant.effect) and variant.o_bias * baseline.o_bias < 0)


def _still_text(variant: VariantResult, baseline: VariantResult) -> str:
    """'fixed-offset' or 'fixed-offset (reverses the bias: +1.2e-04 ± 2.0e-05 against the baseline's −3.4e-05)'."""
    if not reverses(variant, baseline):
        return variant.name
    return (f"{variant.name} (reverses the bias: {variant.o_bias:+.3e} ± {variant.o_bias_se:.1e} against the "
            f"baseline's {baseline.o_bias:+.3e})")


def _share(x: float) -> str:
    return f"{x:.0%}" if math.isfinite(x) else "n/a"


def _control_clause(fixed: VariantResult, alternatives: list[VariantResult]) -> str:
    """What stable_attention's kernels do with the fix off, beside the fix (empty when they did not run)."""
    control = next((a for a in alternatives if a.role == "control"), None)
    deployed = fixed if fixed.name == "stable_attention" else next(
        (a for a in alternatives if a.name == "stable_attention"), None)
    if control is None or deployed is None:
        return ""
    plain = f"plain_attention, its kernels without the fix ({_share(control.removed_share)})"
    if deployed.removes and control.removes:
        return (f"; as deployed, stable_attention removes it ({_share(deployed.removed_share)}) and so does {plain}: "
                "their fp32 P̄V accumulator alone is enough here")
    if deployed.removes:
        return (f"; as deployed, stable_attention removes it ({_share(deployed.removed_share)}); {plain} does not: "
                "the stabilized softmax is what removes it")
    if control.removes:
        return (f"; as deployed, stable_attention does not remove it ({_share(deployed.removed_share)}), though "
                f"{plain} does: the fix's shift, the only difference between them, brings part of it back")
    return (f"; as deployed, stable_attention does not remove it ({_share(deployed.removed_share)}), nor does {plain}")


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


def run(dump, selections: Sequence[LayerSelection], recipe: Recipe | Plan = Recipe(),
        backend: Backend = Backend.EMULATE, *, beta: float = 2.0, eps: float = 1e-3, offset: float = 1.0, progress=None,
        workers: Workers = Workers()) -> FixCheckResult:
    """Run the fix check on every selected layer-step: one batched forward replay per variant plus
    the fp32 replay; δ errors from the stored dO (when present). Work items are (step, layer, head
    group) on `workers`, reduced in item order (the same result for any N). `recipe`: a Recipe, or its Plan over
    the selections (`fidelity.planner.plan_for`)."""
    plan = plan_for(dump, selections, recipe)
    family = selection_family(dump, selections)
    items = map_layers(layer_part, dump, selections, workers, progress, args=(plan, backend, beta, eps, offset))
    variants: list[FixVariant] = []
    parts: dict[str, list[VariantLayerStep]] = {}
    warnings: list[str] = []
    not_deployed: dict[str, list[str]] = {}
    for warns, variants, measured, problem in items:  # noqa: B007 - the variants of the last item are used below
        warnings.extend(w for w in warns if w not in warnings)
        for name, m in measured:
            parts.setdefault(name, []).append(m)
        if problem is not None:
            m = measured[0][1]
            not_deployed.setdefault(problem, []).append(f"step {m.step} layer {m.layer}")
    for problem, where in not_deployed.items():
        more = f" and {len(where) - 4} more" if len(where) > 4 else ""
        warnings.append(f"stable_attention and plain_attention not measured (they cannot run at {', '.join(where[:4])}"
                        f"{more}: {problem})")
    result = summarize_fix(variants, parts, family)
    note = collapse_warning(result.collapse)
    if note:
        warnings.append(note)
    return dataclasses.replace(result, recipe=plan.recipe, backend=Backend(backend),
                               settings={"beta": beta, "eps": eps, "offset": offset}, warnings=tuple(warnings),
                               replay_fidelity=replay_fidelity(dump, selections, plan))


def bias_claim(r: FixCheckResult) -> BiasClaim:
    """The baseline's O claim: its most significant cell (the target), decided by the policy."""
    return r.claim if r.claim is not None else BiasClaim(False, "O", r.target["layer"], r.target["head"], 0,
                                                         r.baseline.o_bias_p, r.n_cells, feature=r.target["feature"])


def deployment(r: FixCheckResult) -> Optional[dict]:
    """What deploying stable_attention does, as measured (None when it did not run): {removes, removed_share,
    still_biased, control_removes, control_removed_share}."""
    deployed, control = r.variant("stable_attention"), r.variant("plain_attention")
    if deployed is None:
        return None
    return {"removes": deployed.removes, "outcome": deployed.outcome, "removed_share": deployed.removed_share,
            "still_biased": deployed.still_biased, "control_removes": None if control is None else control.removes,
            "control_removed_share": None if control is None else control.removed_share}


def payload(r: FixCheckResult) -> FixCheckPayload:
    """The --json payload (keys documented in docs/json.md)."""
    return {
        "target": r.target, "baseline": r.baseline, "fixed": r.fixed, "alternatives": r.alternatives,
        "bias_reduction": r.bias_reduction, "max_p_bar": r.max_p_bar, "triggered_rows": r.triggered_rows,
        "nan_count": r.nan_count, "removed": r.removed, "verdict": r.verdict, "exit_code": r.exit_code,
        "collapse": r.collapse, "bias": bias_claim(r), "has_bias": r.has_bias, "outcome": r.outcome,
        "deployment": deployment(r),
        "family": r.family.as_dict(), **r.settings, **recipe_keys(r.recipe, r.backend),
        **common_keys(r),
    }
