"""Tables of the pcast study: per head of a dump (`tables`), and the simulation's (`sim_tables`)."""
from __future__ import annotations

import math

from rich.table import Table

from fa_forensics.analyses.pcast.compute import PcastDumpResult
from fa_forensics.analyses.pcast.decision import BORDERLINE, CONFIDENCE, EMPTY, FIX_MASS_ZEROED, ONE_HOT, ratio_text
from fa_forensics.analyses.pcast.sim import DELTA_FIG3, PcastSimResult
from fa_forensics.analyses.stats import format_p
from fa_forensics.analyses.wording import percent, place, text


def tables(res: PcastDumpResult) -> list:
    """Per head: sink strength, zeroed share and MSE ratio per (order, S), the lost mass with its interval, the band
    and the recommendation."""
    t = Table(title=f"P-cast per head of {res.path} (k = {res.n_sinks} sink keys, B = {res.block}); "
                    f"cells: non-sink P̄ zeroed, MSE / best MSE; mass lost by forward S=1 with its "
                    f"{CONFIDENCE:.0%} interval over runs of query rows")
    for c in ("step", "L", "H", "sink Δ̂"):
        t.add_column(c, justify="right")
    for order in res.orders:
        for S in res.scales:
            t.add_column(f"{'fwd' if order == 'forward' else 'rev'} {S:g}", justify="right")
    t.add_column("mass lost", justify="right")
    t.add_column("band")
    t.add_column("needs")
    for h in res.heads:
        best = min((s.mse for s in h.settings), default=float("nan"))
        cells = []
        for order in res.orders:
            for S in res.scales:
                s = h.setting(S, order)
                cells.append("-" if s is None else f"{percent(s.frac_zeroed, 0)} {ratio_text(s.mse, best)}")
        lost = (f"{h.lost_mass:.2%} [{h.lost_mass_ci[0]:.2%}, {h.lost_mass_ci[1]:.2%}]"
                if math.isfinite(h.lost_mass) else "n/a")
        sink = f"{h.sink_strength:.1f}±{h.sink_gap_se:.1f}" if math.isfinite(h.sink_strength) else "n/a"
        t.add_row(str(h.step), str(h.layer), str(h.head), sink, *cells, lost, h.band,
                  f"{h.recommended_order.value} S={h.recommended_S:g}" if h.needs_fix else "-")
    return [t, *(f"  step {h.step} layer {h.layer} head {h.head}: {h.recommendation}" for h in res.heads)]


def dp_table(points) -> Table:
    """dp(S) at the listed scales."""
    t = Table(title="dp(S): worst-case normalized E4M3 step of the P-cast (exhaustive enumeration)")
    for c in ("S", "dp(S)", "dp / 2^-4", "bit-exact"):
        t.add_column(c, justify="right")
    for p in points:
        t.add_row(f"{p.S:g}", f"{p.dp:.4f}", f"{p.dp / 2 ** -4:.3f}", "yes" if p.bit_exact else "no")
    return t


def sim_tables(res: PcastSimResult) -> list:
    """The simulation's tables and lines: Table 1, Fig. 3's data, dp(S), the ratios, the t-tests, explanations,
    notes."""
    out: list = []
    n = res.n_main
    t = Table(title=f"Table 1: P-collapse (N = {n}, k = {res.config.n_sinks}, B = {res.config.block}, "
                    f"δ_k = {res.delta_k:.4f} integrated; {res.config.n_seeds} seeds)")
    for c in ("Δ", "S", "order", "frac zeroed ± se", "closed form", "spread-avg", "non-sink mass", "info loss",
              "MSE ± se"):
        t.add_column(c, justify="right")
    for r in sorted((r for r in res.rows if r.seq == n), key=lambda r: (r.order, r.S, r.delta)):
        t.add_row(f"{r.delta:g}", f"{r.S:g}", r.order.value, f"{r.frac_zeroed:.3f} ± {r.frac_zeroed_se:.3f}",
                  f"{r.closed_form:.3f}", f"{r.closed_form_spread:.3f}", f"{r.nonsink_mass:.3f}", f"{r.info_loss:.3f}",
                  f"{r.mse:.3e} ± {r.mse_se:.1e}")
    out.append(t)
    seqs = sorted({r.seq for r in res.rows if r.delta == DELTA_FIG3})
    if len(seqs) > 1:
        t = Table(title=f"Fig. 3 data: MSE vs N at Δ = {DELTA_FIG3:g}")
        t.add_column("order, S")
        for s in seqs:
            t.add_column(f"N={s}", justify="right")
        for order in res.config.orders:
            for S in res.config.scales:
                cells = [res.row(DELTA_FIG3, S, order, s) for s in seqs]
                t.add_row(f"{order.value} S={S:g}", *[f"{c.mse:.2e}" if c else "-" for c in cells])
        out.append(t)
    out.append(dp_table(res.dp))
    for ratio in (res.ratio, res.ratio_448):
        if ratio is not None:
            out.append(f"MSE {ratio.numerator} / {ratio.denominator} at Δ = {ratio.delta:g}, N = {ratio.seq}: "
                          f"[bold]{ratio.value:.2f} ± {ratio.se:.2f}[/] (paired over {ratio.n} seeds)")
    if res.ttest:
        t = Table(title=f"Paired t-test: forward S=256 vs reverse S=256 (N = {n}, instances = seeds; Holm over the "
                        f"{len(res.ttest)} Δ values)")
        for c in ("Δ", "n", "MSE fwd", "MSE rev", "mean diff ± se", "t", "p", "Holm p", "verdict"):
            t.add_column(c, justify="right")
        for x in res.ttest:
            verdict = {"a better": "forward better", "b better": "reverse better"}.get(x.verdict, x.verdict)
            t.add_row(f"{x.delta:g}", str(x.n), f"{x.mse_a:.3e}", f"{x.mse_b:.3e}",
                      f"{x.mean_diff:+.2e} ± {x.se_diff:.1e}", f"{x.t:.2f}", format_p(x.p_value),
                      format_p(x.adjusted_p), verdict)
        out.append(t)
    explained = [r for r in res.rows if r.explanation and r.seq == n]
    if explained:
        out.append("[bold]Where measured and closed form differ by more than 0.02:[/]")
        for r in explained:
            out.append(f"  Δ={r.delta:g} S={r.S:g} {r.order.value}: measured {r.frac_zeroed:.3f} vs "
                       f"{r.closed_form:.3f}: {r.explanation}")
    for note in res.notes:
        out.append(f"[dim]note: {note}[/]")
    return out


def _band(h: dict) -> str:
    """A head's band from its payload; payloads without one fall back on needs_fix."""
    band = h.get("band")
    return band if isinstance(band, str) else ("needs-fix" if h.get("needs_fix") else "no-fix")


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    heads = [h for h in (d.get("heads") or []) if isinstance(h, dict)]
    if not heads:
        return "pcast: no head analysed."
    need = [h for h in heads if h.get("needs_fix")]
    border = [h for h in heads if _band(h) == BORDERLINE]
    quiet = [h for h in heads if _band(h) in (ONE_HOT, EMPTY)]
    extra = ""
    if border:
        extra += (f" {len(border)} borderline (the {FIX_MASS_ZEROED:.1%} floor inside the interval of the mass lost: "
                  f"{', '.join(place(h, 'layer', 'head') for h in border[:4])}).")
    if quiet:
        extra += f" {len(quiet)} one-hot or empty (nothing to lose)."
    if not need:
        return (f"pcast: none of the {len(heads)} heads studied loses probability mass to the default FP8 P cast "
                f"beyond the {FIX_MASS_ZEROED:.1%} floor over its whole interval (no P-cast fix needed).{extra}")
    where = ", ".join(f"{place(h, 'layer', 'head')}" for h in need[:4])
    more = f" and {len(need) - 4} more" if len(need) > 4 else ""
    use = sorted({f"{text(h.get('recommended_order'))} S={h.get('recommended_S'):g}" for h in need
                  if isinstance(h.get("recommended_S"), (int, float))})
    return (f"pcast: {len(need)} of {len(heads)} heads need a P-cast fix (P-collapse: the default FP8 P cast drops "
            f"probability mass): {where}{more}; use {'; '.join(use) or 'another S'}.{extra}")


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (keys read defensively)."""
    heads = [h for h in (d.get("heads") or []) if isinstance(h, dict)]
    need = [h for h in heads if h.get("needs_fix")]
    border = [h for h in heads if _band(h) == BORDERLINE]
    use = sorted({f"{text(h.get('recommended_order'))} S={h.get('recommended_S'):g}" for h in need
                  if isinstance(h.get("recommended_S"), (int, float))})
    lost = [(s.get("mass_zeroed"), s.get("mass_zeroed_ci")) for h in need for s in h.get("settings") or []
            if isinstance(s, dict) and s.get("S") == 1.0 and s.get("order") == "forward"
            and isinstance(s.get("mass_zeroed"), (int, float))]
    top = max(lost, key=lambda x: x[0]) if lost else None
    top_text = "n/a"
    if top is not None:
        ci = top[1] if isinstance(top[1], list) and len(top[1]) == 2 else None
        top_text = percent(top[0], 2) + (f" [{percent(ci[0], 2)}, {percent(ci[1], 2)}]" if ci else "")
    return [
        ("heads studied (last complete step)", str(len(heads))),
        ("heads that need a P-cast fix (P-collapse)", str(len(need))),
        ("borderline heads (floor inside the interval)", str(len(border))),
        ("largest probability mass the default cast drops", top_text),
        ("setting that fixes them", "; ".join(use) or "n/a"),
        ("sink tokens assumed / KV block", f"{text(d.get('n_sinks'))} / {text(d.get('block'))}"),
    ]
