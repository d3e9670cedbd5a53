"""Which share of a P̄V error the P̄ = 1 terms cause, independent of the order of summation.

The P̄V dot product of one row is rounded ONCE to the P̄V format (paper Eq. 4). Split its exact
low-precision sum into A = Σ V[t] over the terms with P̄_lp[t] = 1 and r = Σ P̄_lp[t]·V[t] over the
rest. Both are sums, so they do not depend on where the tied keys sit. The final rounding of A + r is
classified by where A lies on the grid of the P̄V format (u = its ulp at |A|, h = u / 2):

  tie       A is exactly a rounding midpoint and |r| < h: the P̄ = 1 terms put the sum on a tie and
            the sign of the small terms' residue r breaks it (the paper's mechanism: two equal-binade
            values add with a carry and need one bit more than the format has);
  near-tie  A lies within u / 4 of a midpoint and r carries the sum across it;
  carry     neither, but A's binade is coarser than that of every P̄ = 1 term (their sum carried
            into a new binade, so the sum is rounded on a coarser grid);
  plain     a P̄ = 1 term exists but none of the above: an ordinary rounding;
  no-p-one  the row has no P̄ = 1 term.

The row's error E = round(acc_lp) − acc_hp splits exactly into the rounding part
E_round = round(acc_lp) − (A + r) and the rest, (A + r) − acc_hp (P̄ casts of the other terms and
the fp32 accumulation). The P̄ = 1 mechanism carries E_round when the class is tie, near-tie or
carry, nothing otherwise: frac_error_from_p_one = E_round / E then, 0 otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa_forensics.analyses.stats import ratio_of_means

P_ONE_CLASSES = ("tie", "near-tie", "carry")
CLASSES = (*P_ONE_CLASSES, "plain", "no-p-one")
NUDGED_P = 1.0 - 2.0**-8  # the bf16 value just below 1: where the stabilized shift moves P̄ = 1


def _binade(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) of nonzero fp64 values (−inf for 0)."""
    return torch.floor(torch.log2(x.abs()))


def classify(a: torch.Tensor, r: torch.Tensor, unit_max: torch.Tensor, n_one: torch.Tensor, fmt: str) -> list[str]:
    """The class of the final rounding of A + r, per row (see the module docstring).

    a, r, unit_max (largest |V| among the P̄ = 1 terms): (N,) fp64; n_one: (N,) number of P̄ = 1 terms.
    """
    from fa_forensics.numerics import round_to, ulp

    a64 = a.to(torch.float64)
    u = ulp(a64, fmt).to(torch.float64)  # (N,)
    ra = round_to(a64.to(torch.float32), fmt).to(torch.float64)
    exact_mid = (ra != a64) & ((ra - a64).abs() == u / 2)
    tie = exact_mid & (r.abs() < u / 2)
    mag, r_s = a64.abs(), r * torch.sign(a64)  # work on |A|, with r seen in A's direction
    to_mid = (torch.floor(mag / u) + 0.5) * u - mag  # signed distance from |A| to the midpoint of its interval
    near = ~tie & (to_mid.abs() < u / 4) & (torch.sign(r_s) == torch.sign(to_mid)) & (r_s.abs() >= to_mid.abs())
    carry = ~tie & ~near & (n_one > 0) & (_binade(a64) > _binade(unit_max.to(torch.float64)))
    out = []
    for i in range(a64.numel()):
        if int(n_one[i]) == 0:
            out.append("no-p-one")
        elif bool(tie[i]):
            out.append("tie")
        elif bool(near[i]):
            out.append("near-tie")
        elif bool(carry[i]):
            out.append("carry")
        else:
            out.append("plain")
    return out


@dataclass(frozen=True)
class RowSplit:
    """The order-independent split of one row's P̄V error."""

    cls: str  # one of CLASSES
    a: float  # A = Σ V over the P̄ = 1 terms
    r: float  # Σ P̄_lp·V over the other terms (fp64, exact for bf16 inputs)
    error: float  # E = round_pv(acc_lp) − acc_hp (Eq. 4)
    rounding_error: float  # round_pv(acc_lp) − (A + r)
    other_error: float  # (A + r) − acc_hp

    @property
    def from_p_one(self) -> float:
        """The part of E the P̄ = 1 mechanism carries."""
        return self.rounding_error if self.cls in P_ONE_CLASSES else 0.0

    @property
    def frac_from_p_one(self) -> float:
        """from_p_one / E (nan when E = 0; never −0)."""
        return self.from_p_one / self.error + 0.0 if self.error != 0 else math.nan


def split_rows(p_lp: torch.Tensor, v: torch.Tensor, lp_sum: torch.Tensor, hp_sum: torch.Tensor,
               fmt: str) -> list[RowSplit]:
    """RowSplit of each row: p_lp (N, K) P̄ after its cast, v (K,) or (N, K), lp_sum (N,) = round_pv(acc_lp),
    hp_sum (N,) = acc_hp (fp32 P̄V), all as values; fmt: the P̄V format."""
    p = p_lp.to(torch.float64)
    vv = v.to(torch.float64).expand_as(p)
    unit = p == 1.0
    a = (vv * unit).sum(-1)  # (N,)
    r = (p * vv * ~unit).sum(-1)  # (N,)
    unit_max = (vv.abs() * unit).amax(-1)
    classes = classify(a, r, unit_max, unit.sum(-1), fmt)
    y, hp = lp_sum.to(torch.float64), hp_sum.to(torch.float64)
    return [RowSplit(c, float(a[i]), float(r[i]), float(y[i] - hp[i]), float(y[i] - (a[i] + r[i])),
                     float(a[i] + r[i] - hp[i]))
            for i, c in enumerate(classes)]


@dataclass(frozen=True)
class ClassShare:
    """One class's share of the O bias over many rows: Σ its part / Σ all errors, with a delta-method se."""

    cls: str
    rows: int
    share: float
    se: float


def class_shares(splits: list[RowSplit], weights: torch.Tensor) -> list[ClassShare]:
    """Shares of Σ_i E_i·w_i (w = 1/ℓ turns Ō errors into O errors) carried by each class's P̄ = 1
    part, and by the rest ("other": casts, accumulation and the roundings no class claims).

    The share is a ratio of means over rows with the delta method's standard error (`stats.ratio_of_means`).
    """
    w = weights.to(torch.float64)
    y = torch.tensor([s.error for s in splits], dtype=torch.float64) * w  # (N,)
    n = y.numel()
    parts = {c: torch.tensor([s.from_p_one if s.cls == c else 0.0 for s in splits],
                             dtype=torch.float64) * w for c in P_ONE_CLASSES}
    parts["other"] = y - sum(parts.values())
    out = []
    for c, x in parts.items():
        rows = sum(s.cls == c for s in splits) if c != "other" else n
        if n == 0 or float(y.mean()) == 0:
            out.append(ClassShare(c, rows, math.nan, math.nan))
            continue
        m = ratio_of_means(x, y)
        out.append(ClassShare(c, rows, m.value + 0.0, m.se))
    return out


@dataclass(frozen=True)
class Counterfactual:
    """The same rows with every P̄ = 1 term nudged to NUDGED_P (on both sides, as the stabilized
    shift moves them below 1): their O bias must be what the attribution left unexplained."""

    o_bias: float  # mean over rows of E·w (the O bias of the feature)
    nudged_o_bias: float  # mean of E'·w, E' the error of the nudged rows
    nudged_se: float
    unattributed: float  # mean of (E − the P̄ = 1 part)·w: what the attribution does not give to P̄ = 1
    agrees: bool  # |mean(E'·w − unattributed part)| ≤ 3 se (paired over rows)


def counterfactual(splits: list[RowSplit], nudged_errors: torch.Tensor, weights: torch.Tensor) -> Counterfactual:
    """Compare the nudged rows' bias with the part of the bias the attribution does not explain."""
    w = weights.to(torch.float64)
    y = torch.tensor([s.error for s in splits], dtype=torch.float64) * w
    rest = y - torch.tensor([s.from_p_one for s in splits], dtype=torch.float64) * w
    y_n = nudged_errors.to(torch.float64) * w
    d = y_n - rest
    n = d.numel()
    se_d = float(d.std()) / math.sqrt(n) if n > 1 else math.nan
    se_n = float(y_n.std()) / math.sqrt(n) if n > 1 else math.nan
    return Counterfactual(float(y.mean()), float(y_n.mean()), se_n, float(rest.mean()),
                          bool(abs(float(d.mean())) <= 3 * se_d) if n > 1 else False)


def nudge(p_lp: torch.Tensor, p_hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P̄_lp, P̄_hp) with every entry where P̄_lp = 1 set to NUDGED_P on both sides."""
    unit = p_lp == 1.0
    return (torch.where(unit, torch.full_like(p_lp, NUDGED_P), p_lp),
            torch.where(unit, torch.full_like(p_hp, NUDGED_P), p_hp))
