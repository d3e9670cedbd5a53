"""The FP8 P-cast study on a captured dump (paper 002): per head, sink strength, collapse, a fix.

An FP8 attention kernel multiplies the fp32 probabilities P̄ = exp(Z − m) by a static scale S,
casts them to E4M3 (anything below 2^-10 becomes 0) and accumulates O from the cast values, while
ℓ comes from the pre-cast P̄ (Algorithm 1). A strong attention sink raises the running maximum m,
so under forward KV order most non-sink P̄ fall below 2^-10/S and are silently zeroed
("P-collapse"). Each captured head's real scores are replayed by the engine's fp8 recipe at every
(S, KV order) (`pcast.kernel`); its sink strength, zeroed share and output MSE give a
recommendation of S and order. A head needs a P-cast fix when the default setting (forward order, S = 1)
silently drops more than `FIX_MASS_ZEROED` of the probability mass (P-collapse: a measured loss, counted on
the head's own scores), decided on the loss's interval over independent units of query rows: needs a fix,
borderline (the interval contains the floor) or no fix, and one-hot or empty heads named as such
(`pcast.decision`); a setting that only lowers the output MSE is named as an FP8 accuracy choice, with
its uncertainty, never as a fix for a head that loses nothing. The synthetic study is `pcast.sim`; dp(S)
is `pcast.e4m3`; the closed forms are `pcast.theory`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from scipy import stats

from fa_forensics.analyses.pcast.decision import (
    BANDS, BORDERLINE, CONFIDENCE, EMPTY, FIX_MASS_ZEROED, NEEDS_FIX, ONE_HOT, Share, band_of, bootstrap_share,
    interval_text, mse_ratio, one_hot_rows, unit_index, unit_rows, unit_sums,
)
from fa_forensics.analyses.pcast.e4m3 import DpPoint, default_dp_scales, dp_curve
from fa_forensics.analyses.pcast.kernel import kv_order, pcast_attention, pcast_config, reference_attention
from fa_forensics.analyses.pcast.theory import LN_UNDERFLOW, expected_max_normal
from fa_forensics.layers.selection import load
from fa_forensics.analyses.stats import mean_se
from fa_forensics.analyses.payloads import PcastDumpPayload
from fa_forensics.errors import InvalidSetting
from fa_forensics.enums import KVOrder
from fa_forensics.replay.emulate.forward import scaled_scores
from fa_forensics.fidelity.match import ReplayFidelity

MIN_NONSINK_KEYS = 16  # rows with fewer non-sink keys give no sink-strength estimate
MSE_NOTE_RATIO = 1.2  # a setting whose output MSE is this much lower (beyond 2 se) is named as an accuracy choice


@dataclass(frozen=True)
class HeadSetting:
    """One (S, order) setting on one head's real scores."""

    S: float
    order: KVOrder
    frac_zeroed: float  # zeroed non-sink P̄ / all non-sink (unmasked) P̄
    mass_zeroed: float  # mean over rows of Σ zeroed P̄ / ℓ
    frac_zeroed_ci: tuple[float, float]  # cluster-bootstrap interval over units of query rows (`pcast.decision`)
    mass_zeroed_ci: tuple[float, float]
    closed_form: Optional[float]  # forward: Φ((gap − 10 ln 2 − ln S)/σ) from the measured gap; reverse: None
    mse: float  # mean over query rows of the per-row MSE of O against fp64 (V as captured)
    mse_se: float


@dataclass(frozen=True)
class HeadPcast:
    """The P-cast study on one captured head, with its recommendation."""

    step: int
    layer: int
    head: int
    rows: int  # query rows (batch × T)
    sink_gap: float  # mean over rows of (max score of the first k keys − mean non-sink score) / sd, in sd
    sink_gap_se: float
    sink_strength: float  # sink_gap − δ_k: the paper's Δ (sinks at Δ + N(0,1) have max Δ + δ_k)
    sink_gap_logits: float  # the same gap in natural-log units (what the 2^-10/S threshold sees)
    score_sd: float  # mean over rows of the non-sink score standard deviation (natural-log units)
    settings: tuple[HeadSetting, ...]
    needs_fix: bool  # band == "needs-fix": the lost mass's whole interval lies above the floor
    recommended_S: float
    recommended_order: KVOrder
    recommendation: str
    band: str  # needs-fix | borderline | no-fix | one-hot | empty (`pcast.decision`)
    lost_mass: float  # the default setting's lost probability mass (its mass_zeroed), NaN when empty
    lost_mass_ci: tuple[float, float]
    zeroed_share: float  # the default setting's zeroed share of non-sink P̄ (its frac_zeroed), NaN when empty
    zeroed_share_ci: tuple[float, float]
    units: int  # independent units of the intervals: runs of `unit_rows` consecutive query rows of one batch row
    unit_rows: int

    def setting(self, S: float, order: KVOrder | str) -> Optional[HeadSetting]:
        return next((s for s in self.settings if s.S == S and s.order == order), None)


@dataclass(frozen=True)
class PcastDumpResult:
    """Per-head P-cast metrics of a dump."""

    path: str
    n_sinks: int
    block: int
    delta_k: float
    scales: tuple[float, ...]
    orders: tuple[KVOrder, ...]
    heads: tuple[HeadPcast, ...]
    dp: tuple[DpPoint, ...] = ()  # dp(S) at the studied scales and the defaults
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None  # the study casts the dump's own scores: no recipe is replayed


def sink_gap_stats(z: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[float, float, float, float]:
    """Sink gap of a head from its scores: (gap in sd, its se over rows, gap in logits, mean sd).

    z (R, T) scores; allowed (R, T) bool. Per row with ≥ MIN_NONSINK_KEYS non-sink keys:
    gap = max over the first k keys − mean of the non-sink keys, and their sd.
    """
    nonsink = allowed.clone()
    nonsink[:, :k] = False
    sink = allowed.clone()
    sink[:, k:] = False
    n_ns = nonsink.sum(dim=-1)  # (R,)
    ok = (n_ns >= MIN_NONSINK_KEYS) & sink.any(dim=-1)
    if not bool(ok.any()):
        nan = float("nan")
        return nan, nan, nan, nan
    z64 = z.double()
    mu = torch.where(nonsink, z64, 0.0).sum(-1) / n_ns.clamp(min=1)
    var = torch.where(nonsink, (z64 - mu[:, None]) ** 2, 0.0).sum(-1) / (n_ns - 1).clamp(min=1)
    sd = var.sqrt()
    top = torch.where(sink, z64, -math.inf).amax(dim=-1)
    gap = (top - mu)[ok]
    gap_sd = gap / sd[ok].clamp(min=1e-12)
    g = mean_se(gap_sd.numpy())
    return g.value, g.se, float(gap.mean()), float(sd[ok].mean())


@dataclass(frozen=True)
class Recommendation:
    """Whether a head needs another P-cast setting, which one, and why in one line."""

    needs_fix: bool
    S: float
    order: KVOrder
    reason: str


def decision_setting(settings: Sequence[HeadSetting]) -> HeadSetting:
    """The setting the decision is made on: forward S = 1 (the default kernel), else the one that zeroes most."""
    base = next((s for s in settings if s.S == 1.0 and s.order is KVOrder.FORWARD), None)
    return base if base is not None else max(settings, key=lambda s: s.frac_zeroed)


def _share(s: HeadSetting) -> Share:
    return Share(s.mass_zeroed, *s.mass_zeroed_ci)


def _recommend(settings: Sequence[HeadSetting], band: str) -> Recommendation:
    """The recommendation from a head's settings and its band (`pcast.decision`).

    The setting named: among those within max(2 %, 2 se) of the best MSE, prefer S = 256 (bit-exact, smallest dp),
    then any other power of two, then forward order (no kernel change), then the lower MSE.
    """
    if not settings or band == EMPTY:
        return Recommendation(
            needs_fix=False, S=1.0, order=KVOrder.FORWARD,
            reason="empty: no query row sees a non-sink key (the sequence is no longer than the sink tokens), so the "
                   "P cast has nothing to drop: nothing to decide, no fix")
    best = min(settings, key=lambda s: s.mse)
    tol = max(0.02 * best.mse, 2.0 * (best.mse_se if math.isfinite(best.mse_se) else 0.0))
    good = [s for s in settings if s.mse <= best.mse + tol]
    pick = min(good, key=lambda s: (s.S != 256.0, not math.log2(s.S).is_integer(), s.order is not KVOrder.FORWARD,
                                    s.mse))
    base = decision_setting(settings)
    ratio = mse_ratio(base.mse, best.mse)
    ratio_s = f"×{ratio:.2f}" if math.isfinite(ratio) else "×n/a"
    label = f"{base.order.value} S={base.S:g}"
    lost = (f"{label} zeroes {base.frac_zeroed:.1%} of non-sink P̄, {interval_text(_share(base))} of the "
            "probability mass")
    floor = f"the {FIX_MASS_ZEROED:.1%} floor"
    if band == ONE_HOT:
        return Recommendation(
            needs_fix=False, S=base.S, order=base.order,
            reason=(f"one-hot: every query row puts all its probability on one key, so the P cast has nothing to "
                    f"lose ({label} drops {base.mass_zeroed:.2g} of the mass): no fix needed"))
    if band == NEEDS_FIX:
        rev = next((s for s in settings if s.S == base.S and s.order != base.order), None)
        alt = ""
        if rev is not None and base.order is KVOrder.FORWARD and math.isfinite(mse_ratio(rev.mse, best.mse)):
            alt = f"; reverse order alone gives MSE ×{mse_ratio(rev.mse, best.mse):.2f} of the best"
        reason = (f"P-collapse: {lost} (above {floor} over the whole interval; MSE {ratio_s} of the best): "
                  f"use {pick.order.value} S={pick.S:g}{alt}")
        return Recommendation(needs_fix=True, S=pick.S, order=pick.order, reason=reason)
    if band == BORDERLINE:
        reason = (f"borderline: {lost}; {floor} lies inside the interval, so these rows cannot tell this head from "
                  f"one at the floor (capture more batch rows or steps to decide)")
        if pick is not base:
            reason += f"; {pick.order.value} S={pick.S:g} keeps the mass if a margin is wanted"
        return Recommendation(needs_fix=False, S=pick.S, order=pick.order, reason=reason)
    reason = f"no collapse: {lost} (below {floor} over the whole interval), so no fix is needed"
    se = math.hypot(base.mse_se, best.mse_se) if math.isfinite(base.mse_se) and math.isfinite(best.mse_se) else 0.0
    if best is not base and ratio >= MSE_NOTE_RATIO and base.mse - best.mse > 2 * se:
        gain, gain_se = 1 - best.mse / base.mse, se / base.mse
        reason += (f"; {best.order.value} S={best.S:g} lowers the output MSE by {gain:.0%} ± {gain_se:.0%} "
                   "(an FP8 accuracy choice, not a collapse fix)")
    return Recommendation(needs_fix=False, S=pick.S, order=pick.order, reason=reason)


def _empty_head(where: tuple[int, int, int], B: int, T: int) -> HeadPcast:
    """A head with no query row to study (B·T = 0): a result that says so."""
    nan = float("nan")
    rec = _recommend((), EMPTY)
    step, layer, head = where
    return HeadPcast(step=step, layer=layer, head=head, rows=B * T, sink_gap=nan, sink_gap_se=nan, sink_strength=nan,
                     sink_gap_logits=nan, score_sd=nan, settings=(), needs_fix=False, recommended_S=rec.S,
                     recommended_order=rec.order, recommendation=rec.reason, band=EMPTY, lost_mass=nan,
                     lost_mass_ci=(nan, nan), zeroed_share=nan, zeroed_share_ci=(nan, nan), units=0,
                     unit_rows=unit_rows(T))


def analyze_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                 n_sinks: int = 4, block: int = 64, scales: Sequence[float] = (1.0, 256.0, 448.0),
                 orders: Sequence[KVOrder] = tuple(KVOrder), where: tuple[int, int, int] = (0, 0, 0)) -> HeadPcast:
    """The P-cast study on one head: q, k, v (B, T, D) as captured (any float dtype; used in fp32).

    Q, K, V stay in fp32 to isolate the P cast (§6.1). The scores are formed once as the engine
    forms them (α·Q Kᵀ under the recipe's accumulation), so every setting's replay gives the bits
    of a full replay of this head under `pcast_config(S, order, block)`. The zeroed and lost shares carry
    cluster-bootstrap intervals over runs of query rows, and the head's band is decided on them.
    """
    q32, k32, v32 = (x.to(torch.float32)[:, None] for x in (q, k, v))  # (B, 1, T, D)
    B, _, T, _ = q32.shape
    if B * T == 0:
        return _empty_head(where, B, T)
    z = scaled_scores(q32, k32, pcast_config(1.0, KVOrder.FORWARD, block), scale, causal, 0, 0)[:, 0]  # (B, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    counted = allowed.clone()
    counted[:, :n_sinks] = False  # (T, T): non-sink keys the row can see
    units = unit_index(B, T)  # (B, T)
    rows_per_unit = unit_sums(torch.ones(B, T), units)
    counted_per_unit = unit_sums(counted.sum(dim=-1).expand(B, T), units)
    v32 = v32[:, 0]
    o_ref, p_ref = reference_attention(z, v32)  # (B, T, D) fp64
    one_hot = bool(one_hot_rows(p_ref).all())
    del p_ref
    gap, gap_se, gap_logits, sd = sink_gap_stats(z.reshape(B * T, T), allowed.repeat(B, 1), n_sinks)
    settings = []
    for order in (kv_order(o) for o in orders):
        for S in scales:
            out = pcast_attention(z, v32, pcast_config(S, order, block), counted=counted)
            row_mse = mean_se(((out.o.double() - o_ref) ** 2).mean(dim=-1).reshape(-1).numpy())  # over B·T rows
            closed = None
            if order is KVOrder.FORWARD and math.isfinite(gap_logits) and sd > 0:
                closed = float(stats.norm.cdf((gap_logits - LN_UNDERFLOW - math.log(S)) / sd))
            frac = bootstrap_share(unit_sums(out.n_zeroed, units), counted_per_unit)
            mass = bootstrap_share(unit_sums(out.mass_zeroed, units), rows_per_unit)
            settings.append(HeadSetting(
                S=float(S), order=order, frac_zeroed=frac.value, mass_zeroed=mass.value,
                frac_zeroed_ci=(frac.lo, frac.hi), mass_zeroed_ci=(mass.lo, mass.hi),
                closed_form=closed, mse=row_mse.value, mse_se=row_mse.se,
            ))
    base = decision_setting(settings)
    band = EMPTY if not bool(counted.any()) else ONE_HOT if one_hot else band_of(_share(base))
    rec = _recommend(settings, band)
    step, layer, head = where
    return HeadPcast(step=step, layer=layer, head=head, rows=B * T, sink_gap=gap, sink_gap_se=gap_se,
                     sink_strength=gap - expected_max_normal(n_sinks), sink_gap_logits=gap_logits, score_sd=sd,
                     settings=tuple(settings), needs_fix=rec.needs_fix, recommended_S=rec.S,
                     recommended_order=rec.order, recommendation=rec.reason, band=band, lost_mass=base.mass_zeroed,
                     lost_mass_ci=base.mass_zeroed_ci, zeroed_share=base.frac_zeroed,
                     zeroed_share_ci=base.frac_zeroed_ci, units=len(rows_per_unit), unit_rows=unit_rows(T))


def run(dump, selections, *, n_sinks: int = 4, block: int = 64, scales: Sequence[float] = (1.0, 256.0, 448.0),
        orders: Sequence[KVOrder] = tuple(KVOrder)) -> PcastDumpResult:
    """`analyze_head` for every head of every `LayerSelection` (from `selection.select`)."""
    if n_sinks < 1:
        raise InvalidSetting("n_sinks", f"sink tokens must be ≥ 1, got {n_sinks}")
    if block < 1:
        raise InvalidSetting("block", f"block size must be ≥ 1, got {block} (e.g. 64)")
    orders = tuple(kv_order(o) for o in orders)
    heads, warnings = [], []
    for sel in selections:
        t = load(dump, sel)
        warnings.extend(w for w in t.warnings if w not in warnings)
        for j, h in enumerate(sel.heads):
            q, k, v = (x[:, j] for x in (t.q, t.k, t.v))  # (B, T, D)
            heads.append(analyze_head(q, k, v, scale=t.scale, causal=t.causal, n_sinks=n_sinks, block=block,
                                      scales=scales, orders=orders, where=(sel.step, sel.layer, h)))
    return PcastDumpResult(path=str(dump.path), n_sinks=n_sinks, block=block, delta_k=expected_max_normal(n_sinks),
                           scales=tuple(float(s) for s in scales), orders=orders, heads=tuple(heads),
                           dp=dp_curve(default_dp_scales(scales)), warnings=tuple(warnings))


def band_counts(res: PcastDumpResult) -> dict[str, int]:
    """How many heads fall in each band (every band named, 0 included)."""
    return {b: sum(h.band == b for h in res.heads) for b in BANDS}


def verdict(res: PcastDumpResult) -> str:
    """One sentence: how many heads lose probability mass to the default P cast (decided on its interval), how many
    are too close to the floor to call, the heads with nothing to lose, and the setting that fixes the first."""
    steps = sorted({h.step for h in res.heads})
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    counts = band_counts(res)
    floor = f"{FIX_MASS_ZEROED:.1%}"
    others = []
    if counts[BORDERLINE]:
        h = next(h for h in res.heads if h.band == BORDERLINE)
        others.append(f"{counts[BORDERLINE]} borderline (the {floor} floor inside the {CONFIDENCE:.0%} interval of "
                      f"the mass lost, e.g. layer {h.layer} head {h.head}: {interval_text(_share_of(h))})")
    if counts[ONE_HOT]:
        others.append(f"{counts[ONE_HOT]} one-hot (all probability on one key: nothing to lose)")
    if counts[EMPTY]:
        others.append(f"{counts[EMPTY]} empty (no non-sink key visible: nothing to decide)")
    tail = f"; {'; '.join(others)}" if others else ""
    need = [h for h in res.heads if h.band == NEEDS_FIX]
    if not need:
        return (f"no head of {len(res.heads)} ({where}) loses more than {floor} of its probability mass to the "
                f"default FP8 P cast (forward order, S = 1) over the whole {CONFIDENCE:.0%} interval: no P-cast fix "
                f"needed{tail}")
    h = need[0]
    use = "; ".join(f"{order} S={S:g}" for order, S in sorted({(x.recommended_order.value, x.recommended_S)
                                                               for x in need}))
    return (f"{len(need)} of {len(res.heads)} heads ({where}) need a P-cast fix: the default FP8 P cast (forward, "
            f"S = 1) drops more than {floor} of their probability mass over the whole {CONFIDENCE:.0%} interval "
            f"(P-collapse; e.g. layer {h.layer} head {h.head}: {interval_text(_share_of(h))}); use {use}{tail}")


def _share_of(h: HeadPcast) -> Share:
    return Share(h.lost_mass, *h.lost_mass_ci)


def payload(res: PcastDumpResult) -> PcastDumpPayload:
    """The --json payload of the dump mode (keys documented in docs/json.md)."""
    return {
        "mode": "dump", "dump": res.path, "n_sinks": res.n_sinks, "block": res.block, "delta_k": res.delta_k,
        "scales": list(res.scales), "orders": list(res.orders), "heads": list(res.heads),
        "dp": [{"S": p.S, "dp": p.dp, "lsb": p.lsb, "bit_exact": p.bit_exact} for p in res.dp],
        "warnings": list(res.warnings), "replay_fidelity": res.replay_fidelity, "verdict": verdict(res),
        "fix_floor": FIX_MASS_ZEROED, "confidence": CONFIDENCE, "band_counts": band_counts(res),
    }
