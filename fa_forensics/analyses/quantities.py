"""The numbers the analyses share, each defined once, and the bias claims made from them.

- The unit of evidence (`analyses.units`): the rows of one (step, batch row) that share their dominant key set
  err together and count as one unit; every test below counts units (`stats.unit_test`: a cluster-robust
  t-test and a sign test over the units' sums), over all rows and, in the same family, over the tied rows
  (maximum attained more than once: where the P̄ = 1 mechanism acts; each item and cell holds its `tied`).
- Σδ items (`DeltaItem`, `delta_items`): per (step, layer, head), Σ_T(δ_lp − δ_hp) over every token of every
  batch entry, δ = rowsum(dO ∘ O) in float64, with its cluster-robust standard error, a t-test and a sign test
  over the units, and its rounding unit Σ_T ‖dO[T] ∘ ulp(O_hp[T])‖₂. isolate, delta-bias, rank1-sim and fix-check
  quote these; a head's number over several steps is `head_total`, the selection's is `total_of` (sums of the
  items, standard errors in quadrature), so the same (step, layer, head) reads the same in every command.
- O cells (`BiasCell`, `cell_sums`, `o_cells`): per (layer, head, feature), the mean of O_lp − O_hp over every
  row of every selected step and batch entry, ± se, with a t-test and a sign test over the units and its rounding
  unit (the mean ulp of the low-precision O format at |O_hp|). bitdiff, fix-check and pv-trace quote these.
- The family (`selection_family`, `layers_family`) and the decision (`decide_deltas`, `o_cells`), by the
  policy of `analyses.significance`; the claim (`BiasClaim`: `delta_claim`, `o_claim`) is the most significant
  item or cell, found or not, so that every command names the same place.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Optional, TypeVar

import torch

from fa_forensics.analyses.significance import (ALL_ROWS, SUBSETS, TIED_ROWS, UNIT_KIND, Family, effect, holm,
                                                p_text, significant)
from fa_forensics.analyses.stats import MeanSE, UnitSums, merge_unit_sums, unit_sums, unit_test
from fa_forensics.analyses.units import RowUnits, rows_as_units


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
    """Σ_T(δ_lp − δ_hp) of one (step, layer, head), summed over the batch, over one subset of its rows (all rows;
    `tied` holds the tied rows'), with its tests over units and its rounding unit."""

    step: int
    layer: int
    head: int
    delta_err_sum: float
    delta_err_se: float  # cluster-robust standard error of the sum (`stats.unit_test`)
    n_tokens: int
    frac_positive: float  # units whose Σ(δ_lp − δ_hp) is positive, among those with a sign
    t_p_value: float  # cluster-robust t-test over the units
    p_value: float  # two-sided sign test over the units' sums
    unit: float  # Σ_T ‖dO[T] ∘ ulp(O_hp[T])‖₂: the sum's rounding unit
    effect: float = math.nan  # |Σ| / unit
    adjusted_p: float = math.nan  # the smaller test's p, Holm over the selection's family (`decide_deltas`)
    significant: bool = False
    n_units: int = 0  # independent units: (step, batch row, dominant key set)
    subset: str = ALL_ROWS
    tied: Optional[DeltaItem] = None  # the same item over the tied rows only (the all-rows item holds it)

    @property
    def tested_p(self) -> float:
        """The smaller of the two tests' p-values (the family counts both tests)."""
        return _smaller(self.t_p_value, self.p_value)

    @property
    def subsets(self) -> list[DeltaItem]:
        """This item and its tied-rows item."""
        return [self] + ([self.tied] if self.tied is not None else [])

    @property
    def found(self) -> bool:
        """Significant over all rows or over the tied rows."""
        return any(x.significant for x in self.subsets)


def _smaller(t_p: float, sign_p: float) -> float:
    return min(t_p, sign_p) if math.isfinite(t_p) else sign_p


def delta_items(step: int, layer: int, heads: Sequence[int], do: torch.Tensor, o_lp: torch.Tensor,
                o_hp: torch.Tensor, fmt: str, row_units: Optional[RowUnits] = None) -> list[DeltaItem]:
    """The Σδ item of each head of one layer-step; do, o_lp, o_hp (B, h, T, D), `fmt` the low-precision O format,
    `row_units` the rows' units (`analyses.units`; None: every row its own unit, none tied)."""
    dd = (_f64(do) * (_f64(o_lp) - _f64(o_hp))).sum(-1)  # (B, h, T) δ_lp − δ_hp
    return items_of_errors(step, layer, heads, dd, delta_units(do, o_hp, fmt), row_units)


def items_of_errors(step: int, layer: int, heads: Sequence[int], dd: torch.Tensor,
                    units: torch.Tensor, row_units: Optional[RowUnits] = None) -> list[DeltaItem]:
    """The Σδ items of per-token errors dd = δ_var − δ_hp (B, h, T) with their rounding units (B, h, T): for a δ
    that does not come from O (a backward's own δ), measured in the same units as the forward's. `row_units`: the
    rows' units (None: every row its own unit, none tied)."""
    ru = row_units if row_units is not None else rows_as_units(tuple(dd.shape))
    out = []
    for j, h in enumerate(heads):
        ids, x, u = ru.unit[:, j].reshape(-1), _f64(dd[:, j]).reshape(-1), _f64(units[:, j]).reshape(-1)
        made = {}
        for subset in SUBSETS:
            rows = None if subset == ALL_ROWS else ru.tied[:, j].reshape(-1)
            t = unit_test(unit_sums(x, ids, rows))
            n = int(t.n)
            value, se = float(t.mean.nan_to_num(0.0)) * n, float(t.se) * n
            unit = float(u.sum() if rows is None else u[rows].sum())
            made[subset] = DeltaItem(int(step), int(layer), int(h), value, se, n, float(t.frac_positive),
                                     float(t.t_p_value), float(t.p_value), unit, effect(value, unit),
                                     n_units=int(t.n_units), subset=subset)
        out.append(replace(made[ALL_ROWS], tied=made[TIED_ROWS]))
    return out


Tested = TypeVar("Tested", "DeltaItem", "BiasCell")  # what `_decided` adjusts: Σδ items or O cells


def decide_deltas(items: Sequence[DeltaItem], family: Family) -> list[DeltaItem]:
    """The items (and their tied-rows items) with their Holm-adjusted p-values in `family` and the policy's
    decision."""
    return _decided(items, family)


def _decided(tested: Sequence[Tested], family: Family) -> list[Tested]:
    """Items or cells, each with its tied-rows subset, Holm-adjusted together in `family` and decided by the policy
    (`significance.significant`)."""
    flat = [x for t in tested for x in t.subsets]
    adjusted = iter(holm([x.tested_p for x in flat], family.n_tests))

    def decide(x: Tested) -> Tested:
        a = next(adjusted)
        return replace(x, adjusted_p=a, significant=significant(a, x.effect))

    out = []
    for t in tested:
        top = decide(t)
        out.append(replace(top, tied=decide(t.tied)) if t.tied is not None else top)
    return out


@dataclass(frozen=True)
class Total:
    """A sum of Σδ items (one head over its steps, or the whole selection), its se in quadrature."""

    value: float
    se: float
    n_items: int
    n_tokens: int
    n_units: int = 0

    @property
    def t_p_value(self) -> float:
        return MeanSE(self.value, self.se, self.n_units or self.n_tokens).p_value


def total_of(items: Iterable[DeltaItem]) -> Total:
    """Σ of the items' sums (in their order), se = √(Σ se²) (items are disjoint sets of units)."""
    items = list(items)
    value = sum(i.delta_err_sum for i in items)
    se = math.sqrt(sum(i.delta_err_se ** 2 for i in items if math.isfinite(i.delta_err_se)))
    return Total(value, se if items else math.nan, len(items), sum(i.n_tokens for i in items),
                 sum(i.n_units for i in items))


def head_total(items: Iterable[DeltaItem], layer: int, head: int) -> Total:
    """The Σδ of one (layer, head) over its selected steps."""
    return total_of(i for i in items if (i.layer, i.head) == (layer, head))


def _rank(x) -> tuple:
    return (x.adjusted_p if math.isfinite(x.adjusted_p) else 2.0, x.tested_p,
            -(x.effect if math.isfinite(x.effect) else abs(getattr(x, "delta_err_sum", getattr(x, "mean", 0.0)))))


def flagged(items: Sequence[DeltaItem]) -> DeltaItem:
    """The most significant item over all rows (smallest adjusted p, then the largest effect)."""
    return min(items, key=_rank)


def flagged_subset(items: Sequence[DeltaItem]) -> DeltaItem:
    """The Σδ claim's place: the most significant item or tied-rows item (ties: all rows first)."""
    return min((x for i in items for x in i.subsets), key=_rank)


def count_text(items: Iterable[DeltaItem]) -> str:
    """What a set of (step, layer, head) items counts, in words: '1 head over 3 steps', '2 heads over 1 step'."""
    items = list(items)
    heads = {(i.layer, i.head) for i in items}
    steps = {i.step for i in items}
    return (f"{len(heads)} head{'s' if len(heads) != 1 else ''} over {len(steps)} step{'s' if len(steps) != 1 else ''}"
            if items else "no head")


def item_text(i: DeltaItem, n_tests: int) -> str:
    """'step 0 layer 0 head 1 (all rows, 24 units): +2.47 ± 0.31 (0.52 rounding units; p = …, … after Holm over
    280 tests)'."""
    return (f"step {i.step} layer {i.layer} head {i.head} ({i.subset}, {i.n_units} unit{'s' if i.n_units != 1 else ''})"
            f": {i.delta_err_sum:+.3g} ± {i.delta_err_se:.2g} "
            f"({i.effect:.2g} rounding units; {p_text(i.tested_p, i.adjusted_p, n_tests)})")


def opposed_steps(items: Sequence[DeltaItem], claim: DeltaItem) -> list[int]:
    """Steps at which a significant item of the claim's (layer, head), over either subset, has the opposite sign:
    a sign that does not hold across steps does not add up over training."""
    sign = _sign(claim.delta_err_sum)
    return sorted({x.step for i in items if (i.layer, i.head) == (claim.layer, claim.head)
                   for x in i.subsets if x.significant and _sign(x.delta_err_sum) == -sign})


# ---- O bias per (layer, head, feature) ---------------------------------------------------------------

@dataclass(frozen=True)
class BiasCell:
    """Mean signed error of one (layer, head, feature) over one subset of its rows (all rows; `tied` holds the tied
    rows'), with its uncertainty over units and its rounding unit."""

    layer: int
    head: int
    feature: int
    mean: float
    se: float  # cluster-robust (`stats.unit_test`)
    p_value: float  # two-sided sign test over the units
    frac_positive: float  # units with a positive sum among those with a sign
    n: int  # rows with a finite error
    unit: float = math.nan  # mean rounding unit (ulp of the compared format at the reference value)
    t_p_value: float = math.nan  # cluster-robust t-test over the units
    effect: float = math.nan  # |mean| / unit
    adjusted_p: float = math.nan  # the smaller test's p, Holm over the selection's family
    significant: bool = False
    n_units: int = 0  # independent units: (step, batch row, dominant key set)
    subset: str = ALL_ROWS
    tied: Optional[BiasCell] = None  # the same cell over the tied rows only (the all-rows cell holds it)

    @property
    def tested_p(self) -> float:
        """The smaller of the two tests' p-values (the family counts both tests)."""
        return _smaller(self.t_p_value, self.p_value)

    @property
    def subsets(self) -> list[BiasCell]:
        """This cell and its tied-rows cell."""
        return [self] + ([self.tied] if self.tied is not None else [])

    @property
    def found(self) -> bool:
        """Significant over all rows or over the tied rows."""
        return any(x.significant for x in self.subsets)


@dataclass(frozen=True)
class CellSums:
    """Sufficient statistics of one layer-step's O errors per (head, feature) and subset of rows, over units,
    merged across steps by `o_cells`."""

    step: int
    layer: int
    heads: list[int]
    sums: dict  # subset -> stats.UnitSums, each tensor (h, D)
    unit: dict  # subset -> (h, D) Σ rounding unit over the finite rows


def cell_sums(step: int, layer: int, heads: Sequence[int], err: torch.Tensor, unit: torch.Tensor,
              row_units: Optional[RowUnits] = None) -> CellSums:
    """Per-(head, feature) sums of err = O_a − O_b (B, h, T, D) and of its rounding unit (same shape), over the
    rows' units (`analyses.units`; None: every row its own unit, none tied), for every subset of rows; a non-finite
    error is left out of its cell, not counted as 0."""
    B, h, T, D = err.shape
    ru = row_units if row_units is not None else rows_as_units((B, h, T))
    raw, u = _f64(err), _f64(unit)
    sums, units = {}, {}
    for subset in SUBSETS:
        per_head, per_unit = [], []
        for j in range(h):
            rows = None if subset == ALL_ROWS else ru.tied[:, j].reshape(-1)
            x = raw[:, j].reshape(B * T, D)
            per_head.append(unit_sums(x, ru.unit[:, j].reshape(-1), rows))
            keep = torch.isfinite(x) if rows is None else torch.isfinite(x) & rows[:, None]
            per_unit.append(torch.where(keep, u[:, j].reshape(B * T, D), torch.zeros(B * T, D, dtype=torch.float64))
                            .sum(0))
        sums[subset] = UnitSums(*(torch.stack([getattr(p, f) for p in per_head])
                                  for f in UnitSums.__dataclass_fields__))
        units[subset] = torch.stack(per_unit)
    return CellSums(int(step), int(layer), [int(x) for x in heads], sums, units)


def _pooled(parts: Iterable[CellSums], only: Optional[tuple[int, int]] = None) -> dict[tuple[int, int], dict]:
    """{(layer, head): {subset: (UnitSums of (D,), Σ unit (D,))}}, the parts' steps pooled (`only`: one (layer,
    head))."""
    acc: dict[tuple[int, int], dict] = {}
    for p in parts:
        for hi, head in enumerate(p.heads):
            if only is not None and (p.layer, head) != only:
                continue
            entry = acc.setdefault((p.layer, head), {s: ([], []) for s in SUBSETS})
            for subset in SUBSETS:
                us = p.sums[subset]
                entry[subset][0].append(UnitSums(*(getattr(us, f)[hi] for f in UnitSums.__dataclass_fields__)))
                entry[subset][1].append(p.unit[subset][hi])
    return {key: {s: (merge_unit_sums(v[0]), sum(v[1])) for s, v in entry.items()} for key, entry in acc.items()}


def _cells_of(layer: int, head: int, pooled: dict, features: Iterable[int]) -> list[BiasCell]:
    """The undecided cells (each holding its tied-rows cell) of `features` of one (layer, head) from its pooled
    sums."""
    tests = {s: (unit_test(us), usum) for s, (us, usum) in pooled.items()}
    cells = []
    for f in features:
        made = {}
        for subset, (t, usum) in tests.items():
            n = int(t.n[f])
            mean = float(t.mean[f])
            unit = float(usum[f]) / n if n else math.nan
            made[subset] = BiasCell(layer, head, f, mean, float(t.se[f]), float(t.p_value[f]),
                                    float(t.frac_positive[f]), n, unit, float(t.t_p_value[f]), effect(mean, unit),
                                    n_units=int(t.n_units[f]), subset=subset)
        cells.append(replace(made[ALL_ROWS], tied=made[TIED_ROWS]))
    return cells


def o_cells(parts: Iterable[CellSums], family: Optional[Family] = None) -> list[BiasCell]:
    """Every (layer, head, feature) cell (holding its tied-rows cell), its units pooled over the parts' steps,
    sorted by (layer, head, feature); decided in `family` (default: the cells alone)."""
    cells = [c for (layer, head), pooled in sorted(_pooled(parts).items())
             for c in _cells_of(layer, head, pooled, range(len(pooled[ALL_ROWS][1])))]
    return _decided(cells, family if family is not None else Family(o_cells=len(cells)))


def o_cell(parts: Iterable[CellSums], layer: int, head: int, feature: int,
           subset: str = ALL_ROWS) -> Optional[BiasCell]:
    """One cell of `o_cells` over `subset`, its statistics alone (undecided: its Holm p needs the others); None when
    no part holds it."""
    pooled = _pooled(parts, only=(layer, head)).get((layer, head))
    if pooled is None:
        return None
    cell = _cells_of(layer, head, pooled, (feature,))[0]
    return cell if subset == ALL_ROWS else cell.tied


def most_significant(cells: Sequence[BiasCell]) -> BiasCell:
    """The O claim's cell: over all rows or the tied rows, the smallest adjusted p, then the largest effect (ties:
    all rows first)."""
    return min((x for c in cells for x in c.subsets), key=_rank)


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
    item over either subset of rows (and, for Σδ, no opposite significant sign at another step of the head); the
    location, subset and sign are that item's even when nothing is found. n_units counts the independent units
    (`unit`) the tests counted; n_rows the rows they hold.
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
    n_units: int = 0
    unit: str = UNIT_KIND
    subset: str = ALL_ROWS  # "all rows" | "tied rows": where the bias was tested (and, when found, lives)
    n_rows: int = 0
    opposed_steps: tuple[int, ...] = ()  # Σδ: steps where the head is significant with the other sign


def _sign(value: float) -> int:
    return 0 if not value or not math.isfinite(value) else (1 if value > 0 else -1)


def delta_claim(items: Sequence[DeltaItem], family: Family) -> BiasClaim:
    """The Σδ claim: the flagged item (either subset) of decided `items`; found only when its sign holds across
    the head's steps (`opposed_steps`)."""
    i = flagged_subset(items)
    opposed = tuple(opposed_steps(items, i)) if i.significant else ()
    return BiasClaim(i.significant and not opposed, "delta", i.layer, i.head, _sign(i.delta_err_sum), i.tested_p,
                     family.n_tests, step=i.step, adjusted_p=i.adjusted_p, effect=i.effect, value=i.delta_err_sum,
                     se=i.delta_err_se, family=family.describe(), n_units=i.n_units, subset=i.subset,
                     n_rows=i.n_tokens, opposed_steps=opposed)


def o_claim(cells: Sequence[BiasCell], family: Family) -> BiasClaim:
    """The O claim: the most significant of decided `cells` (either subset)."""
    c = most_significant(cells)
    return BiasClaim(c.significant, "O", c.layer, c.head, _sign(c.mean), c.tested_p, family.n_tests,
                     feature=c.feature, adjusted_p=c.adjusted_p, effect=c.effect, value=c.mean, se=c.se,
                     family=family.describe(), n_units=c.n_units, subset=c.subset, n_rows=c.n)
