"""Tables of a delta-bias result."""
from __future__ import annotations

import math

from rich.table import Table

from fa_forensics.analyses.delta_bias.compute import DeltaBiasResult
from fa_forensics.analyses.stats import format_p, format_pm


def tables(r: DeltaBiasResult) -> list[Table]:
    """The per-(step, layer, head) table and, when there is a difference, the feature table."""
    table = Table(title=f"delta-bias: Σ_T(δ_lp − δ_hp) per step, layer, head (lp = preset {r.preset}, "
                        f"{r.recipe.accumulation_name} accumulation)")
    for c in ("step", "layer", "head", "Σ(δ_lp − δ_hp) ± se", "frac > 0", "sign-test p"):
        table.add_column(c, justify="right")
    rows = sorted(r.per_step, key=lambda p: -abs(p.delta_err_sum))
    for p in rows[:20]:
        table.add_row(str(p.step), str(p.layer), str(p.head), format_pm(p.delta_err_sum, p.delta_err_se),
                      f"{p.frac_positive:.2f}", format_p(p.p_value))
    if len(rows) > 20:
        table.caption = f"{len(rows) - 20} more rows in --json"
    if r.no_difference:
        return [table]
    ft = Table(title=f"features carrying it in layer {r.focus_layer} head {r.focus_head}: Σ_T dO·(O_lp − O_hp)")
    for c in ("feature", "contribution", "share", "sign agreement dO vs O error"):
        ft.add_column(c, justify="right")
    for f in r.top_features:
        share = f"{f.share:.0%}" if math.isfinite(f.share) else "—"
        ft.add_row(str(f.feature), f"{f.contribution:+.3e}", share, f"{f.sign_agreement:.2f}")
    return [table, ft]


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    rows = d.get("per_step") or []
    sig = [r for r in rows if isinstance(r, dict) and (r.get("p_value") or 1) < 0.01]
    pos = [r for r in sig if (r.get("delta_err_sum") or 0) > 0]
    feats = [str(f.get("feature")) for f in (d.get("top_features") or [])[:3] if isinstance(f, dict)]
    return (f"delta-bias: {len(sig)} of {len(rows)} (step, layer, head) items have a significant Σ(δ_lp − δ_hp) "
            f"(sign test p < 0.01), {len(pos)} of them positive; top features by dO·(O_lp − O_hp): "
            f"{', '.join(feats) or 'n/a'}.")
