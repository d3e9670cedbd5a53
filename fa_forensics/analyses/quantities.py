"""The numbers the analyses share, each defined once, and the bias claims made from them.

- Σδ items (`DeltaItem`, `delta_items`): per (step, layer, head), Σ_T(δ_lp − δ_hp) over every token of every
  batch entry, δ = rowsum(dO ∘ O) in float64, with its standard error s·√n, a t-test and a sign test over the
  tokens, and its rounding unit Σ_T ‖dO[T] ∘ ulp(O_hp[T])‖₂. isolate, delta-bias, rank1-sim and fix-check
  quote these; a head's number over several steps is `head_total`, the selection's is `total_of` (sums of the
  items, standard errors in quadrature), so the same (step, layer, head) reads the same in every command.
- O cells (`BiasCell`, `cell_sums`, `o_cells`): per (layer, head, feature), the mean of O_lp − O_hp over every
  row of every selected step and batch entry, ± se, with a t-test and a sign test over the rows and its rounding
  unit (the mean ulp of the low-precision O format at |O_hp|). bitdiff, fix-check and pv-trace quote these.
- The family (`selection_family`, `layers_family`) and the decision (`decide_deltas`, `o_cells`), by the
  policy of `analyses.significance`; the claim (`BiasClaim`: `delta_claim`, `o_claim`) is the most significant
  item or cell, found or not, so that every command names the same place.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch

from fa_forensics.analyses.significance import Family, effect, holm, p_text, significant
from fa_forensics.analyses.stats import MeanSE, sign_test, sum_se


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def o_units(o_hp: torch.Tensor, fmt: str) -> torch.Tensor:
    """The rounding unit of each O element: the ulp of `fmt` at |O_hp| (float64, O's shape)."""
    from fa_forensics.numerics import ulp

    return ulp(_f64(o_hp).nan_to_num(0.0, posinf=0.0, neginf=0.0).abs(), fmt).to(torch.float64)


def delta_units(do: torch.Tensor, o_hp: torch.Tensor, fmt: str) -> torch.Tensor:
    """The rounding unit of each token's δ: ‖dO[T] ∘ ulp(O_hp[T])‖₂ over the features.  (B, h, T, D) -> (B, h, T)"""
    return (_f64(do) * o_units(o_hp, fmt)).norm(dim=-1)


# ---- Σδ per (step, layer, head) ---------------------------------------------------------------------

@dataclass(frozen=True)
class DeltaItem:
    """Σ_T(δ_lp − δ_hp) of one (step, layer, head), summed over the batch, with its tests and rounding unit."""

    step: int
    layer: int
    head: int
    delta_err_sum: float
    delta_err_se: float  # standard error of the sum (s·√n over tokens)
    n_tokens: int
    frac_positive: float  # tokens with δ_lp > δ_hp among those that differ
    t_p_value: float  # one-sample t-test of the per-token errors
    p_value: float  # two-sided sign test over the tokens
    unit: float  # Σ_T ‖dO[T] ∘ ulp(O_hp[T])‖₂: the sum's rounding unit
    effect: float = math.nan  # |Σ| / unit
    adjusted_p: float = math.nan  # the smaller test's p, Holm over the selection's family (`decide_deltas`)
    significant: bool = False

    @property
    def tested_p(self) -> float:
        """The smaller of the two tests' p-values (the family counts both tests)."""
        return min(self.t_p_value, self.p_value)


def delta_items(step: int, layer: int, heads: Sequence[int], do: torch.Tensor, o_lp: torch.Tensor,
                o_hp: torch.Tensor, fmt: str) -> list[DeltaItem]:
    """The Σδ item of each head of one layer-step; do, o_lp, o_hp (B, h, T, D), `fmt` the low-precision O format."""
    dd = (_f64(do) * (_f64(o_lp) - _f64(o_hp))).sum(-1)  # (B, h, T) δ_lp − δ_hp
    return items_of_errors(step, layer, heads, dd, delta_units(do, o_hp, fmt))


def items_of_errors(step: int, layer: int, heads: Sequence[int], dd: torch.Tensor,
                    units: torch.Tensor) -> list[DeltaItem]:
    """The Σδ items of per-token errors dd = δ_var − δ_hp (B, h, T) with their rounding units (B, h, T): for a δ
    that does not come from O (a backward's own δ), measured in the same units as the forward's."""
    out = []
    for j, h in enumerate(heads):
        s, st = sum_se(dd[:, j]), sign_test(dd[:, j])
        unit = float(units[:, j].sum())
        out.append(DeltaItem(int(step), int(layer), int(h), s.value, s.se, s.n, st.frac_positive, s.p_value,
                             st.p_value, unit, effect(s.value, unit)))
    return out


def decide_deltas(items: Sequence[DeltaItem], family: Family) -> list[DeltaItem]:
    """The items with their Holm-adjusted p-values in `family` and the policy's decision."""
    adjusted = holm([i.tested_p for i in items], family.n_tests)
    return [replace(i, adjusted_p=a, significant=significant(a, i.effect)) for i, a in zip(items, adjusted)]


@dataclass(frozen=True)
class Total:
    """A sum of Σδ items (one head over its steps, or the whole selection), its se in quadrature."""

    value: float
    se: float
    n_items: int
    n_tokens: int

    @property
    def t_p_value(self) -> float:
        return MeanSE(self.value, self.se, self.n_tokens).p_value


def total_of(items: Iterable[DeltaItem]) -> Total:
    """Σ of the items' sums (in their order), se = √(Σ se²)."""
    items = list(items)
    value = sum(i.delta_err_sum for i in items)
    se = math.sqrt(sum(i.delta_err_se ** 2 for i in items if math.isfinite(i.delta_err_se)))
    return Total(value, se if items else math.nan, len(items), sum(i.n_tokens for i in items))


def head_total(items: Iterable[DeltaItem], layer: int, head: int) -> Total:
    """The Σδ of one (layer, head) over its selected steps."""
    return total_of(i for i in items if (i.layer, i.head) == (layer, head))


def flagged(items: Sequence[DeltaItem]) -> DeltaItem:
    """The most significant item (smallest adjusted p, then the largest effect): the Σδ claim's place."""
    return min(items, key=lambda i: (i.adjusted_p if math.isfinite(i.adjusted_p) else 2.0, i.tested_p,
                                     -(i.effect if math.isfinite(i.effect) else abs(i.delta_err_sum))))


def count_text(items: Iterable[DeltaItem]) -> str:
    """What a set of (step, layer, head) items counts, in words: '1 head over 3 steps', '2 heads over 1 step'."""
    items = list(items)
    heads = {(i.layer, i.head) for i in items}
    steps = {i.step for i in items}
    return (f"{len(heads)} head{'s' if len(heads) != 1 else ''} over {len(steps)} step{'s' if len(steps) != 1 else ''}"
            if items else "no head")


def item_text(i: DeltaItem, n_tests: int) -> str:
    """'step 0 layer 0 head 1: +2.47 ± 0.31 (0.52 rounding units; p = …, … after Holm over 280 tests)'."""
    return (f"step {i.step} layer {i.layer} head {i.head}: {i.delta_err_sum:+.3g} ± {i.delta_err_se:.2g} "
            f"({i.effect:.2g} rounding units; {p_text(i.tested_p, i.adjusted_p, n_tests)})")


# ---- O bias per (layer, head, feature) ---------------------------------------------------------------

@dataclass(frozen=True)
class BiasCell:
    """Mean signed error of one (layer, head, feature) over all its rows, with its uncertainty and rounding unit."""

    layer: int
    head: int
    feature: int
    mean: float
    se: float
    p_value: float  # two-sided sign test
    frac_positive: float
    n: int
    unit: float = math.nan  # mean rounding unit (ulp of the compared format at the reference value)
    t_p_value: float = math.nan  # one-sample t-test of the rows' errors
    effect: float = math.nan  # |mean| / unit
    adjusted_p: float = math.nan  # the smaller test's p, Holm over the selection's family
    significant: bool = False

    @property
    def tested_p(self) -> float:
        """The smaller of the two tests' p-values (the family counts both tests)."""
        return min(self.p_value, self.t_p_value) if math.isfinite(self.t_p_value) else self.p_value


@dataclass(frozen=True)
class CellSums:
    """Sufficient statistics of one layer-step's O errors per (head, feature), merged across steps by `o_cells`."""

    step: int
    layer: int
    heads: list[int]
    n: torch.Tensor  # (h, D) rows whose error is finite
    s1: torch.Tensor  # (h, D) Σ err
    s2: torch.Tensor  # (h, D) Σ err²
    n_pos: torch.Tensor  # (h, D)
    n_neg: torch.Tensor  # (h, D)
    unit: torch.Tensor  # (h, D) Σ rounding unit over the finite rows


def cell_sums(step: int, layer: int, heads: Sequence[int], err: torch.Tensor, unit: torch.Tensor) -> CellSums:
    """Per-(head, feature) sums of err = O_a − O_b (B, h, T, D) and of its rounding unit (same shape); a
    non-finite error is left out of its cell, not counted as 0."""
    raw = _f64(err)
    finite = torch.isfinite(raw)
    d = torch.where(finite, raw, torch.zeros_like(raw))
    u = torch.where(finite, _f64(unit), torch.zeros_like(raw))
    return CellSums(int(step), int(layer), [int(h) for h in heads], finite.sum(dim=(0, 2)), d.sum(dim=(0, 2)),
                    (d * d).sum(dim=(0, 2)), (d > 0).sum(dim=(0, 2)), (d < 0).sum(dim=(0, 2)), u.sum(dim=(0, 2)))


def _pooled(parts: Iterable[CellSums], only: Optional[tuple[int, int]] = None) -> dict[tuple[int, int], list]:
    """{(layer, head): [n, Σ err, Σ err², n > 0, n < 0, Σ unit]}, each (D,), the parts' steps pooled (`only`: one
    (layer, head))."""
    pooled: dict[tuple[int, int], list] = {}
    for p in parts:
        for hi, head in enumerate(p.heads):
            if only is not None and (p.layer, head) != only:
                continue
            acc = pooled.setdefault((p.layer, head), [0, 0.0, 0.0, 0, 0, 0.0])
            for k, x in enumerate((p.n[hi], p.s1[hi], p.s2[hi], p.n_pos[hi], p.n_neg[hi], p.unit[hi])):
                acc[k] = acc[k] + x
    return pooled


def _cells_of(layer: int, head: int, sums: list, features: Iterable[int]) -> list[BiasCell]:
    """The undecided cells of `features` of one (layer, head) from its pooled sums."""
    from scipy.stats import binomtest

    n, s1, s2, npos, nneg, usum = sums
    n = torch.as_tensor(n, dtype=torch.float64)  # (D,)
    mean = s1 / n
    var = (s2 - n * mean * mean).clamp(min=0) / (n - 1).clamp(min=1)
    se = torch.where(n > 1, (var / n).sqrt(), torch.full_like(var, math.nan))
    unit = usum / n
    cells = []
    for f in features:
        k, m = int(npos[f]), int(npos[f] + nneg[f])
        p = float(binomtest(k, m, 0.5).pvalue) if m else 1.0
        t_p = MeanSE(float(mean[f]), float(se[f]), int(n[f])).p_value
        cells.append(BiasCell(layer, head, f, float(mean[f]), float(se[f]), p, k / m if m else math.nan,
                              int(n[f]), float(unit[f]), t_p, effect(float(mean[f]), float(unit[f]))))
    return cells


def o_cells(parts: Iterable[CellSums], family: Optional[Family] = None) -> list[BiasCell]:
    """Every (layer, head, feature) cell, its rows pooled over the parts' steps, sorted by (layer, head, feature);
    decided in `family` (default: the cells alone)."""
    cells = [c for (layer, head), sums in sorted(_pooled(parts).items())
             for c in _cells_of(layer, head, sums, range(len(sums[1])))]
    family = family if family is not None else Family(o_cells=len(cells))
    adjusted = holm([c.tested_p for c in cells], family.n_tests)
    return [replace(c, adjusted_p=a, significant=significant(a, c.effect)) for c, a in zip(cells, adjusted)]


def o_cell(parts: Iterable[CellSums], layer: int, head: int, feature: int) -> Optional[BiasCell]:
    """One cell of `o_cells`, its statistics alone (undecided: its Holm p needs the others); None when no part
    holds it."""
    sums = _pooled(parts, only=(layer, head)).get((layer, head))
    return None if sums is None else _cells_of(layer, head, sums, (feature,))[0]


def most_significant(cells: Sequence[BiasCell]) -> BiasCell:
    """The O claim's cell: the smallest adjusted p, then the largest effect."""
    return min(cells, key=lambda c: (c.adjusted_p if math.isfinite(c.adjusted_p) else 2.0, c.tested_p,
                                     -(c.effect if math.isfinite(c.effect) else abs(c.mean))))


# ---- the family of a selection ---------------------------------------------------------------------

def selection_family(dump, selections) -> Family:
    """The tests a selection of a dump makes: one Σδ item per selected (step, layer, head) whose layer-step has
    dO, one O cell per selected (layer, head, feature) (rows pooled over steps)."""
    delta, cells = 0, set()
    for sel in selections:
        if dump.has(sel.step, sel.layer, "do"):
            delta += len(sel.heads)
        head_dim = int(dump.layer_info(sel.step, sel.layer).head_dim)
        cells.update((sel.layer, h, f) for h in sel.heads for f in range(head_dim))
    return Family(delta_items=delta, o_cells=len(cells))


def layers_family(layers) -> Family:
    """`selection_family` of layer-steps already loaded (or built in memory)."""
    delta, cells = 0, set()
    for t in layers:
        if t.do is not None:
            delta += len(t.heads)
        cells.update((t.layer, h, f) for h in t.heads for f in range(t.q.shape[-1]))
    return Family(delta_items=delta, o_cells=len(cells))


def family_of(dump, selections, layers=()) -> Family:
    """The selection's family from the dump, or from the layers when there is no dump (in-memory layers)."""
    return selection_family(dump, selections) if dump is not None else layers_family(layers)


# ---- the claim -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BiasClaim:
    """Where an analysis finds a bias, in the same terms for every command.

    quantity "O": the mean of O_lp − O_hp in one (layer, head, feature) cell; "delta": Σ_T(δ_lp − δ_hp) of one
    (step, layer, head). found: the policy's decision (`significance.significant`) for the most significant
    item; the location and sign are that item's even when nothing is found.
    """

    found: bool
    quantity: str
    layer: Optional[int]
    head: Optional[int]
    sign: int  # +1, −1 (0 when there is nothing to sign)
    p_value: float
    n_tests: int
    step: Optional[int] = None
    feature: Optional[int] = None
    adjusted_p: float = math.nan
    effect: float = math.nan  # |bias| in rounding units
    value: float = math.nan  # the bias: Σδ of the item, or the cell's mean O error
    se: float = math.nan
    family: str = ""


def _sign(value: float) -> int:
    return 0 if not value or not math.isfinite(value) else (1 if value > 0 else -1)


def delta_claim(items: Sequence[DeltaItem], family: Family) -> BiasClaim:
    """The Σδ claim: the flagged item of decided `items`."""
    i = flagged(items)
    return BiasClaim(i.significant, "delta", i.layer, i.head, _sign(i.delta_err_sum), i.tested_p, family.n_tests,
                     step=i.step, adjusted_p=i.adjusted_p, effect=i.effect, value=i.delta_err_sum, se=i.delta_err_se,
                     family=family.describe())


def o_claim(cells: Sequence[BiasCell], family: Family) -> BiasClaim:
    """The O claim: the most significant of decided `cells`."""
    c = most_significant(cells)
    return BiasClaim(c.significant, "O", c.layer, c.head, _sign(c.mean), c.tested_p, family.n_tests,
                     feature=c.feature, adjusted_p=c.adjusted_p, effect=c.effect, value=c.mean, se=c.se,
                     family=family.describe())
