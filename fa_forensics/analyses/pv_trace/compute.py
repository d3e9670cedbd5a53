"""pv-trace: the error of one P̄V dot product, term by term, down to the bits (paper Eq. 4-5, Fig. 6).

For a query row T and a feature i the paper compares (Eq. 4)

    Ō_lp[T, i] − Ō_hp[T, i] = (P̄_lp[T, :] V[:, i])_lp − (P̄_hp[T, :] V[:, i])_hp

where (·)_lp is the dot product accumulated in fp32 (under the chosen accumulation model) and
rounded ONCE to the P̄V dtype (bf16 in the paper's setting), and (·)_hp is all fp32. Eq. 5 plots the
same difference for every prefix t:

    error(t) = round_pv(acc_lp(t)) − acc_hp(t),   acc(t) = the fp32 accumulator after terms 0..t.

What "the error that entered at term t" means here (the definition this module uses): since the
bf16 rounding happens once at the end, no rounding error is *carried* from term to term; instead
error(t) is what a bf16 result would be off by if the sum stopped at t. The jump at t is
error_step(t) = error(t) − error(t−1) (error(−1) = 0), so the jumps telescope exactly to the final
error. Each jump splits into three parts that also sum exactly (up to fp64 round-off):
  - cast:  (P̄_lp − P̄_hp)[t]·V[t]           the P̄ cast error of this term (0 when P̄ = 1 exactly);
  - acc:   fp32 accumulation error of this term in the lp and hp accumulators (tiny);
  - round: r(t) − r(t−1), r(t) = round_pv(acc_lp(t)) − acc_lp(t): the change of the final rounding
           residual. A large same-sign term (P̄ = 1, the "two big" of the blog) moves the sum into a
           coarser binade, so r jumps by up to half a bf16 ulp of the new sum: the paper's error steps.
The jumps depend on the order of the terms (where the tied keys sit); the attribution does not:
frac_error_from_p_one is the share of final_error that the P̄ = 1 mechanism carries, from the
order-independent split of the sum into A (the P̄ = 1 terms) and r (the rest) in `p_one`, with a
counterfactual (the same row with the P̄ = 1 terms nudged below 1), and summarised over every row
of the head as the share of the O bias each class of final rounding carries.

Under a --preset (default "auto": the one that reproduces the stored O) the trace follows that
preset's casts: its s_dtype (bf16 under
"bf16-autocast": S = round(q·kᵀ), s = round(S·α), s − m rounded too, so near-maximal scores tie
exactly and P̄ = 1 is far more common), its softmax shift (standard, stabilized, fixed offset),
its p_dtype (the P̄ cast) and its pv_dtype (the once-rounded P̄V result; fp32 under "bf16-hw",
where only the P̄ cast errs). It traces ONE untiled dot product with the row maximum as shift and
nearest-even casts: exact for the replay when the row fits in one KV block (bf16, stabilized,
bf16-autocast with T ≤ 512); with smaller tiles (bf16-hw, fp8-*) the replay shifts early blocks by
the running maximum and rescales, which the trace does not follow; stochastic rounding is traced
as nearest-even. A P scale S ≠ 1 (fp8-s256, fp8-s448) is refused with a one-line error.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.analyses.contract import RecipeResult, common_keys, recipe_keys, replay_fidelity
from fa_forensics.analyses.quantities import (BiasClaim, cell_sums, most_significant, o_cells, o_claim, o_units,
                                              selection_family)
from fa_forensics.analyses.significance import Family, holm
from fa_forensics.layers.fanout import Workers, map_layers
from fa_forensics.analyses.units import layer_units, row_units
from fa_forensics.analyses.pv_trace.p_one import (P_ONE_CLASSES, ClassShare, Counterfactual, RowSplit, class_shares,
                                                   counterfactual, nudge, split_rows)
from fa_forensics.enums import Backend
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.fidelity.match import ReplayFidelity
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.planner import plan_for
from fa_forensics.layers.selection import LayerSelection, LayerTensors, as_seen_by, load, mask_of
from fa_forensics.fidelity.pair import lp_hp_pair, lp_of
from fa_forensics.analyses.stats import mean_se, unit_sums, unit_test
from fa_forensics.analyses.wording import finite, share_with_se
from fa_forensics.analyses.payloads import PVTracePayload
from fa_forensics.errors import InvalidSetting, OutOfRange
from fa_forensics.numerics import dot_trace, exp_fp32, explain_add, matmul, round_to
from fa_forensics.enums import Softmax
from fa_forensics.replay.emulate.softmax import block_shift

ONE = 1.0


@dataclass(frozen=True)
class PVJump:
    """The change of the Eq. 5 error at one term t (see the module docstring for the parts)."""

    t: int
    p_bar: float  # P̄_lp[T, t] after the P̄ cast
    v: float  # V[t, i]
    error_step: float  # error(t) − error(t−1)
    direction: str  # rounding of round_pv(acc_lp(t)) vs acc_lp(t): "up" (away from 0) | "down" | "exact"
    cast: float  # (P̄_lp − P̄_hp)[t]·V[t, i]
    acc: float  # accumulation-error part
    round: float  # change of the final-rounding residual


@dataclass(frozen=True)
class PVTrace:
    """The Eq. 5 trace of one (row, feature) and its bit-level story."""

    row: int
    feature: int
    accumulation: str
    pv_format: str
    p_bar_lp: torch.Tensor  # (K,) fp64: P̄ after the cast, K = keys the row attends to
    p_bar_hp: torch.Tensor  # (K,) fp64: P̄ in fp32
    v: torch.Tensor  # (K,) fp64: V[:, i]
    lp_running: torch.Tensor  # (K,) fp64: round_pv(acc_lp(t))
    hp_running: torch.Tensor  # (K,) fp64: acc_hp(t)
    error: torch.Tensor  # (K,) fp64: Eq. 5
    error_step: torch.Tensor  # (K,) fp64
    final_error: float  # error(K−1) = Eq. 4
    p_one_positions: list[int]
    jumps: list[PVJump]  # every term whose error_step ≠ 0, in order of t
    frac_error_from_p_one: float  # the share of final_error the P̄ = 1 mechanism carries (p_one.RowSplit)
    largest_jump: Optional[PVJump]
    explanation: object  # numerics.AddExplanation of the largest jump's addition, or None
    split: RowSplit  # the order-independent split of final_error (class, A, r, rounding part)
    nudged_error: Optional[float]  # final_error with the P̄ = 1 terms nudged below 1 (None: no such term)


def _round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to `fmt` (nearest-even) as fp64; identity for fp32 values kept in fp32."""
    if fmt == "fp32":
        return x.to(torch.float32).to(torch.float64)
    return round_to(x.to(torch.float32), fmt).to(torch.float64)


def _direction(rounded: torch.Tensor, acc: torch.Tensor) -> list[str]:
    """'up' when rounding moved away from zero, 'down' toward zero, 'exact' when unchanged."""
    out = []
    for r, a in zip(rounded.tolist(), acc.tolist()):
        if r == a:
            out.append("exact")
        else:
            out.append("up" if abs(r) > abs(a) else "down")
    return out


def trace_pv(
    p_bar_lp: torch.Tensor,
    p_bar_hp: torch.Tensor,
    v: torch.Tensor,
    *,
    row: int = 0,
    feature: int = 0,
    accumulation: str = "ieee",
    gpu: str = "h100",
    in_format: str = "bf16",
    pv_format: str = "bf16",
) -> PVTrace:
    """Trace Eq. 5 along t for one dot product P̄[T, :]·V[:, i].

    p_bar_lp: (K,) the P̄ row after its cast (exact values of `in_format`); p_bar_hp: (K,) the fp32
    P̄ row; v: (K,) the V column (exact values of its storage format). The lp accumulator follows
    numerics.dot_trace under `accumulation`; the hp accumulator is the fp32 ieee chain.
    """
    p_lp = p_bar_lp.detach().reshape(-1).to(torch.float64)  # (K,)
    p_hp = p_bar_hp.detach().reshape(-1).to(torch.float64)  # (K,)
    v64 = v.detach().reshape(-1).to(torch.float64)  # (K,)
    K = p_lp.numel()
    if K == 0:
        raise ValueError("trace_pv needs at least one term")

    acc_lp = dot_trace(p_lp.float(), v64.float(), accumulation, gpu=gpu, in_format=in_format).to(torch.float64)  # (K,)
    acc_hp = dot_trace(p_hp.float(), v64.float(), "ieee", gpu=gpu, in_format="fp32").to(torch.float64)  # (K,)
    lp_running = _round(acc_lp, pv_format)  # (K,)
    error = lp_running - acc_hp  # (K,) Eq. 5
    zero = torch.zeros(1, dtype=torch.float64)
    error_step = torch.diff(error, prepend=zero)  # (K,)

    # the three parts of each jump (they sum to error_step up to fp64 round-off)
    cast = (p_lp - p_hp) * v64
    acc_prev_lp = torch.cat([zero, acc_lp[:-1]])
    acc_prev_hp = torch.cat([zero, acc_hp[:-1]])
    acc_part = (acc_lp - acc_prev_lp - p_lp * v64) - (acc_hp - acc_prev_hp - p_hp * v64)
    resid = lp_running - acc_lp
    round_part = torch.diff(resid, prepend=zero)

    directions = _direction(lp_running, acc_lp)
    p_one = (p_lp == ONE).nonzero().reshape(-1).tolist()
    final_error = float(error[-1])
    split = split_rows(p_lp[None], v64, lp_running[-1:], acc_hp[-1:], pv_format)[0]
    nudged = _nudged_error(p_lp, p_hp, v64, accumulation, gpu, in_format, pv_format) if p_one else None

    jumps = [
        PVJump(t=t, p_bar=float(p_lp[t]), v=float(v64[t]), error_step=float(error_step[t]), direction=directions[t],
               cast=float(cast[t]), acc=float(acc_part[t]), round=float(round_part[t]))
        for t in error_step.nonzero().reshape(-1).tolist()
    ]
    largest = max(jumps, key=lambda j: abs(j.error_step)) if jumps else None
    explanation = None
    if largest is not None and largest.t > 0 and pv_format != "fp32":
        a = float(acc_lp[largest.t - 1])  # the fp32 accumulator before the term
        b = float(p_lp[largest.t] * v64[largest.t])  # the term (exact in fp32: product of two bf16)
        explanation = explain_add(a, b, into=pv_format, acc="fp32")

    return PVTrace(
        row=row, feature=feature, accumulation=accumulation, pv_format=pv_format,
        p_bar_lp=p_lp, p_bar_hp=p_hp, v=v64, lp_running=lp_running, hp_running=acc_hp,
        error=error, error_step=error_step, final_error=final_error, p_one_positions=p_one,
        jumps=jumps, frac_error_from_p_one=split.frac_from_p_one, largest_jump=largest, explanation=explanation,
        split=split, nudged_error=nudged,
    )


def _nudged_error(p_lp, p_hp, v, accumulation, gpu, in_format, pv_format) -> float:
    """Eq. 4's error of the same row with every P̄ = 1 term moved to NUDGED_P on both sides, as the
    stabilized shift moves them below 1: the counterfactual of the attribution."""
    lp, hp = nudge(p_lp, p_hp)
    acc_lp = dot_trace(lp.float(), v.float(), accumulation, gpu=gpu, in_format=in_format).to(torch.float64)
    acc_hp = dot_trace(hp.float(), v.float(), "ieee", gpu=gpu, in_format="fp32").to(torch.float64)
    return float(_round(acc_lp[-1:], pv_format)[0] - acc_hp[-1])


def p_bar_rows(q: torch.Tensor, k: torch.Tensor, scale: float, *, causal: bool, p_format: str = "bf16",
               accumulation: str = "ieee", gpu: str = "h100", config=None,
               mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P̄_lp, P̄_hp) of every query row, untiled (the shift from the whole row), 0 where masked.

    q: (R, D), k: (K, D) stored values; causal: row i sees keys 0 .. i + K − R. mask: the recorded
    attn_mask of these rows and keys (R, K), applied as the replay applies it (bool: False removes a
    key; additive: added to the scores, rounded to the scores' dtype); a row that sees no key is 0.
    P̄_hp is the fp32 preset's: S = α·(q·kᵀ) with the products accumulated by numerics.matmul in
    fp32, m = rowmax S, P̄_hp = exp(S − m) in fp32. P̄_lp without `config`: P̄_hp cast to p_format
    (nearest-even; the P̄ cast of preset bf16). With `config` (a ReplayConfig, the low-precision
    recipe): its scores (s_dtype: S and α·S rounded), its shift (the replay's own rule,
    `replay.emulate.softmax.block_shift`: standard / stabilized Algorithm 3 / fixed offset; s − m
    rounded to s_dtype), exp (`numerics.exp_fp32`, the emulator's) in fp32, cast to its p_dtype. Under a
    non-standard shift P̄_hp = exp(S − m) at that same m. Returns two (R, K) fp32.
    """
    R, K = q.shape[0], k.shape[0]
    # (R, K)
    qk = matmul(q.to(torch.float32), k.to(torch.float32).T.contiguous(), accumulation, gpu=gpu, in_format="bf16")
    qk = qk.to(torch.float32)
    masked = torch.ones(R, K, dtype=torch.bool).triu(K - R + 1) if causal else torch.zeros(R, K, dtype=torch.bool)
    if mask is not None and mask.dtype == torch.bool:
        masked = masked | ~mask
    additive = mask.to(torch.float32) if mask is not None and mask.dtype != torch.bool else None

    def scores(s: torch.Tensor, fmt: str) -> torch.Tensor:  # the recorded additive mask, then causal / bool removal
        if additive is not None:
            s = s + additive if fmt == "fp32" else round_to(s + additive, fmt)
        return s.masked_fill(masked, -math.inf)

    def exp_shifted(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # 0 in a row that sees no key (m = −inf)
        return exp_fp32(s - m[:, None]).masked_fill(~torch.isfinite(m)[:, None], 0.0)

    s = scores((qk * float(scale)).to(torch.float32), "fp32")  # (R, K) α·q·k
    p_hp = exp_shifted(s, s.amax(-1))  # (R, K) fp32
    s_hp = s
    if config is None:
        return (p_hp if p_format == "fp32" else round_to(p_hp, p_format)), p_hp
    s_fmt, p_fmt = config.s_dtype.value, config.p_dtype.value
    if s_fmt != "fp32":
        s = scores(round_to(round_to(qk, s_fmt) * float(scale), s_fmt), s_fmt)  # the autocast reading
    m = block_shift(torch.full((R,), -math.inf), s, config).m  # (R,)
    shifted = s - m[:, None]
    if s_fmt != "fp32":
        shifted = round_to(shifted, s_fmt)
    p = exp_fp32(shifted).masked_fill(~torch.isfinite(m)[:, None], 0.0)  # (R, K) fp32
    if config.softmax is not Softmax.STANDARD:
        # Eq. 4 compares Ō at one shift: with a stabilized / fixed-offset m the fp32 side uses the
        # same m (O = Ō / ℓ is shift-invariant, Ō is not), else Ō_lp − Ō_hp measures the shift.
        p_hp = exp_shifted(s_hp, m)  # (R, K) fp32
    return (p if p_fmt == "fp32" else round_to(p, p_fmt)), p_hp


def p_bar_row(q_row: torch.Tensor, k: torch.Tensor, scale: float, n_keys: int, p_format: str = "bf16",
              accumulation: str = "ieee", gpu: str = "h100", config=None,
              mask_row: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P̄_lp, P̄_hp) of one query row over its first n_keys keys (`p_bar_rows` of that row, under its
    recorded attn_mask row `mask_row` (K,) when given): two (n_keys,) fp32."""
    mask = None if mask_row is None else mask_row[:n_keys].reshape(1, -1)
    p_lp, p_hp = p_bar_rows(q_row.reshape(1, -1), k[:n_keys], scale, causal=False, p_format=p_format,
                            accumulation=accumulation, gpu=gpu, config=config, mask=mask)
    return p_lp[0], p_hp[0]


@dataclass(frozen=True)
class TracedCell:
    """The (batch, head, feature) whose O bias is most significant, and the row picked in it."""

    batch: int
    head_index: int  # index into the selected heads (dim 1)
    feature: int
    row: int
    mean: float  # mean over rows of (O_lp − O_hp)[b, h, :, feature]
    se: float
    p_value: float  # the t-test of the mean: over units (a dump's cell), over rows (pick_cell)
    row_error: float  # (O_lp − O_hp)[b, h, row, feature]
    adjusted_p: float = math.nan  # Holm over the cells (a dump: over the selection's family)
    significant: bool = False


def _row_t_p(e: torch.Tensor) -> torch.Tensor:
    """The policy's t-test of the mean over dim 2 of e (B, H, T, D) -> (B, H, D), every row its own unit
    (`stats.unit_test`)."""
    B, H, T, D = e.shape
    rows = e.permute(2, 0, 1, 3).reshape(T, B, H, D)
    return unit_test(unit_sums(rows, torch.arange(T))).t_p_value


def pick_cell(o_err: torch.Tensor, feature: Optional[int] = None, row: Optional[int] = None,
              candidates: Optional[torch.Tensor] = None, head: Optional[int] = None) -> TracedCell:
    """Default choice of pv-trace: the (batch, head, feature) cell whose t-test over rows is most significant (Holm over
    the cells, then the largest |mean|: the rule of the O claim, `quantities.most_significant`) and, in it, the row
    with the largest error in the bias direction, among the `candidates` rows when any of them lies in that
    (batch, head).

    o_err: (B, H, T, D) O_lp − O_hp (any float dtype); candidates: (B, H, T) bool or None.
    `feature`, `head` (index into H) and `row` fix the choice when given.
    """
    e = o_err.to(torch.float64)
    B, H, T, D = e.shape
    mean = e.mean(dim=2)  # (B, H, D)
    p = _row_t_p(e)  # (B, H, D)
    allowed = torch.ones(B, H, D, dtype=torch.bool)
    if feature is not None:
        allowed[..., [f for f in range(D) if f != feature]] = False
    if head is not None:
        allowed[:, [h for h in range(H) if h != head]] = False
    adjusted = torch.tensor(holm(p[allowed].tolist(), int(allowed.sum())), dtype=torch.float64)
    adj = torch.full_like(p, 2.0)
    adj[allowed] = adjusted
    # smallest adjusted p first, then the largest |mean|
    order = sorted(range(B * H * D), key=lambda i: (float(adj.reshape(-1)[i]), -abs(float(mean.reshape(-1)[i]))))
    flat = order[0]
    b, h, f = flat // (H * D), (flat // D) % H, flat % D
    col = e[b, h, :, f]  # (T,)
    m = float(mean[b, h, f])
    if row is None:
        score_row = col * (1.0 if m > 0 else -1.0) if m != 0 else col.abs()
        if candidates is not None and bool(candidates[b, h].any()):
            score_row = torch.where(candidates[b, h], score_row, torch.full_like(score_row, -math.inf))
        row = int(score_row.argmax())
    sd = float(col.std()) if T > 1 else float("nan")
    return TracedCell(batch=b, head_index=h, feature=f, row=int(row), mean=m, se=sd / T ** 0.5,
                      p_value=float(p[b, h, f]), row_error=float(col[row]), adjusted_p=float(adj[b, h, f]))


@dataclass(frozen=True)
class PVTraceReport(RecipeResult):
    """pv-trace on a dump: where the traced element is and what its trace shows."""

    step: int
    layer: int
    head: int
    batch: int
    cell: TracedCell  # the O bias of the traced feature (mean ± se, t-test over units) and the row's O error
    trace: PVTrace
    o_error_replay: float  # (O_lp − O_hp)[row, feature] from the full replays (normalized by ℓ)
    l_hp: float  # ℓ = Σ P̄_hp of the row: Ō error / ℓ ≈ O error
    row_choice: str  # "given" | "repeated-max" (largest error among rows with a repeated maximum) | "largest-error"
    bias_split: dict  # {"repeated_max": {mean, se, n, p_value}, "other": {…}}: the feature's O bias by row kind (a row
    # t-test, rows taken as independent: a description, not a claim)
    class_shares: list = ()  # p_one.ClassShare per class: share of the feature's O bias over every row of the head
    rows_attributed: int = 0  # rows the class shares pool (every selected step and batch entry)
    counterfactual: Optional[Counterfactual] = None  # those rows with the P̄ = 1 terms nudged below 1
    n_cells: int = 0  # (layer, head, feature) cells the traced one was picked from
    claim: Optional[BiasClaim] = None  # the selection's O claim (the traced cell unless --feature moved it)
    family: Family = Family()
    recipe: Recipe = Recipe()  # the low-precision side traced against fp32
    backend: Backend = Backend.EMULATE
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None


def run(dump, selections: Sequence[LayerSelection], recipe: Recipe | Plan = Recipe(),
        backend: Backend = Backend.EMULATE, *, row: Optional[int] = None, feature: Optional[int] = None, progress=None,
        workers: Workers = Workers()) -> PVTraceReport:
    """Trace the O claim's cell (`quantities.o_claim`: the (layer, head, feature) whose O bias, pooled over every
    selected step and batch entry, is most significant in the selection's family; the same cell bitdiff and
    fix-check name), or with `feature` the most significant cell of that feature; in it the (step, batch, row)
    with the largest error in the bias direction (a row with a repeated maximum when there is one). One batched
    forward replay per layer-step and precision; the layer-steps are work items on `workers` (the pick and the
    trace run here, on their results in order). `recipe`: a Recipe, or its Plan over the selections."""
    plan = plan_for(dump, selections, recipe)
    warnings: list[str] = []
    pooled: dict[tuple[int, tuple[int, ...]], list] = {}  # (layer, heads) -> [(sel, err (B, h, T, D), config, rep)]
    sums = []
    parts = map_layers(layer_part, dump, selections, workers, progress, args=(plan, backend, row, feature),
                       whole_layers=True)  # a cell is picked across every head of a layer
    for warns, sel, err, config, rep, cs in parts:
        warnings.extend(w for w in warns if w not in warnings)
        pooled.setdefault((sel.layer, tuple(sel.heads)), []).append((sel, err, config, rep))
        sums.append(cs)
    family = selection_family(dump, selections)
    cells = o_cells(sums, family)
    target = most_significant([c for c in cells if feature is None or c.feature == feature])
    key = next(k for k in pooled if k[0] == target.layer and target.head in k[1])
    items = pooled[key]
    hi = key[1].index(target.head)
    # rows of every step and batch entry side by side: (1, h, N, D), N = Σ B·T
    errs = torch.cat([e.permute(1, 0, 2, 3).reshape(e.shape[1], -1, e.shape[3]) for _, e, _, _ in items], dim=1)
    reps = torch.cat([rp.permute(1, 0, 2).reshape(rp.shape[1], -1) for _, _, _, rp in items], dim=1)  # (h, N)
    where = [(sel, b, r) for sel, e, _, _ in items for b in range(e.shape[0]) for r in range(e.shape[2])]
    cell = pick_cell(errs[None], feature=target.feature, candidates=reps[None], head=hi)
    if row is not None:  # the given row: the worst (step, batch) entry at that row
        sign = 1.0 if target.mean > 0 else -1.0
        cands = [i for i, (_, _, r) in enumerate(where) if r == row]
        i = max(cands, key=lambda i: sign * float(errs[hi, i, target.feature]))
        cell = dataclasses.replace(cell, row=i, row_error=float(errs[hi, i, target.feature]))
    sel, b, r = where[cell.row]
    col, rep = errs[hi, :, target.feature], reps[hi]
    best = _Pick(
        cell=TracedCell(b, hi, target.feature, r, target.mean, target.se, target.tested_p, cell.row_error,
                        target.adjusted_p, target.significant),
        sel=sel, config=items[0][2], sels=[it[0] for it in items],
        row_choice="given" if row is not None else ("repeated-max" if bool(rep.any()) else "largest-error"),
        bias_split={"repeated_max": _mean_se(col[rep]), "other": _mean_se(col[~rep])})
    cell, cfg = best.cell, best.config
    t = as_seen_by(load(dump, best.sel), cfg)
    b, hi, f, T_row = cell.batch, cell.head_index, cell.feature, cell.row
    n_keys = T_row + 1 if t.causal else t.q.shape[2]
    accumulation = cfg.accumulation.value
    mask = mask_of(t.mask, b, hi)
    p_lp, p_hp = p_bar_row(t.q[b, hi, T_row], t.k[b, hi], t.scale, n_keys, cfg.p_dtype.value, accumulation,
                           cfg.gpu.value, config=cfg, mask_row=None if mask is None else mask[T_row])
    trace = trace_pv(p_lp, p_hp, t.v[b, hi, :n_keys, f], row=T_row, feature=f, accumulation=accumulation,
                     gpu=cfg.gpu.value, in_format=cfg.p_dtype.value, pv_format=cfg.pv_dtype.value)
    shares, n_rows, cf = head_class_shares(dump, best.sels, hi, f, cfg)
    return PVTraceReport(step=t.step, layer=t.layer, head=t.heads[hi], batch=b, cell=cell, trace=trace,
                         o_error_replay=cell.row_error, l_hp=float(p_hp.to(torch.float64).sum()),
                         row_choice=best.row_choice, bias_split=best.bias_split, class_shares=shares,
                         rows_attributed=n_rows, counterfactual=cf, n_cells=len(cells),
                         claim=o_claim(cells, family), family=family, recipe=plan.recipe, backend=Backend(backend),
                         warnings=tuple(warnings), replay_fidelity=replay_fidelity(dump, selections, plan))


@dataclass(frozen=True)
class _Pick:
    """The traced element chosen so far: its cell (batch, head index, feature, row), where it is, and why."""

    cell: TracedCell
    sel: LayerSelection  # the layer-step of the traced row
    config: object  # the lp ReplayConfig replayed there
    sels: list  # every selected layer-step of that layer (the rows the class shares pool)
    row_choice: str
    bias_split: dict


def layer_part(t: LayerTensors, plan: Plan, backend: Backend, row: Optional[int], feature: Optional[int]):
    """(warnings, selection, O_lp − O_hp (B, h, T, D) float64, the lp config, repeated-maximum rows (B, h, T), the
    O cells' sums) of one layer-step; both sides replay the inputs as the recipe sees them."""
    lp_cfg = lp_of(t, plan)
    if lp_cfg.p_scale != 1.0:
        raise InvalidSetting("p_scale", f"pv-trace does not trace the fp8 P scale (preset "
                             f"{plan.at(t.step, t.layer).preset} has S = {lp_cfg.p_scale:g})")
    t = as_seen_by(t, lp_cfg)
    B, h, T, D = t.q.shape
    if feature is not None and not 0 <= feature < D:
        raise OutOfRange("feature", feature, t.where, D - 1)
    if row is not None and not 0 <= row < T:
        raise OutOfRange("row", row, t.where, T - 1)
    lp, hp = lp_hp_pair(t, plan, backend, backward=False)
    units = layer_units(t, lp_cfg)
    rep = units.tied  # (B, h, T) rows with a repeated maximum
    sel = LayerSelection(t.step, t.layer, list(t.heads))
    err = lp.o.to(torch.float64) - hp.o.to(torch.float64)
    sums = cell_sums(t.step, t.layer, t.heads, err, o_units(hp.o, lp.config.o_dtype.value), units)
    return t.warnings, sel, err, lp.config, rep, sums


def head_class_shares(dump, sels: Sequence[LayerSelection], head_index: int, feature: int,
                      config) -> tuple[list[ClassShare], int, Counterfactual]:
    """The share of the O bias of (head, feature) that each P̄ = 1 class carries, over every row of
    every selected step and batch entry (`p_one.class_shares`, weights 1/ℓ_hp), and the
    counterfactual: the same rows with the P̄ = 1 terms nudged."""
    acc, gpu, p_fmt, pv_fmt = config.accumulation.value, config.gpu.value, config.p_dtype.value, config.pv_dtype.value
    splits, weights, nudged = [], [], []

    def sums(p_lp, p_hp, v):
        lp = _round(matmul(p_lp, v[:, None], acc, gpu=gpu, in_format=p_fmt)[:, 0].to(torch.float64), pv_fmt)
        return lp, matmul(p_hp, v[:, None], "ieee", gpu=gpu, in_format="fp32")[:, 0].to(torch.float64)

    for sel in sels:
        t = as_seen_by(load(dump, sel), config)
        for b in range(t.q.shape[0]):
            # (T, K)
            p_lp, p_hp = p_bar_rows(t.q[b, head_index], t.k[b, head_index], t.scale, causal=t.causal, p_format=p_fmt,
                                    accumulation=acc, gpu=gpu, config=config, mask=mask_of(t.mask, b, head_index))
            seen = p_hp.sum(-1) > 0  # rows that see a key (a row under a mask that removes every key has O = 0)
            p_lp, p_hp = p_lp[seen], p_hp[seen]
            v = t.v[b, head_index, :, feature].to(torch.float32)  # (K,)
            lp_sum, hp_sum = sums(p_lp, p_hp, v)
            splits.extend(split_rows(p_lp, v, lp_sum, hp_sum, pv_fmt))
            weights.append(1.0 / p_hp.to(torch.float64).sum(-1))
            lp_n, hp_n = sums(*nudge(p_lp, p_hp), v)
            nudged.append(lp_n - hp_n)
    w = torch.cat(weights)
    return class_shares(splits, w), len(splits), counterfactual(splits, torch.cat(nudged), w)


def _mean_se(x: torch.Tensor) -> dict:
    m = mean_se(x)
    return {"mean": m.value, "se": m.se, "n": m.n, "p_value": m.p_value}


def repeated_max_rows(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, s_dtype: str = "fp32",
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, h, T) bool: rows whose maximum score (fp32, or as rounded to s_dtype; under the recorded
    attn_mask) is attained more than once (exact ties); a row that sees no key has none."""
    return row_units(q, k, scale, causal, s_dtype, mask).tied


def verdict(r: PVTraceReport) -> str:
    """One sentence: which cell is traced and whether its bias is significant, the traced error, the share the
    P̄ = 1 mechanism carries, and the head's bias by class (an interpretation only where the bias is significant)."""
    tr = r.trace
    frac = tr.frac_error_from_p_one
    cell = f"layer {r.layer} head {r.head} feature {tr.feature}"
    stats = (f"O bias {r.cell.mean:+.3e} ± {r.cell.se:.1e}, p = {r.cell.p_value:.2g}, {r.cell.adjusted_p:.2g} after "
             f"Holm over {r.family.n_tests} tests")
    lead = (f"traced the O claim's cell, {cell} ({stats}), row {tr.row}: " if r.cell.significant else
            f"no significant O bias to explain (most significant: {cell}, {stats}); row {tr.row} of it, traced as an "
            f"illustration, not as evidence: ")
    if frac != frac:
        return lead + "no error in this dot product (Ō_lp = Ō_hp)"
    if not tr.p_one_positions:
        row = f"Ō error {tr.final_error:+.3e} with no P̄ = 1 term in this row (an ordinary rounding)"
    else:
        row = (f"Ō error {tr.final_error:+.3e}; the P̄ = 1 mechanism ({tr.split.cls}) carries {frac:.0%} of it "
               f"({len(tr.p_one_positions)} of {tr.error.numel()} terms have P̄ = 1)")
    p_one = [c for c in r.class_shares if c.cls in P_ONE_CLASSES and c.rows]
    if not p_one or not r.cell.significant:
        return lead + row
    total = sum(c.share for c in p_one)
    se = sum(c.se**2 for c in p_one) ** 0.5
    if not finite(total):
        return f"{lead}{row}; the head has no O bias in this feature to share out over its {r.rows_attributed} rows"
    carried = share_with_se(total, se, signed=True)
    return (f"{lead}{row}; over {r.rows_attributed} rows of the head it carries {carried} of the O bias (a signed "
            "contribution: above 100 % when other roundings pull the other way)")


def bias_claim(r: PVTraceReport) -> BiasClaim:
    """The selection's O claim (its most significant cell), decided by the policy."""
    if r.claim is not None:
        return r.claim
    return BiasClaim(r.cell.significant, "O", r.layer, r.head, 0 if not r.cell.mean else (1 if r.cell.mean > 0 else -1),
                     r.cell.p_value, r.n_cells, feature=r.trace.feature, adjusted_p=r.cell.adjusted_p)


def payload(r: PVTraceReport) -> PVTracePayload:
    """The --json payload (keys documented in docs/json.md)."""
    tr = r.trace
    return {
        "step": r.step, "layer": r.layer, "head": r.head, "batch": r.batch,
        "row": tr.row, "feature": tr.feature, "pv_format": tr.pv_format,
        **recipe_keys(r.recipe, r.backend), **common_keys(r), "verdict": verdict(r),
        "final_error": tr.final_error,
        "o_error": r.o_error_replay,
        "o_bias": {"mean": r.cell.mean, "se": r.cell.se, "p_value": r.cell.p_value, "adjusted_p": r.cell.adjusted_p,
                   "significant": r.cell.significant},
        "row_choice": r.row_choice,
        "bias_split": r.bias_split,
        "p_one_positions": tr.p_one_positions,
        "jumps": [{"t": j.t, "p_bar": j.p_bar, "v": j.v, "error_step": j.error_step, "direction": j.direction,
                   "cast": j.cast, "acc": j.acc, "round": j.round} for j in tr.jumps],
        "frac_error_from_p_one": tr.frac_error_from_p_one,
        "attribution": {"class": tr.split.cls, "A": tr.split.a, "r": tr.split.r,
                        "rounding_error": tr.split.rounding_error,
                        "other_error": tr.split.other_error, "nudged_error": tr.nudged_error},
        "class_shares": {c.cls: {"share": c.share, "se": c.se, "rows": c.rows} for c in r.class_shares},
        "rows_attributed": r.rows_attributed, "counterfactual": r.counterfactual, "bias": bias_claim(r),
        "family": r.family.as_dict(),
        "largest_jump": tr.largest_jump,
        "explanation": tr.explanation,
    }
