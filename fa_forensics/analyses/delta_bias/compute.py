"""delta-bias: the sign of (δ_lp − δ_hp) and where it comes from (paper §3.3.1-3.3.2, Fig. 5).

δ = rowsum(dO ∘ O), so per token (δ_lp − δ_hp)[T] = Σ_i dO[T,i]·(O_lp − O_hp)[T,i]: the O error of
the low-precision forward weighted by the upstream gradient. Its sum over tokens is the coefficient
of the common low-rank direction R in Eq. 3; a consistent sign across steps (Fig. 5a) is what makes
the gradient error compound. Per feature i, Σ_T dO[T,i]·(O_lp − O_hp)[T,i] says which features carry
it, and the sign agreement of dO and the O error shows the paper's mechanism (Fig. 5b/c: both
negative in features 20 and 29). All arithmetic here is float64 on exactly upcast tensors.

"lp" is the recipe's low-precision config (default preset "auto": per layer-step the one that
reproduces the stored O; "bf16-autocast" is the forward of the paper's reference code, "bf16-hw" the
hardware kernels' fp32 accumulator; `fa-forensics match`
says which one reproduces a dump's stored O); "hp" is always the fp32 preset on the same stored inputs.

The numbers per (step, layer, head) are the shared Σδ items of `analyses.quantities`, decided by the
statistics policy (`analyses.significance`); the focus head (features, top token) is the claim's
(layer, head): the most significant item's.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from fa_forensics.analyses.contract import RecipeResult, common_keys, recipe_keys, run_over_items
from fa_forensics.analyses.primitives import delta_error
from fa_forensics.analyses.quantities import (BiasClaim, DeltaItem, PooledDelta, Total, count_text, decide_deltas,
                                              decide_pooled, delta_claim, delta_items, family_of, flagged_subset,
                                              head_total, item_text, pooled_dict, run_claim_text, total_of)
from fa_forensics.analyses.significance import Family
from fa_forensics.analyses.units import layer_units
from fa_forensics.layers.fanout import Workers, layer_parts
from fa_forensics.enums import Backend
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.fidelity.match import ReplayFidelity
from fa_forensics.fidelity.pair import lp_hp_pair, lp_of
from fa_forensics.fidelity.plan import Plan
from fa_forensics.fidelity.planner import plan_for_layers
from fa_forensics.layers.selection import LayerSelection, LayerTensors, as_f64, as_seen_by
from fa_forensics.analyses.stats import sign_test
from fa_forensics.analyses.payloads import DeltaBiasPayload
from fa_forensics.errors import DumpError

Progress = Optional[Callable[[str], None]]


# ---- pure tensor functions ---------------------------------------------------------------------

def feature_contributions(do: torch.Tensor, o_lp: torch.Tensor, o_hp: torch.Tensor):
    """Per head and feature: contribution Σ_{B,T} dO·(O_lp − O_hp), and sign-agreement counts.

    Returns (contribution (h, D) float64, agree (h, D) int64, both_nonzero (h, D) int64): `agree`
    counts tokens where dO and the O error have the same sign, among `both_nonzero` tokens.
    """
    do64 = as_f64(do)
    err = as_f64(o_lp) - as_f64(o_hp)  # (B, h, T, D)
    contribution = (do64 * err).sum(dim=(0, 2))  # (h, D)
    s_do, s_err = torch.sign(do64), torch.sign(err)
    both = (s_do != 0) & (s_err != 0)
    agree = (both & (s_do == s_err)).sum(dim=(0, 2))
    return contribution, agree, both.sum(dim=(0, 2))


# ---- results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FeatureContribution:
    """One feature's share of Σ_T(δ_lp − δ_hp) in the focus head (summed over steps and batch)."""

    feature: int
    contribution: float  # Σ_T dO[T,i]·(O_lp − O_hp)[T,i]
    sign_agreement: float  # fraction of tokens where sign(dO) == sign(O error), among both nonzero
    share: float  # contribution / Σ_i contribution


@dataclass(frozen=True)
class TopToken:
    """The token of the focus head with the largest (δ_lp − δ_hp) in the direction of the bias (Fig. 5b/c)."""

    step: int
    batch: int
    token: int
    delta_err: float
    do: list[float]  # dO[T, :]  (D,)
    o_err: list[float]  # (O_lp − O_hp)[T, :]  (D,)


@dataclass(frozen=True)
class DeltaBiasResult(RecipeResult):
    per_step: list[DeltaItem]  # every (step, layer, head) item, decided in `family`
    steps: list[int]
    step_sums: list[float]  # Σ over the selected layers and heads of Σ_T(δ_lp − δ_hp), per step
    cumulative: list[float]  # cumulative sum of step_sums across steps (Fig. 5a)
    total: float  # Σ of every item (`quantities.total_of`)
    total_se: float
    total_p_value: float  # sign test over every selected token
    total_frac_positive: float
    n_tokens: int
    focus_layer: int  # the claim's (layer, head): the most significant item's
    focus_head: int
    cumulative_tokens: list[float]  # focus head, first step, batch 0: cumulative Σ over tokens T
    top_features: list[FeatureContribution]  # focus head, largest |contribution| first
    top_token: Optional[TopToken]
    recipe: Recipe  # the low-precision side replayed against fp32
    backend: Backend
    family: Family = Family()
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None
    # per (layer, head) with items at two or more steps: its Σδ pooled over them, decided in `family`
    pooled: list[PooledDelta] = field(default_factory=list)

    @property
    def no_difference(self) -> bool:
        """True when the low-precision replay equals the fp32 one in every token (nothing to analyse)."""
        return self.total == 0 and all(p.delta_err_sum == 0 for p in self.per_step)

    @property
    def total_t_p_value(self) -> float:
        """Two-sided t-test p-value of the total."""
        return Total(self.total, self.total_se, len(self.per_step), self.n_tokens).t_p_value

    @property
    def claim(self) -> BiasClaim:
        return delta_claim(self.per_step, self.family)

    @property
    def significant_items(self) -> list[DeltaItem]:
        return [p for p in self.per_step if p.found]

    @property
    def focus_items(self) -> list[DeltaItem]:
        """The focus head's Σδ items, one per selected step, in step order (paper Fig. 5a's series)."""
        return sorted((p for p in self.per_step if (p.layer, p.head) == (self.focus_layer, self.focus_head)),
                      key=lambda p: p.step)

    @property
    def focus_pooled(self) -> Optional[PooledDelta]:
        """The focus head's Σδ pooled over its steps (all rows; None with one step)."""
        return next((p for p in self.pooled if (p.layer, p.head) == (self.focus_layer, self.focus_head)), None)

    @property
    def focus_total(self) -> Total:
        """The focus head's Σδ over its selected steps: with several steps its pooled item's sum and cluster-robust
        se (over the units of every step), else its one item's."""
        p = self.focus_pooled
        if p is not None:
            return Total(p.delta_err_sum, p.delta_err_se, len(p.steps), p.n_tokens, p.n_units)
        return head_total(self.per_step, self.focus_layer, self.focus_head)


# ---- per layer-step, then combined ---------------------------------------------------------------

@dataclass(frozen=True)
class _LayerPart:
    sel: LayerSelection
    items: list  # [DeltaItem] per head (`quantities.delta_items`)
    dd: torch.Tensor  # (B, h, T) δ_lp − δ_hp
    contribution: torch.Tensor  # (h, D)
    agree: torch.Tensor  # (h, D)
    both: torch.Tensor  # (h, D)
    do: torch.Tensor  # (B, h, T, D) float32, for the top-token panel
    o_err: torch.Tensor  # (B, h, T, D) float32


def _layer_part(t: LayerTensors, plan: Plan, backend: Backend) -> _LayerPart:
    if t.do is None:
        raise DumpError(f"{t.where}: the dump has no 'do' array; delta-bias needs the upstream gradient dO")
    lp, hp = lp_hp_pair(t, plan, backend, backward=False)
    dd = delta_error(t.do, lp.o, hp.o)
    items = delta_items(t.step, t.layer, t.heads, t.do, lp.o, hp.o, lp.config.o_dtype.value,
                        layer_units(t, lp.config))
    contribution, agree, both = feature_contributions(t.do, lp.o, hp.o)
    o_err = (lp.o.to(torch.float64) - hp.o.to(torch.float64)).to(torch.float32)
    sel = LayerSelection(t.step, t.layer, list(t.heads))
    return _LayerPart(sel, items, dd, contribution, agree, both, t.do.to(torch.float32), o_err)


def run(
    dump,
    selections: Sequence[LayerSelection],
    recipe: Recipe | Plan = Recipe(),
    backend: Backend = Backend.EMULATE,
    *,
    top_k: int = 8,
    progress: Progress = None,
    workers: Workers = Workers(),
) -> DeltaBiasResult:
    """Σ_T(δ_lp − δ_hp) per (step, layer, head) with its cluster-robust t-test over units, its cumulative sum across
    steps, and the features that carry it in the focus head (the most significant item's).

    Work items are (step, layer, group of heads) (`fanout.work_items`), each replayed and reduced
    to its part on one thread, in-process or on `workers`; parts are combined in item order, so the
    result is the same for any number of workers. `progress` is called once per work item."""
    family = family_of(dump, selections)
    return run_over_items(_seen_part, lambda parts, r: _combine(_join_head_groups(parts), r, backend, family,
                                                                top_k=top_k),
                          dump, selections, recipe, backend, workers=workers, progress=progress)


def delta_bias_layers(
    layers: Iterable[LayerTensors],
    recipe: Recipe = Recipe(),
    backend: Backend = Backend.EMULATE,
    *,
    top_k: int = 8,
    progress: Progress = None,
) -> DeltaBiasResult:
    """`run` on layer-steps already loaded (or built in memory)."""
    layers = list(layers)
    plan = plan_for_layers(layers, recipe)
    return _combine(layer_parts(_seen_part, layers, (plan, backend), progress), plan.recipe, backend,
                    family_of(None, (), layers), top_k=top_k)


def _seen_part(t: LayerTensors, plan: Plan, backend: Backend) -> tuple[tuple[str, ...], _LayerPart]:
    """(warnings, part) of one layer-step; both sides replay the inputs as the recipe sees them."""
    t = as_seen_by(t, lp_of(t, plan))
    return t.warnings, _layer_part(t, plan, backend)


def _join_head_groups(parts: Sequence[tuple[tuple[str, ...], _LayerPart]]) -> list[tuple[tuple[str, ...], _LayerPart]]:
    """Consecutive parts of one (step, layer) joined along the head dimension, in order."""
    out: list[tuple[tuple[str, ...], _LayerPart]] = []
    for warns, part in parts:
        if out and (out[-1][1].sel.step, out[-1][1].sel.layer) == (part.sel.step, part.sel.layer):
            w0, p0 = out[-1]
            sel = LayerSelection(p0.sel.step, p0.sel.layer, [*p0.sel.heads, *part.sel.heads])
            joined = _LayerPart(sel, [*p0.items, *part.items], torch.cat([p0.dd, part.dd], 1),
                                torch.cat([p0.contribution, part.contribution]),
                                torch.cat([p0.agree, part.agree]), torch.cat([p0.both, part.both]),
                                torch.cat([p0.do, part.do], 1), torch.cat([p0.o_err, part.o_err], 1))
            out[-1] = (w0 + tuple(w for w in warns if w not in w0), joined)
        else:
            out.append((warns, part))
    return out


def _combine(parts: Iterable[tuple[tuple[str, ...], _LayerPart]], recipe: Recipe, backend: Backend, family: Family,
             *, top_k: int) -> DeltaBiasResult:
    """The result from the parts of every layer-step, in selection order."""
    warnings: list[str] = []
    items: list[DeltaItem] = []
    all_dd: list[torch.Tensor] = []
    by_head: dict[tuple[int, int], dict] = {}
    for layer_warnings, part in parts:
        warnings.extend(w for w in layer_warnings if w not in warnings)
        sel = part.sel
        all_dd.append(part.dd.reshape(-1))
        items.extend(part.items)
        for j, h in enumerate(sel.heads):
            acc = by_head.setdefault((sel.layer, h), {"contribution": 0, "agree": 0, "both": 0, "tokens": []})
            acc["contribution"] = acc["contribution"] + part.contribution[j]
            acc["agree"] = acc["agree"] + part.agree[j]
            acc["both"] = acc["both"] + part.both[j]
            acc["tokens"].append((sel.step, part.dd[:, j], part.do[:, j], part.o_err[:, j]))

    per_step, pooled = decide_deltas(items, family), decide_pooled(items, family)
    steps = sorted({p.step for p in per_step})
    step_sums = [total_of(p for p in per_step if p.step == s).value for s in steps]
    cumulative = torch.tensor(step_sums, dtype=torch.float64).cumsum(0).tolist()
    total, total_st = total_of(per_step), sign_test(torch.cat(all_dd))

    claim = delta_claim(per_step, family)
    assert claim.layer is not None and claim.head is not None  # a Σδ claim always names its (layer, head)
    focus_layer, focus_head = claim.layer, claim.head
    acc = by_head[(focus_layer, focus_head)]
    contribution = acc["contribution"]  # (D,)
    denom = float(contribution.sum())
    agree_frac = acc["agree"].double() / acc["both"].clamp(min=1).double()
    order = torch.argsort(contribution.abs(), descending=True)[:top_k]
    top_features = [
        FeatureContribution(int(i), float(contribution[i]), float(agree_frac[i]),
                            float(contribution[i]) / denom if denom else float("nan"))
        for i in order
    ]
    first_step, dd0, _, _ = acc["tokens"][0]
    cumulative_tokens = dd0[0].cumsum(0).tolist()
    head_sum = head_total(per_step, focus_layer, focus_head).value
    top_token = _top_token(acc["tokens"], sign=1.0 if head_sum >= 0 else -1.0)
    return DeltaBiasResult(
        per_step=per_step, steps=steps, step_sums=step_sums, cumulative=cumulative,
        total=total.value, total_se=total.se, total_p_value=total_st.p_value,
        total_frac_positive=total_st.frac_positive, n_tokens=total.n_tokens,
        focus_layer=focus_layer, focus_head=focus_head, cumulative_tokens=cumulative_tokens,
        top_features=top_features, top_token=top_token, recipe=recipe, backend=Backend(backend), family=family,
        warnings=tuple(warnings), pooled=pooled,
    )


def _top_token(tokens, sign: float) -> Optional[TopToken]:
    best = None
    for step, dd, do, o_err in tokens:  # dd (B, T); do, o_err (B, T, D)
        flat = (sign * dd).reshape(-1)
        i = int(torch.argmax(flat))
        if best is None or float(flat[i]) > best[0]:
            b, T = divmod(i, dd.shape[1])
            best = (float(flat[i]), step, b, T, float(dd[b, T]), do[b, T].tolist(), o_err[b, T].tolist())
    if best is None:
        return None
    _, step, b, T, value, do_row, err_row = best
    return TopToken(step, b, T, value, do_row, err_row)


def verdict(r: DeltaBiasResult) -> str:
    """One sentence: the Σδ claim (over steps: pooled, with whether its sign held at every step), where Σ(δ_lp − δ_hp)
    is significant at single steps (what the count counts), the focus head over its steps, the features that carry
    it, and the selection's total."""
    if r.no_difference:
        return (f"preset {r.preset}: no difference from the fp32 replay (δ_lp = δ_hp for all {r.n_tokens} tokens): "
                f"nothing to analyse; choose a low-precision preset")
    n, sig = len(r.per_step), r.significant_items
    top = flagged_subset(r.per_step)
    head = r.focus_total
    features = [f.feature for f in r.top_features[:3]]
    total = f"the selection's total is {r.total:+.3g} ± {r.total_se:.2g} over {r.n_tokens} tokens"
    run = run_claim_text(r.per_step, r.family)
    if not sig:
        return (f"preset {r.preset}: {run}no significant Σ(δ_lp − δ_hp) in any of the {n} (step, layer, head) items "
                f"(most significant: {item_text(top, r.family.n_tests)}); {total}")
    signs = {p.delta_err_sum > 0 for p in sig}
    sign = ("positive" if signs == {True} else "negative") if len(signs) == 1 else "of both signs"
    return (f"preset {r.preset}: {run}Σ(δ_lp − δ_hp) is significantly {sign} in {count_text(sig)} ({len(sig)} of {n} "
            f"(step, layer, head) items); most significant: {item_text(top, r.family.n_tests)}; layer {r.focus_layer} "
            f"head {r.focus_head} over its {head.n_items} step{'s' if head.n_items != 1 else ''}: {head.value:+.3g} ± "
            f"{head.se:.2g}, carried by features {features}; {total}")


def bias_claim(r: DeltaBiasResult) -> BiasClaim:
    """The most significant (step, layer, head) item, decided by the policy."""
    return r.claim


def payload(r: DeltaBiasResult) -> DeltaBiasPayload:
    """The --json payload (keys documented in docs/json.md)."""
    return {
        "per_step": r.per_step, "steps": r.steps, "step_sums": r.step_sums, "cumulative": r.cumulative,
        "top_features": r.top_features,
        "focus": {"layer": r.focus_layer, "head": r.focus_head, "delta_err_sum": r.focus_total.value,
                  "se": r.focus_total.se, "steps": r.focus_total.n_items, "n_units": r.focus_total.n_units},
        "total": {"delta_err_sum": r.total, "se": r.total_se, "t_p_value": r.total_t_p_value,
                  "p_value": r.total_p_value, "frac_positive": r.total_frac_positive, "n_tokens": r.n_tokens},
        "pooled": [pooled_dict(p) for p in r.pooled],
        "top_token": r.top_token, "cumulative_tokens": r.cumulative_tokens, "bias": bias_claim(r),
        "family": r.family.as_dict(),
        **recipe_keys(r.recipe, r.backend), **common_keys(r), "verdict": verdict(r),
    }
