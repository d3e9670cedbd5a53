"""rank1-sim: the similar rank-1 matrices behind the biased W_Q update (paper §3.3.1, Eq. 2-3, Fig. 4).

Eq. 2: dW_Q,hp − dW_Q,lp = α Σ_T (δ_lp − δ_hp)[T] · (PK)[T]ᵀ X[T], a weighted sum of rank-1 matrices
(D, C). When those matrices are alike across tokens and steps (Eq. 3: ≈ R) and the weights share a
sign, the error adds up in one direction instead of cancelling. This module measures the pieces:
the pairwise cosine similarity of the rank-1 matrices of the tokens with the largest |δ error|,
the input features (columns of X) that dominate them, the spectrum of the summed gradient error
(effective rank, share of the top singular value), the alignment of its top singular vectors across
steps, and how its norm grows with the number of steps (exponent ≈ 1: compounds; ≈ 0.5: washes out).

The head studied is the Σδ claim's (layer, head) (`analyses.quantities.delta_claim`: the most significant
(step, layer, head) item, the head isolate and delta-bias name); the verdict interprets the accumulation
exponent ("compounds" / "washes out") only when that claim is significant by the statistics policy: without
a significant bias there is nothing to compound, and the numbers only describe the head.

P here is the high-precision attention matrix softmax(α Q Kᵀ) (float64, causal mask as stored):
the backward passes being compared differ only in δ (§3.2), so P, K and X are common to both.
The δ error is that of the recipe's low-precision config (default preset "auto": per layer-step the one that
reproduces the stored O) against fp32.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from fa_forensics.analyses.contract import RecipeResult, common_keys, recipe_keys, run_over_items
from fa_forensics.analyses.quantities import (BiasClaim, decide_deltas, delta_claim, delta_items, family_of)
from fa_forensics.analyses.units import layer_units
from fa_forensics.analyses.significance import Family, p_text, significant
from fa_forensics.analyses.primitives import delta_error, pk_rows
from fa_forensics.analyses.payloads import Rank1SimPayload
from fa_forensics.layers.fanout import Workers, layer_parts
from fa_forensics.enums import Backend
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.fidelity.match import ReplayFidelity
from fa_forensics.layers.selection import LayerSelection, LayerTensors, as_f64, as_seen_by
from fa_forensics.fidelity.pair import lp_hp_pair, lp_of
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.planner import plan_for_layers
from fa_forensics.errors import DumpError

Progress = Optional[Callable[[str], None]]


# ---- pure tensor functions ---------------------------------------------------------------------

def gradient_error(dd: torch.Tensor, pk: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """E = α Σ_B Σ_T (δ_lp − δ_hp)[T] (PK)[T]ᵀ X[T] = dW_Q,hp − dW_Q,lp per head (Eq. 2).

    dd (B, h, T), pk (B, h, T, D), x (B, T, C) -> (h, D, C) float64
    """
    return scale * torch.einsum("bht,bhtd,btc->hdc", as_f64(dd), as_f64(pk), as_f64(x))


def rank1_cosines(pk_rows_: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarity of the rank-1 matrices u_jᵀ x_j (Frobenius inner product).

    cos(u_iᵀx_i, u_jᵀx_j) = cos(u_i, u_j)·cos(x_i, x_j).  pk_rows_ (n, D), x_rows (n, C) -> (n, n)
    """
    u = torch.nn.functional.normalize(as_f64(pk_rows_), dim=-1)
    w = torch.nn.functional.normalize(as_f64(x_rows), dim=-1)
    return (u @ u.T) * (w @ w.T)


def column_weights(x_rows: torch.Tensor) -> torch.Tensor:
    """Mean share of each input feature c in the squared norm of the rank-1 matrices: X[T,c]² / ‖X[T]‖².

    x_rows (n, C) -> (C,), sums to 1.
    """
    x64 = as_f64(x_rows)
    return (x64**2 / (x64**2).sum(-1, keepdim=True).clamp(min=1e-300)).mean(0)


def effective_rank(sv: torch.Tensor) -> float:
    """exp(entropy of σ / Σσ) (Roy & Vetterli): 1 for rank one, n for n equal singular values."""
    p = sv[sv > 0] / sv.sum()
    return float(torch.exp(-(p * p.log()).sum())) if p.numel() else float("nan")


def growth_exponent(norms: Sequence[float]) -> float:
    """Least-squares slope of log ‖Σ_{s≤n} E_s‖ against log n, n = 1..S (nan for S < 3)."""
    if len(norms) < 3 or min(norms) <= 0:
        return float("nan")
    x = torch.log(torch.arange(1, len(norms) + 1, dtype=torch.float64))
    y = torch.log(torch.tensor(norms, dtype=torch.float64))
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


# ---- results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ColumnWeight:
    feature: int
    weight: float  # mean share of the rank-1 matrices' squared norm in this input feature


@dataclass(frozen=True)
class ChosenToken:
    step: int
    batch: int
    token: int
    delta_err: float


@dataclass(frozen=True)
class Rank1Result(RecipeResult):
    has_x: bool
    focus_layer: int
    focus_head: int
    tokens: list[ChosenToken]  # the rank-1 matrices compared (largest |δ error| per step)
    cosine: list[list[float]]  # (n, n) pairwise cosine similarity
    cosine_offdiag_mean: float  # signed mean of the off-diagonal entries
    pk_cosine_offdiag_mean: float  # the same for the PK rows alone (cos = cos_PK · cos_X)
    x_cosine_offdiag_mean: float  # the same for the X rows alone (nan without X)
    top_columns: list[ColumnWeight]  # largest first
    n_columns: int  # C
    singular_values: list[float]  # of E = Σ_steps α Σ_T (δ_lp − δ_hp)[T](PK)[T]ᵀX[T] (leading ones)
    effective_rank: float
    top_sv_ratio: float  # σ1² / Σσ²: share of the error's energy in its top direction
    cross_step_alignment: float  # mean over step pairs of |cos u1|·|cos v1| (nan with one step)
    steps: list[int]
    step_norms: list[float]  # ‖E_s‖_F per step
    cumulative_norms: list[float]  # ‖Σ_{s≤n} E_s‖_F
    accumulation_exponent: float  # slope of log cumulative norm vs log n (nan with < 3 steps)
    example_matrices: list[list[list[float]]]  # up to 2 rank-1 matrices (D, C) for the figure
    recipe: Recipe  # the low-precision side replayed against fp32
    backend: Backend
    claim: Optional[BiasClaim] = None  # the Σδ claim whose (layer, head) is the focus
    family: Family = Family()
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None


# ---- per layer-step, then combined ---------------------------------------------------------------

def _layer_part(t: LayerTensors, plan: Plan, backend: Backend, k_tokens: int):
    if t.do is None:
        raise DumpError(f"{t.where}: the dump has no 'do' array; rank1-sim needs dO to compute the δ error")
    lp, hp = lp_hp_pair(t, plan, backend, backward=False)
    dd = delta_error(t.do, lp.o, hp.o)  # (B, h, T)
    items = delta_items(t.step, t.layer, t.heads, t.do, lp.o, hp.o, lp.config.o_dtype.value,
                        layer_units(t, lp.config))
    pk = pk_rows(t.q, t.k, t.scale, t.causal, t.mask)  # (B, h, T, D)
    E = gradient_error(dd, pk, t.x, t.scale) if t.x is not None else None  # (h, D, C)
    chosen = []
    for j in range(len(t.heads)):
        flat = dd[:, j].abs().reshape(-1)
        idx = torch.argsort(flat, descending=True)[:k_tokens]
        rows = []
        for i in idx.tolist():
            b, T = divmod(i, dd.shape[2])
            xr = t.x[b, T].to(torch.float64) if t.x is not None else None
            rows.append((ChosenToken(t.step, b, T, float(dd[b, j, T])), pk[b, j, T].clone(), xr))
        chosen.append(rows)
    return dd, E, chosen, items


def run(
    dump,
    selections: Sequence[LayerSelection],
    recipe: Recipe | Plan = Recipe(),
    backend: Backend = Backend.EMULATE,
    *,
    tokens_per_step: int = 4,
    progress: Progress = None,
    workers: Workers = Workers(),
) -> Rank1Result:
    """Rank-1 structure and accumulation of the δ-driven W_Q gradient error in the focus head
    (the (layer, head) whose summed gradient error ‖Σ_s E_s‖ is largest; by |Σδ error| without X).
    Work items are (step, layer, head group) on `workers`, reduced in item order."""
    family = family_of(dump, selections)

    def combine(parts, resolved):
        return combine_parts(parts, resolved, backend, family, tokens_per_step=tokens_per_step)

    return run_over_items(layer_part, combine, dump, selections, recipe, backend, workers=workers, progress=progress,
                          args=(tokens_per_step,))


def rank1_sim_layers(
    layers: Iterable[LayerTensors],
    recipe: Recipe = Recipe(),
    backend: Backend = Backend.EMULATE,
    *,
    tokens_per_step: int = 4,
    progress: Progress = None,
) -> Rank1Result:
    """`run` on layer-steps already loaded (or built in memory)."""
    layers = list(layers)
    plan = plan_for_layers(layers, recipe)
    parts = layer_parts(layer_part, layers, (plan, backend, tokens_per_step), progress)
    return combine_parts(parts, plan.recipe, backend, family_of(None, (), layers), tokens_per_step=tokens_per_step)


@dataclass(frozen=True)
class Rank1Part:
    """What one layer-step (or head group of it) contributes, per selected head: Σδ error, the
    gradient error E (None without X) and the tokens with the largest |δ error|."""

    warnings: tuple[str, ...]
    step: int
    layer: int
    heads: list
    has_x: bool
    dsums: list  # float per head
    items: list  # [DeltaItem] per head (`quantities.delta_items`)
    E: Optional[torch.Tensor]  # (h, D, C)
    chosen: list  # per head: [(ChosenToken, pk row, x row)]


def layer_part(t: LayerTensors, plan: Plan, backend: Backend, tokens_per_step: int) -> Rank1Part:
    """Replay one layer-step (its selected heads); both sides see the inputs as the recipe sees them."""
    t = as_seen_by(t, lp_of(t, plan))
    dd, E, chosen, items = _layer_part(t, plan, backend, tokens_per_step)
    dsums = [float(dd[:, j].sum()) for j in range(len(t.heads))]
    return Rank1Part(t.warnings, t.step, t.layer, list(t.heads), t.x is not None, dsums, items, E, chosen)


def combine_parts(parts: Sequence[Rank1Part], recipe: Recipe, backend: Backend, family: Family, *,
                  tokens_per_step: int = 4) -> Rank1Result:
    """The result of the parts of every selected layer-step, reduced in their order; the focus is the Σδ claim's
    (layer, head)."""
    warnings: list[str] = []
    per_head: dict[tuple[int, int], dict] = {}
    items = []
    has_x = True
    for part in parts:
        warnings.extend(w for w in part.warnings if w not in warnings)
        items.extend(part.items)
        has_x = has_x and part.has_x
        for j, h in enumerate(part.heads):
            acc = per_head.setdefault((part.layer, h), {"E": [], "steps": [], "dsum": 0.0, "chosen": []})
            acc["steps"].append(part.step)
            acc["dsum"] += part.dsums[j]
            acc["chosen"].extend(part.chosen[j])
            if part.E is not None:
                acc["E"].append(part.E[j])

    decided = decide_deltas(items, family)
    claim = delta_claim(decided, family)
    assert claim.layer is not None and claim.head is not None  # a Σδ claim always names its (layer, head)
    focus_layer, focus_head = claim.layer, claim.head
    acc = per_head[(focus_layer, focus_head)]
    toks = [c[0] for c in acc["chosen"]]
    u_rows = torch.stack([c[1] for c in acc["chosen"]])  # (n, D)
    if has_x:
        x_rows = torch.stack([c[2] for c in acc["chosen"]])  # (n, C)
        cos = rank1_cosines(u_rows, x_rows)
    else:  # without X only the PK side can be compared
        x_rows = None
        un = torch.nn.functional.normalize(u_rows, dim=-1)
        cos = un @ un.T
    n = cos.shape[0]
    cos_mean = _offdiag_mean(cos)
    un = torch.nn.functional.normalize(u_rows, dim=-1)
    pk_cos_mean = _offdiag_mean(un @ un.T)
    x_cos_mean = float("nan")
    if x_rows is not None:
        xn = torch.nn.functional.normalize(x_rows, dim=-1)
        x_cos_mean = _offdiag_mean(xn @ xn.T)

    nan = float("nan")
    top_columns: list[ColumnWeight] = []
    sv_list: list[float] = []
    eff = ratio = align = expo = nan
    step_norms: list[float] = []
    cum_norms: list[float] = []
    examples: list = []
    n_columns = 0
    if has_x:
        w = column_weights(x_rows)
        n_columns = int(w.numel())
        order = torch.argsort(w, descending=True)[:10]
        top_columns = [ColumnWeight(int(c), float(w[c])) for c in order]
        Es = acc["E"]  # list of (D, C), in step order
        total = torch.stack(Es).sum(0)
        sv = torch.linalg.svdvals(total)
        sv_list = sv[:8].tolist()
        eff = effective_rank(sv)
        ratio = float(sv[0] ** 2 / (sv**2).sum()) if float(sv.sum()) > 0 else nan
        align = _cross_step_alignment(Es)
        step_norms = [float(torch.linalg.matrix_norm(E)) for E in Es]
        cum_norms = [float(torch.linalg.matrix_norm(c)) for c in torch.stack(Es).cumsum(0)]
        expo = growth_exponent(cum_norms)
        examples = [torch.outer(u_rows[i], x_rows[i]).float().tolist() for i in range(min(2, n))]
    return Rank1Result(
        has_x=has_x, focus_layer=focus_layer, focus_head=focus_head, tokens=toks,
        cosine=cos.tolist(), cosine_offdiag_mean=cos_mean,
        pk_cosine_offdiag_mean=pk_cos_mean, x_cosine_offdiag_mean=x_cos_mean, top_columns=top_columns,
        n_columns=n_columns,
        singular_values=sv_list, effective_rank=eff, top_sv_ratio=ratio, cross_step_alignment=align,
        steps=list(acc["steps"]), step_norms=step_norms, cumulative_norms=cum_norms,
        accumulation_exponent=expo, example_matrices=examples, recipe=recipe, backend=Backend(backend),
        claim=claim, family=family, warnings=tuple(warnings),
    )


def _offdiag_mean(m: torch.Tensor) -> float:
    off = m[~torch.eye(m.shape[0], dtype=torch.bool)]
    return float(off.mean()) if off.numel() else float("nan")


def _cross_step_alignment(Es: Sequence[torch.Tensor]) -> float:
    """Mean over pairs of steps of |⟨u1_s, u1_s'⟩|·|⟨v1_s, v1_s'⟩| (top singular vectors; 1 = same direction)."""
    if len(Es) < 2:
        return float("nan")
    tops = []
    for E in Es:
        U, S, Vh = torch.linalg.svd(E, full_matrices=False)
        tops.append((U[:, 0], Vh[0]))
    vals = [
        float(abs(tops[a][0] @ tops[b][0]) * abs(tops[a][1] @ tops[b][1]))
        for a in range(len(tops)) for b in range(a + 1, len(tops))
    ]
    return sum(vals) / len(vals) if vals else math.nan


def two_places(x: float, missing: str) -> str:
    """x with two decimals, or `missing` where it is NaN (not measured)."""
    return missing if x != x else f"{x:.2f}"


def focus_text(r: Rank1Result) -> str:
    """Why this head: the Σδ claim's, significant or not."""
    c = r.claim
    if c is None:
        return f"layer {r.focus_layer} head {r.focus_head}"
    where = f"layer {c.layer} head {c.head}"
    stats = (f"its Σδ {c.where_steps} {c.value:+.3g} ± {c.se:.2g} over {c.n_units} units, "
             f"{p_text(c.p_value, c.adjusted_p, c.n_tests)}")
    if c.found:
        held = ", its sign held at every step" if len(c.steps) > 1 else ""
        return f"{where}, the head with the significant Σδ bias ({stats}{held})"
    if c.sign_holds is False and significant(c.adjusted_p, c.effect):
        return (f"{where}, the most significant head, whose sign does not hold across steps (step(s) "
                f"{', '.join(map(str, c.opposed_steps))} of the other sign; {stats})")
    return f"{where}, the most significant head, though not significantly biased ({stats})"


def verdict(r: Rank1Result) -> str:
    """One sentence: which head and why, how alike the rank-1 matrices are, which features dominate, and whether the
    error compounds (said only where the head's Σδ bias is significant)."""
    found = r.claim is None or r.claim.found
    where = focus_text(r)
    if not r.has_x:
        return (f"{where}: the dump stores no X (attention input), so the rank-1 matrices (PK)[T]ᵀX[T] and the W_Q "
                f"gradient error cannot be formed; PK rows alone have mean cosine {r.cosine_offdiag_mean:+.2f}. "
                "Capture with X to run this analysis")
    expo = r.accumulation_exponent
    head = (f"{where}: rank-1 matrices have mean cosine {r.cosine_offdiag_mean:+.2f}, dominated by input features "
            f"{[c.feature for c in r.top_columns[:3]]}")
    if not any(x > 0 for x in r.cumulative_norms):
        return f"{head}; no W_Q gradient error to analyse (the low-precision and fp32 replays give the same gradient)"
    if expo != expo:
        trend = ("not measured: fewer than 3 steps" if len(r.cumulative_norms) < 3
                 else "not measured: the summed error is 0 at some step")
        return (f"{head}; gradient error effective rank {two_places(r.effective_rank, 'n/a')}, "
                f"accumulation exponent {trend}")
    if not found:
        return (f"{head}; gradient error effective rank {two_places(r.effective_rank, 'n/a')}, accumulation exponent "
                f"{two_places(expo, 'n/a')} over {len(r.steps)} steps (not interpreted: without a significant Σδ bias "
                "there is nothing to compound)")
    trend = "compounds" if expo > 0.75 else "washes out" if expo < 0.65 else "in between"
    return (f"{head}; gradient error effective rank {two_places(r.effective_rank, 'n/a')}, "
            f"accumulation exponent {two_places(expo, 'n/a')} over {len(r.steps)} steps ({trend})")


def payload(r: Rank1Result) -> Rank1SimPayload:
    """The --json payload (keys documented in docs/json.md)."""
    return {
        "has_x": r.has_x, "focus": {"layer": r.focus_layer, "head": r.focus_head}, "tokens": r.tokens,
        "cosine_offdiag_mean": r.cosine_offdiag_mean, "pk_cosine_offdiag_mean": r.pk_cosine_offdiag_mean,
        "x_cosine_offdiag_mean": r.x_cosine_offdiag_mean, "cosine": r.cosine, "top_columns": r.top_columns,
        "singular_values": r.singular_values, "effective_rank": r.effective_rank, "top_sv_ratio": r.top_sv_ratio,
        "cross_step_alignment": r.cross_step_alignment, "steps": r.steps, "step_norms": r.step_norms,
        "cumulative_norms": r.cumulative_norms, "accumulation_exponent": r.accumulation_exponent,
        "claim": r.claim, "family": r.family.as_dict(),
        **recipe_keys(r.recipe, r.backend), **common_keys(r), "verdict": verdict(r),
    }
