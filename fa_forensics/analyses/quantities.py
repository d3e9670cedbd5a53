"""The numbers the analyses share, each defined once, and the bias claims made from them.

- The unit of evidence (`analyses.units`): the rows of one (step, batch row) that share their dominant key set
  err together and count as one unit; every test below counts units (`stats.unit_test`: a cluster-robust t-test of the
  mean over the units' sums, with the units' effective degrees of freedom), over all rows and, in the same family,
  over the tied rows (maximum attained more than once: where the P̄ = 1 mechanism acts; each item and cell holds its
  `tied`).
- Σδ items (`DeltaItem`, `delta_items`): per (step, layer, head), Σ_T(δ_lp − δ_hp) over every token of every
  batch entry, δ = rowsum(dO ∘ O) in float64, with its cluster-robust standard error, its t-test over the units,
  and its rounding unit Σ_T ‖dO[T] ∘ ulp(O_hp[T])‖₂. isolate, delta-bias, rank1-sim and fix-check
  quote these; a head's number over several steps is `head_total`, the selection's is `total_of` (sums of the
  items, standard errors in quadrature), so the same (step, layer, head) reads the same in every command.
- Σδ pooled over steps (`PooledDelta`, `pool_deltas`): per (layer, head) with items at two or more steps, the units
  of every step tested together, with the sign of each step's own sum; the Σδ claim of such a head rests on it
  (significant, and its sign held at every step), since a bias that compounds in training holds its sign step after
  step. With one step the item is the test.
- O cells (`BiasCell`, `cell_sums`, `o_cells`): per (layer, head, feature), the mean of O_lp − O_hp over every
  row of every selected step and batch entry, ± se, with its t-test over the units and its rounding
  unit (the mean ulp of the low-precision O format at |O_hp|). bitdiff, fix-check and pv-trace quote these.
- The family (`selection_family`, `layers_family`: the items, the pooled items, the cells and fix-check's variant
  tests) and the decision (`decide_deltas`, `decide_pooled`, `o_cells`), by the policy of `analyses.significance`;
  the claim (`BiasClaim`: `delta_claim`, `o_claim`) is the most significant item (pooled where there are several
  steps) or cell, found or not, so that every command names the same place.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypeVar

import torch

from fa_forensics.analyses.significance import (ALL_ROWS, FIX_VARIANTS, O_TESTS_PER_CELL, SUBSETS, TIED_ROWS,
                                                UNIT_KIND, Family, effect, holm, p_text, significant)
from fa_forensics.analyses import wording
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


class _Tested:
    """What the Σδ items, pooled items and O cells share: the p the family counts and the subsets of rows."""

    t_p_value: float
    tied: Optional[Any]

    @property
    def tested_p(self) -> float:
        """The p the family counts: the cluster-robust t-test of the mean over the units (`stats.unit_test`); 1 where
        it cannot be made (fewer than 2 units), as `significance.holm` counts it."""
        return self.t_p_value if math.isfinite(self.t_p_value) else 1.0

    @property
    def subsets(self) -> list:
        """This item and its tied-rows item."""
        return [self] + ([self.tied] if self.tied is not None else [])


# ---- Σδ per (step, layer, head) ---------------------------------------------------------------------

@dataclass(frozen=True)
class DeltaItem(_Tested):
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
    p_value: float  # sign test over the units' sums: descriptive, the family does not count it (`stats.UnitTest`)
    unit: float  # Σ_T ‖dO[T] ∘ ulp(O_hp[T])‖₂: the sum's rounding unit
    effect: float = math.nan  # |Σ| / unit
    adjusted_p: float = math.nan  # the t-test's p, Holm over the selection's family (`decide_deltas`)
    significant: bool = False
    n_units: int = 0  # independent units: (step, batch row, dominant key set)
    subset: str = ALL_ROWS
    tied: Optional[DeltaItem] = None  # the same item over the tied rows only (the all-rows item holds it)
    # the units' sufficient statistics, pooled over steps by `pool_deltas` (not written to JSON)
    sums: Optional[UnitSums] = field(default=None, repr=False, compare=False, metadata={"json": False})

    @property
    def found(self) -> bool:
        """Significant over all rows or over the tied rows."""
        return any(x.significant for x in self.subsets)


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
            sums = unit_sums(x, ids, rows, ru.tied[:, j].reshape(-1))
            unit = float(u.sum() if rows is None else u[rows].sum())
            made[subset] = _delta_item(int(step), int(layer), int(h), sums, unit, subset)
        out.append(replace(made[ALL_ROWS], tied=made[TIED_ROWS]))
    return out


def _sum_test(sums: UnitSums) -> tuple[float, float, int, float, float, float, int]:
    """(Σ, its se, rows, frac_positive, t-test p, sign-test p, units) of the rows' sum from their units' sums."""
    t = unit_test(sums)
    n = int(t.n)
    return (float(t.mean.nan_to_num(0.0)) * n, float(t.se) * n, n, float(t.frac_positive), float(t.t_p_value),
            float(t.p_value), int(t.n_units))


def _delta_item(step: int, layer: int, head: int, sums: UnitSums, unit: float, subset: str) -> DeltaItem:
    value, se, n, frac, t_p, sign_p, n_units = _sum_test(sums)
    return DeltaItem(step, layer, head, value, se, n, frac, t_p, sign_p, unit, effect(value, unit),
                     n_units=n_units, subset=subset, sums=sums)


Tested = TypeVar("Tested", "DeltaItem", "BiasCell")  # what `_decided` adjusts: Σδ items or O cells


def decide_deltas(items: Sequence[DeltaItem], family: Family) -> list[DeltaItem]:
    """The items (and their tied-rows items) with their Holm-adjusted p-values in `family` and the policy's
    decision, ranked together with the items pooled over steps (`decide_pooled`), which the family counts too."""
    return _decided_deltas(items, family)[0]


def decide_pooled(items: Sequence[DeltaItem], family: Family) -> list[PooledDelta]:
    """The Σδ of every (layer, head) with items at two or more steps, pooled over them (`pool_deltas`), decided
    in `family` together with the per-step `items`."""
    return _decided_deltas(items, family)[1]


def _decided_deltas(items: Sequence[DeltaItem], family: Family) -> tuple[list[DeltaItem], list[PooledDelta]]:
    pooled = pool_deltas(items)
    joint: list[Any] = [*items, *pooled]  # items and pooled items, ranked together
    decided = _decided(joint, family)
    return decided[: len(items)], decided[len(items):]


# ---- Σδ per (layer, head), pooled over the selected steps ----------------------------------------------

@dataclass(frozen=True)
class PooledDelta(_Tested):
    """Σ_T(δ_lp − δ_hp) of one (layer, head) over every token of its selected steps (≥ 2), over one subset of
    rows (`tied` holds the tied rows'), tested over the units of all the steps together (units never span steps),
    with the sign of each step's own sum: the evidence that a bias of the run holds step after step."""

    layer: int
    head: int
    steps: tuple[int, ...]  # the steps pooled, in order
    delta_err_sum: float
    delta_err_se: float  # cluster-robust over the pooled units (`stats.unit_test`)
    n_tokens: int
    frac_positive: float  # units with a positive sum, among those with a sign
    t_p_value: float
    p_value: float  # sign test over the pooled units (descriptive)
    unit: float  # Σ of the steps' rounding units
    effect: float = math.nan
    adjusted_p: float = math.nan  # Holm over the selection's family (with the per-step items)
    significant: bool = False
    n_units: int = 0
    subset: str = ALL_ROWS
    step_signs: tuple[int, ...] = ()  # sign of each step's own Σ over this subset (0: no sign), in `steps` order
    tied: Optional[PooledDelta] = None

    @property
    def opposed_steps(self) -> tuple[int, ...]:
        """The steps whose own Σ has the sign opposite to the pooled Σ."""
        sign = _sign(self.delta_err_sum)
        return tuple(s for s, x in zip(self.steps, self.step_signs) if x == -sign)

    @property
    def sign_holds(self) -> bool:
        """Every step with a sign agrees with the pooled sign (and the pooled Σ has one)."""
        return _sign(self.delta_err_sum) != 0 and not self.opposed_steps

    @property
    def holds(self) -> bool:
        """This subset's claim: significant and its sign held at every step (`sign_holds`)."""
        return self.significant and self.sign_holds

    @property
    def found(self) -> bool:
        """Significant with its sign held across steps, over all rows or over the tied rows."""
        return any(x.holds for x in self.subsets)

    @property
    def steps_text(self) -> str:
        """'steps 0..2' (consecutive) or 'steps 0, 4, 9'."""
        return steps_text(self.steps)


def steps_text(steps: Sequence[int]) -> str:
    """'step 3', 'steps 0..2' (consecutive) or 'steps 0, 4, 9'."""
    steps = list(steps)
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return f"steps {steps[0]}..{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


def claim_place(bias: dict) -> str:
    """'layer 0 head 1 over steps 0..2' for a claim pooled over steps, else 'step 0 layer 0 head 1'."""
    steps = [s for s in (bias.get("steps") or []) if isinstance(s, int)]
    if len(steps) > 1:
        return f"{wording.place(bias, 'layer', 'head')} over {steps_text(steps)}"
    return wording.place(bias, "step", "layer", "head")


def pooled_text(p: PooledDelta, n_tests: int) -> str:
    """'layer 0 head 1 over steps 0..2 (all rows, 126 units): +5.81 ± 1.1 (0.14 rounding units; p = …, … after Holm
    over 550 tests), sign + + + by step'."""
    signs = " ".join("+" if x > 0 else "−" if x < 0 else "0" for x in p.step_signs)
    return (f"layer {p.layer} head {p.head} over {p.steps_text} ({p.subset}, {p.n_units} unit"
            f"{'s' if p.n_units != 1 else ''}): {p.delta_err_sum:+.3g} ± {p.delta_err_se:.2g} ({p.effect:.2g} rounding "
            f"units; {p_text(p.tested_p, p.adjusted_p, n_tests)}), sign {signs} by step")


def pooled_dict(p: PooledDelta) -> dict:
    """A pooled item as its JSON writes it: its fields with `sign_holds`, `opposed_steps`, `holds` (and the tied
    rows' item the same way)."""
    out = {f: getattr(p, f) for f in PooledDelta.__dataclass_fields__ if f != "tied"}
    out.update(sign_holds=p.sign_holds, opposed_steps=p.opposed_steps, holds=p.holds)
    if p.tied is not None:
        out["tied"] = pooled_dict(p.tied)
    return out


def pool_deltas(items: Sequence[DeltaItem]) -> list[PooledDelta]:
    """Per (layer, head) with items at two or more steps (in order of first appearance), its units' sums merged
    over the steps (`stats.merge_unit_sums`) and tested (`stats.unit_test`), over each subset of rows. With one
    step the pooled test is that step's item, so it is not made again (the family does not count it twice)."""
    by_head: dict[tuple[int, int], list[DeltaItem]] = {}
    for i in items:
        by_head.setdefault((i.layer, i.head), []).append(i)
    out = []
    for (layer, head), group in by_head.items():
        steps = sorted({i.step for i in group})
        if len(steps) < 2:
            continue
        group = sorted(group, key=lambda i: i.step)
        made = {}
        for subset in SUBSETS:
            parts = [x for i in group for x in i.subsets if x.subset == subset]
            if any(x.sums is None for x in parts):
                raise ValueError("pool_deltas: an item without its units' sums (made by `items_of_errors`)")
            value, se, n, frac, t_p, sign_p, n_units = _sum_test(merge_unit_sums(x.sums for x in parts))
            unit = sum(x.unit for x in parts)
            made[subset] = PooledDelta(layer, head, tuple(steps), value, se, n, frac, t_p, sign_p, unit,
                                       effect(value, unit), n_units=n_units, subset=subset,
                                       step_signs=_step_signs(parts, steps))
        out.append(replace(made[ALL_ROWS], tied=made[TIED_ROWS]))
    return out


def _step_signs(parts: Sequence[DeltaItem], steps: Sequence[int]) -> tuple[int, ...]:
    """The sign of each step's Σ over the parts (items of one head and subset), in `steps` order."""
    return tuple(_sign(sum(x.delta_err_sum for x in parts if x.step == s)) for s in steps)


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
    550 tests)'."""
    return (f"step {i.step} layer {i.layer} head {i.head} ({i.subset}, {i.n_units} unit{'s' if i.n_units != 1 else ''})"
            f": {i.delta_err_sum:+.3g} ± {i.delta_err_se:.2g} "
            f"({i.effect:.2g} rounding units; {p_text(i.tested_p, i.adjusted_p, n_tests)})")


# ---- O bias per (layer, head, feature) ---------------------------------------------------------------

@dataclass(frozen=True)
class BiasCell(_Tested):
    """Mean signed error of one (layer, head, feature) over one subset of its rows (all rows; `tied` holds the tied
    rows'), with its uncertainty over units and its rounding unit."""

    layer: int
    head: int
    feature: int
    mean: float
    se: float  # cluster-robust (`stats.unit_test`)
    p_value: float  # sign test over the units (descriptive)
    frac_positive: float  # units with a positive sum among those with a sign
    n: int  # rows with a finite error
    unit: float = math.nan  # mean rounding unit (ulp of the compared format at the reference value)
    t_p_value: float = math.nan  # cluster-robust t-test over the units
    effect: float = math.nan  # |mean| / unit
    adjusted_p: float = math.nan  # the t-test's p, Holm over the selection's family
    significant: bool = False
    n_units: int = 0  # independent units: (step, batch row, dominant key set)
    subset: str = ALL_ROWS
    tied: Optional[BiasCell] = None  # the same cell over the tied rows only (the all-rows cell holds it)

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
            per_head.append(unit_sums(x, ru.unit[:, j].reshape(-1), rows, ru.tied[:, j].reshape(-1)))
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
    """The O claim's cell: over all rows or the tied rows, the smallest adjusted p, then the smallest raw p, then the
    largest effect (ties: all rows first)."""
    return min((x for c in cells for x in c.subsets), key=_rank)


# ---- the family of a selection ---------------------------------------------------------------------

def selection_family(dump, selections) -> Family:
    """The tests a selection of a dump makes: one Σδ item per selected (step, layer, head) whose layer-step has
    dO, one per (layer, head) with such items at two or more steps (pooled over them), one O cell per selected
    (layer, head, feature) (rows pooled over steps)."""
    delta: set[tuple[int, int, int]] = set()
    cells: set[tuple[int, int, int]] = set()
    for sel in selections:
        if dump.has(sel.step, sel.layer, "do"):
            delta.update((sel.step, sel.layer, h) for h in sel.heads)
        head_dim = int(dump.layer_info(sel.step, sel.layer).head_dim)
        cells.update((sel.layer, h, f) for h in sel.heads for f in range(head_dim))
    return _family(delta, cells)


def layers_family(layers) -> Family:
    """`selection_family` of layer-steps already loaded (or built in memory)."""
    delta: set[tuple[int, int, int]] = set()
    cells: set[tuple[int, int, int]] = set()
    for t in layers:
        if t.do is not None:
            delta.update((t.step, t.layer, h) for h in t.heads)
        cells.update((t.layer, h, f) for h in t.heads for f in range(t.q.shape[-1]))
    return _family(delta, cells)


def _family(delta: set[tuple[int, int, int]], cells: set[tuple[int, int, int]]) -> Family:
    """The family of Σδ (step, layer, head) items and O (layer, head, feature) cells; a (layer, head) with items at
    two or more steps adds its item pooled over them (`pool_deltas`), and fix-check's variants their tests in its
    target cell (`significance.FIX_VARIANTS`), so every command counts the same family."""
    steps_of: dict[tuple[int, int], set[int]] = {}
    for step, layer, head in delta:
        steps_of.setdefault((layer, head), set()).add(step)
    pooled = sum(len(steps) >= 2 for steps in steps_of.values())
    return Family(delta_items=len(delta), o_cells=len(cells), pooled_heads=pooled,
                  extra=O_TESTS_PER_CELL * FIX_VARIANTS if cells else 0)


def family_of(dump, selections, layers=()) -> Family:
    """The selection's family from the dump, or from the layers when there is no dump (in-memory layers)."""
    return selection_family(dump, selections) if dump is not None else layers_family(layers)


# ---- the claim -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BiasClaim:
    """Where an analysis finds a bias, in the same terms for every command.

    quantity "O": the mean of O_lp − O_hp in one (layer, head, feature) cell; "delta": Σ_T(δ_lp − δ_hp) of one
    (layer, head), pooled over its selected steps where it has two or more (`PooledDelta`: `step` is None, `steps`
    the steps), else of its one (step, layer, head) item. found: the policy's decision (`significance.significant`)
    for the most significant item over either subset of rows (and, for a Σδ pooled over steps, its sign held at
    every step: `PooledDelta.sign_holds`); the location, subset and sign are that item's even when nothing is found.
    n_units counts the independent units (`unit`) the tests counted; n_rows the rows they hold.
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
    opposed_steps: tuple[int, ...] = ()  # Σδ: steps whose own Σ has the other sign
    steps: tuple[int, ...] = ()  # Σδ: the steps the deciding test covered (one for a (step, layer, head) item)
    sign_holds: Optional[bool] = None  # Σδ over several steps: every step with a sign has the pooled sign

    @property
    def where_steps(self) -> str:
        """'step 2' or 'over steps 0..2' ('' for an O claim)."""
        if not self.steps:
            return f"step {self.step}" if self.step is not None else ""
        return steps_text(self.steps) if len(self.steps) == 1 else f"over {steps_text(self.steps)}"


def _sign(value: float) -> int:
    return 0 if not value or not math.isfinite(value) else (1 if value > 0 else -1)


def delta_claim(items: Sequence[DeltaItem], family: Family) -> BiasClaim:
    """The Σδ claim of decided `items`. A (layer, head) with items at two or more steps is judged by its Σδ pooled
    over them (`decide_pooled`), found only when significant with its sign held at every step; a (layer, head) of
    one step by its item. The claim's place is the most significant of these over either subset (found ones
    first)."""
    pooled = decide_pooled(items, family)
    multi = {(p.layer, p.head) for p in pooled}
    single = [x for i in items if (i.layer, i.head) not in multi for x in i.subsets]
    candidates: list = [x for p in pooled for x in p.subsets] + single
    if not candidates:
        raise ValueError("delta_claim: no Σδ item")
    best = min(candidates, key=lambda x: (not _holds(x), *_rank(x)))
    common = dict(adjusted_p=best.adjusted_p, effect=best.effect, value=best.delta_err_sum, se=best.delta_err_se,
                  family=family.describe(), n_units=best.n_units, subset=best.subset, n_rows=best.n_tokens)
    if isinstance(best, PooledDelta):
        return BiasClaim(best.holds, "delta", best.layer, best.head, _sign(best.delta_err_sum), best.tested_p,
                         family.n_tests, step=None, opposed_steps=best.opposed_steps, steps=best.steps,
                         sign_holds=best.sign_holds, **common)
    return BiasClaim(best.significant, "delta", best.layer, best.head, _sign(best.delta_err_sum), best.tested_p,
                     family.n_tests, step=best.step, steps=(best.step,), **common)


def run_claim_text(items: Sequence[DeltaItem], family: Family) -> str:
    """The Σδ claim over several steps as the first clause of a verdict: '<pooled item>: a bias of the run (its sign
    holds at every step); ', or why it is not one; '' when the claim's head has one step (its item is the claim)."""
    c = delta_claim(items, family)
    p = next((p for p in decide_pooled(items, family) if (p.layer, p.head) == (c.layer, c.head)), None)
    if p is None:
        return ""
    x = next(x for x in p.subsets if x.subset == c.subset)
    what = pooled_text(x, family.n_tests)
    if x.holds:
        return f"{what}: a bias of the run (its sign holds at every step); "
    many = len(x.opposed_steps) != 1
    flips = (f"its sign does not hold step after step (step{'s' if many else ''} "
             f"{', '.join(map(str, x.opposed_steps))} {'have' if many else 'has'} the other sign)")
    if x.significant:
        return f"{what}: significant, but {flips}, so it is no bias of the run; "
    return (f"no Σδ pooled over steps is significant (most significant: {what}"
            + (f"; {flips}" if x.opposed_steps else "") + "); ")


def _holds(x) -> bool:
    """A candidate of the Σδ claim that is found: pooled, significant with its sign held; one step, significant."""
    return x.holds if isinstance(x, PooledDelta) else x.significant


def run_biased_heads(items: Sequence[DeltaItem], family: Family) -> dict[tuple[int, int], int]:
    """{(layer, head): sign} of the heads whose Σδ bias holds for the run by the claim's rule (`delta_claim`):
    pooled over two or more steps, significant with its sign held at every step; with one step, its item found."""
    pooled = decide_pooled(items, family)
    out = {(p.layer, p.head): _sign(next(x for x in p.subsets if x.holds).delta_err_sum)
           for p in pooled if p.found}
    multi = {(p.layer, p.head) for p in pooled}
    for i in items:
        if (i.layer, i.head) not in multi and i.found:
            out[(i.layer, i.head)] = _sign(next(x for x in i.subsets if x.significant).delta_err_sum)
    return out


def o_claim(cells: Sequence[BiasCell], family: Family) -> BiasClaim:
    """The O claim: the most significant of decided `cells` (either subset)."""
    c = most_significant(cells)
    return BiasClaim(c.significant, "O", c.layer, c.head, _sign(c.mean), c.tested_p, family.n_tests,
                     feature=c.feature, adjusted_p=c.adjusted_p, effect=c.effect, value=c.mean, se=c.se,
                     family=family.describe(), n_units=c.n_units, subset=c.subset, n_rows=c.n)
