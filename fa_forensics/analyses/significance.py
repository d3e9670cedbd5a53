"""The statistics policy of every verdict: one significance level, one multiple-testing family, one effect floor.

Every word that claims a bias ("significant", "biased", "found", "still biased", a command's exit code 1 and
the report's headline) means the same thing everywhere because it is decided here:

- `ALPHA` = 0.01: the chance that a verdict makes any false claim at all (family-wise error rate).
- The unit of evidence: rows that share their dominant key set within one (step, batch row) err together, so
  each such group is one unit (`analyses.units`); the tests count units, not rows (`stats.unit_test`: a
  cluster-robust t-test of the mean with the units' effective degrees of freedom).
- The family: every hypothesis the selection is tested on, counted from its shape before looking at the
  data (`Family`): one Σδ item per (step, layer, head) with a dO array, one per (layer, head) with dO at two or
  more steps (pooled over them), and one O cell per (layer, head, feature), each over two subsets of rows (all
  rows, and the tied rows, whose maximum repeats: where the P̄ = 1 mechanism acts) and tested once in each (the
  t-test of the mean: a bias is a mean error, and the sign test, which tests the median, would take an error
  distribution skewed with a mean of 0 for one). Every command and the report count the same family
  for the same selection, so an item found by one is found by all.
- Holm's step-down over that family (`holm`): the k-th smallest p-value of the items a command tests is
  multiplied by (family size − k + 1) and the running maximum taken; an item is significant when its
  adjusted p is below α. A command that tests only part of the family ranks its own items (the adjusted p
  is then never below full Holm's, and the family-wise rate stays at most α).
- The effect floor: a significant bias counts only when it is at least `EFFECT_FLOOR` (1 %) of its rounding
  unit, so that a long capture does not turn a negligible bias into a finding. The rounding unit of an O
  element is the ulp of the low-precision format at |O_hp|; that of a token's δ is the same ulps carried
  through dO: ‖dO[T] ∘ ulp(O_hp[T])‖₂ (`analyses.quantities`). A bias of 1 % of a unit needs about a hundred
  steps of one sign to add up to one unit.
- The fix-check's variants, tested in the baseline's most biased cell, are part of every selection's family
  (`extra` tests, `FIX_VARIANTS` × `O_TESTS_PER_CELL`), since the report's verdict makes them: every command prints
  the same family size, and a variant is "still biased" only when the baseline has a bias to remove and its own
  residual is significant in that one family.
- A Σδ claim about the run rests on the evidence of every selected step: where a (layer, head) has items at two or
  more steps, its Σδ pooled over them (the units of all the steps together; units never span steps) is one more
  item of the family (`pooled_heads`), and the claim is found only when that pooled item is significant and every
  step whose own Σ has a sign has the pooled sign (`quantities.PooledDelta.sign_holds`, `quantities.delta_claim`).
  With one step the pooled item is that step's item and is not counted again.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.01  # family-wise error rate of every verdict
EFFECT_FLOOR = 0.01  # a bias below 1 % of its rounding unit is not a finding, however significant
METHOD = "Holm"
DELTA_TESTS_PER_ITEM = 1  # Σδ items: the cluster-robust t-test of the mean over the units
O_TESTS_PER_CELL = 1  # O cells: the same test
FIX_VARIANTS = 6  # fix-check's variants tested in its target cell (all of `fix_check.compute.fix_variants` but the
# baseline): the report's verdict makes these tests too, so every selection's family counts them
ALL_ROWS = "all rows"
TIED_ROWS = "tied rows"  # rows whose maximum score is attained more than once
SUBSETS = (ALL_ROWS, TIED_ROWS)  # every item and cell is tested over both, in one family
UNIT_KIND = "(step, batch row, dominant key set)"  # the independent unit the tests count


@dataclass(frozen=True)
class Family:
    """The hypotheses one verdict is corrected over: Σδ items and O cells (one test per subset of rows)."""

    delta_items: int = 0
    o_cells: int = 0
    extra: int = 0  # tests of another kind (a fix-check's variants in one cell)
    pooled_heads: int = 0  # Σδ (layer, head) items pooled over their steps: heads with items at two or more steps

    @property
    def n_tests(self) -> int:
        return ((DELTA_TESTS_PER_ITEM * (self.delta_items + self.pooled_heads) + O_TESTS_PER_CELL * self.o_cells)
                * len(SUBSETS) + self.extra)

    def describe(self) -> str:
        """'Holm over 550 tests (12 Σδ (step, layer, head) items, 4 Σδ (layer, head) items pooled over steps and
        256 O (layer, head, feature) cells, each over all rows and tied rows, 6 fix-check variant tests)'."""
        parts = []
        if self.delta_items:
            parts.append(f"{self.delta_items} Σδ (step, layer, head) item{'s' if self.delta_items != 1 else ''}")
        if self.pooled_heads:
            parts.append(f"{self.pooled_heads} Σδ (layer, head) item{'s' if self.pooled_heads != 1 else ''} pooled "
                         "over steps")
        if self.o_cells:
            parts.append(f"{self.o_cells} O (layer, head, feature) cell{'s' if self.o_cells != 1 else ''}")
        what = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)
        what += f", each over {' and '.join(SUBSETS)}" if parts else ""
        if self.extra:
            what += (", " if what else "") + f"{self.extra} fix-check variant test{'s' if self.extra != 1 else ''}"
        n = self.n_tests
        return f"{METHOD} over {n} test{'s' if n != 1 else ''}" + (f" ({what})" if what else "")

    def as_dict(self) -> dict:
        return {"method": METHOD, "alpha": ALPHA, "effect_floor": EFFECT_FLOOR, "n_tests": self.n_tests,
                "delta_items": self.delta_items, "pooled_heads": self.pooled_heads, "o_cells": self.o_cells,
                "extra": self.extra,
                "subsets": list(SUBSETS), "unit": UNIT_KIND, "text": self.describe()}


def holm(p_values: Sequence[float], n_tests: int) -> list[float]:
    """Holm-adjusted p-values of `p_values` (in their order), ranked among themselves inside a family of
    `n_tests` ≥ len(p_values) tests; a non-finite p counts as 1."""
    ps = [p if isinstance(p, (int, float)) and math.isfinite(p) else 1.0 for p in p_values]
    n = max(int(n_tests), len(ps), 1)
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted = [1.0] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (n - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def effect(bias: float, unit: float) -> float:
    """|bias| in rounding units (nan when the unit is not a positive finite number)."""
    if not (isinstance(unit, (int, float)) and math.isfinite(unit) and unit > 0):
        return math.nan
    return abs(bias) / unit if math.isfinite(bias) else math.nan


def big_enough(effect_size: float) -> bool:
    """At least the effect floor (an effect that cannot be measured does not block a claim: nan passes)."""
    return not (isinstance(effect_size, (int, float)) and math.isfinite(effect_size)) or effect_size >= EFFECT_FLOOR


def significant(adjusted_p: float, effect_size: float = math.nan) -> bool:
    """The one rule: Holm-adjusted p below α and the bias at least the effect floor."""
    return bool(math.isfinite(adjusted_p) and adjusted_p < ALPHA and big_enough(effect_size))


def rule_text() -> str:
    """The rule in one sentence, for pages and help texts."""
    return (f"significant = p below {ALPHA:g} after {METHOD}'s correction over every test of the selection, and a "
            f"bias of at least {EFFECT_FLOOR:.0%} of a rounding unit")


def p_text(p_value: float, adjusted_p: float, n_tests: int) -> str:
    """'p = 1.7e-42, 4.6e-40 after Holm over 280 tests' (the raw and the family's p, for sentences)."""
    def fmt(p: float) -> str:
        return "< 1e-300" if p == 0 else f"{p:.2g}" if math.isfinite(p) else "n/a"

    return f"p = {fmt(p_value)}, {fmt(adjusted_p)} after {METHOD} over {n_tests} test{'s' if n_tests != 1 else ''}"


REMOVED_SHARE = 0.9  # a repair removes a bias when it removes at least 90 % of it ...
PARTIAL_SHARE = 0.5  # ... or at least half, leaving nothing significant


def removes(share_removed: float, residual_significant: bool) -> bool:
    """The one rule for "this repair (or fix) removes the bias": at least 90 % of it gone, or at least half gone
    and what is left not significant (tested in the family of the repairs compared in that place)."""
    if not (isinstance(share_removed, (int, float)) and math.isfinite(share_removed)):
        return False
    return share_removed >= REMOVED_SHARE or (share_removed >= PARTIAL_SHARE and not residual_significant)


def outcome(share_removed: float, residual_significant: bool) -> str:
    """What a fix did to a bias: "removed" (`removes`), "remains" (a significant bias is left, less than 90 % of it
    gone: the claim behind fix-check's exit code 1), or "inconclusive" (neither shown: too few rows to tell)."""
    if removes(share_removed, residual_significant):
        return "removed"
    return "remains" if residual_significant else "inconclusive"
