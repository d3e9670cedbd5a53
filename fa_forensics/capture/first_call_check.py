"""The first recorded call of each attention source, checked: does its O follow from its Q, K, V?

A mapping of a call to (Q, K, V, O) can be wrong in ways no shape shows: `--attention mod:fn,q=k,k=q`
swaps two tensors of one shape, a layout may transpose heads and length where they are equal. Before
the first call of a source (an entry point, a `--attention` target, attention in torch ops, record()) is
stored, O is recomputed in float64 from the Q, K, V as stored (in the dtype the kernel computed with),
with the call's scale, causal flag, mask (boolean or additive), soft-cap and dropout-free softmax, on a
sample of query rows (rows are independent, so a sample costs little and a wrong mapping shows in
every row). O must agree within a bound of the rounding a kernel of that precision makes:

  |O − Ô|_id ≤ c·u·( Σ_j P_ij·w_ij·(|v_jd| + |Ô_id|) + Σ_j P_ij |v_jd| + |Ô_id| )
  with w_ij = scale·Σ_e |q_ie k_je| + |bias_ij|

(first order in u, the unit roundoff of the kernel's dtype: the scores' rounding moves P by at most that
relative amount times the score's magnitude; the casts of P and O and the products' accumulation add a
few u of |V| and |O|; c = 8 leaves room for a kernel's several roundings). A call with dropout, or with an
option a replay does not model (`not_replayed`), is not checked: nothing from Q, K, V alone gives its O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

ROUNDINGS = 8.0  # c: roundings a kernel makes on the way from Q, K, V to O, bounded generously
SAMPLE_ROWS = 64  # query rows per call checked (spread over the length)


@dataclass(frozen=True)
class FirstCallCheck:
    """The outcome: `max_error` the largest |O − Ô| seen; `error` and `tolerance` the difference and its bound at
    the element farthest beyond (or nearest to) its bound, `ratio` their quotient (> 1: O does not follow from
    Q, K, V); `skipped`: why no check ran."""

    max_error: float = 0.0
    error: float = 0.0
    tolerance: float = 0.0
    ratio: float = 0.0
    skipped: Optional[str] = None

    @property
    def reproduced(self) -> bool:
        return self.skipped is not None or self.ratio <= 1.0

    def attrs(self) -> dict:
        """The layer attribute `first_call_check` (stored on every layer of the checked source's first step)."""
        if self.skipped is not None:
            return {"checked": False, "why": self.skipped}
        return {"checked": True, "max_abs_error": self.max_error, "error": self.error, "tolerance": self.tolerance}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a floating dtype: half its machine epsilon."""
    return float(torch.finfo(dtype).eps) / 2.0


def _rows(t_q: int) -> torch.Tensor:
    if t_q <= SAMPLE_ROWS:
        return torch.arange(t_q)
    return torch.linspace(0, t_q - 1, SAMPLE_ROWS).round().long().unique()


def check_first_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *, scale: Optional[float],
                     causal: bool, mask: Optional[torch.Tensor], softcap: Optional[float], dropout_p: float,
                     kernel_dtype: torch.dtype, not_replayed: tuple = ()) -> FirstCallCheck:
    """Recompute O of one call ((B, H, T, D) tensors; k, v may hold fewer heads, grouped) from batch row 0 and a
    sample of query rows, and bound the difference (module docstring)."""
    if dropout_p > 0:
        return FirstCallCheck(skipped=f"the call drops P with p = {dropout_p:g}: its O is random given Q, K, V")
    if not_replayed:
        return FirstCallCheck(skipped=f"the call's {', '.join(map(str, not_replayed))} is not modelled")
    with torch.no_grad():
        rows = _rows(q.shape[2]).to(q.device)

        def as64(t: torch.Tensor) -> torch.Tensor:  # batch row 0, in the dtype the kernel computed with
            return t.detach()[:1].to(kernel_dtype).double()

        qd = as64(q).index_select(2, rows)
        kd, vd = as64(k), as64(v)
        od = o.detach()[:1].index_select(2, rows).double()
        H = qd.shape[1]
        if kd.shape[1] != H:  # grouped-query attention: one K/V head per group of query heads
            group = H // kd.shape[1]
            kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        alpha = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        s = qd @ kd.transpose(-1, -2) * alpha
        size = (qd.abs() @ kd.abs().transpose(-1, -2)) * alpha  # Σ_e |q k|·scale: the scores' rounding scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        bias = None
        allowed = torch.ones_like(s, dtype=torch.bool)
        if causal:  # SDPA's is_causal: key j <= query i (top-left aligned, as the replay reads it)
            allowed &= torch.arange(kd.shape[2], device=s.device).view(1, -1) <= rows.view(-1, 1)
        if mask is not None:
            m = mask.detach()
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))[:1]
            if m.shape[2] > 1:
                m = m.index_select(2, rows.to(m.device))
            m = m.to(s.device)
            if m.dtype == torch.bool:
                allowed = allowed & m
            else:
                bias = m.double()
                allowed = allowed & ~torch.isneginf(bias)
                bias = torch.where(torch.isneginf(bias), torch.zeros_like(bias), bias)
                s = s + bias
        s = s.masked_fill(~allowed, -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees no key: O = 0
        ref = p @ vd
        spread = size + (bias.abs() if bias is not None else 0.0)
        u = max(unit_roundoff(kernel_dtype), unit_roundoff(o.dtype) if o.dtype.is_floating_point else 0.0)
        weight = p * spread  # |v_jd − Ô_id| ≤ |v_jd| + |Ô_id|: the move of O when each score moves by u·spread
        moved = weight @ vd.abs() + weight.sum(-1, keepdim=True) * ref.abs()
        tolerance = ROUNDINGS * u * (moved + p @ vd.abs() + ref.abs()) + torch.finfo(torch.float32).tiny
        error = (od - ref).abs()
        finite = torch.isfinite(od)
        if not bool(finite.all()):
            return FirstCallCheck(skipped="its O holds a non-finite value")
        ratio = error / tolerance
        worst = int(ratio.argmax())
        return FirstCallCheck(max_error=float(error.max()), error=float(error.reshape(-1)[worst]),
                              tolerance=float(tolerance.reshape(-1)[worst]), ratio=float(ratio.reshape(-1)[worst]))
