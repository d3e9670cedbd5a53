"""Tables of a delta-bias result."""
from __future__ import annotations

import math

from rich.table import Table

from fa_forensics.analyses.delta_bias.compute import DeltaBiasResult
from fa_forensics.analyses.quantities import count_text
from fa_forensics.analyses.stats import format_p, format_pm
from fa_forensics.analyses.wording import number, p_value, place, pm, text


def tables(r: DeltaBiasResult) -> list[Table]:
    """The per-(step, layer, head) table (most significant first) and, when there is a difference, the feature
    table of the focus head."""
    table = Table(title=f"delta-bias: Σ_T(δ_lp − δ_hp) per step, layer, head (lp = preset {r.preset}, "
                        f"{r.recipe.accumulation_name} accumulation); significant: {r.family.describe()}")
    for c in ("step", "layer", "head", "Σ(δ_lp − δ_hp) ± se", "rounding units", "frac > 0", "t-test p",
              "sign-test p", "Holm p", "significant"):
        table.add_column(c, justify="right")
    rows = sorted(r.per_step, key=lambda p: (p.adjusted_p, p.tested_p))
    for p in rows[:20]:
        table.add_row(str(p.step), str(p.layer), str(p.head), format_pm(p.delta_err_sum, p.delta_err_se),
                      number(p.effect, ".3f"), number(p.frac_positive, ".2f"), format_p(p.t_p_value),
                      format_p(p.p_value), format_p(p.adjusted_p), "yes" if p.significant else "no")
    if len(rows) > 20:
        table.caption = f"{len(rows) - 20} more rows in --json"
    if r.no_difference:
        return [table]
    head = r.focus_total
    ft = Table(title=f"features carrying it in layer {r.focus_layer} head {r.focus_head} (Σδ over its {head.n_items} "
                     f"step(s): {format_pm(head.value, head.se)}): Σ_T dO·(O_lp − O_hp)")
    for c in ("feature", "contribution", "signed share of the head's sum", "sign agreement dO vs O error"):
        ft.add_column(c, justify="right")
    for f in r.top_features:
        share = f"{f.share:+.0%}" if math.isfinite(f.share) else "—"
        ft.add_row(str(f.feature), f"{f.contribution:+.3e}", share, f"{f.sign_agreement:.2f}")
    ft.caption = ("signed shares add up to 100 % over all features; features of the opposite sign give negative "
                  "shares, so one feature can carry more than 100 %")
    return [table, ft]


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    rows = [r for r in (d.get("per_step") or []) if isinstance(r, dict)]
    sig = [r for r in rows if r.get("significant")]
    pos = [r for r in sig if (r.get("delta_err_sum") or 0) > 0]
    feats = [str(f.get("feature")) for f in (d.get("top_features") or [])[:3] if isinstance(f, dict)]
    focus = d.get("focus") or {}
    family = (d.get("family") or {}).get("text", "the policy's correction")
    where = (f" ({place(focus, 'layer', 'head')}: {number(focus.get('delta_err_sum'), '+.3g')} ± "
             f"{number(focus.get('se'), '.2g')} over its {text(focus.get('steps'))} step(s))" if focus else "")
    if not sig:
        return (f"delta-bias: no (step, layer, head) item has a significant Σ(δ_lp − δ_hp) (0 of {len(rows)}; "
                f"{family}); features carrying the most significant head's Σδ: {', '.join(feats) or 'n/a'}.")
    counted = count_text(_Item(r) for r in sig)
    return (f"delta-bias: Σ(δ_lp − δ_hp) is significant in {counted} ({len(sig)} of {len(rows)} (step, layer, head) "
            f"items; {family}), {len(pos)} of them positive{where}; features carrying the focus head's Σδ: "
            f"{', '.join(feats) or 'n/a'}.")


class _Item:
    """A JSON item read as the (step, layer, head) that `count_text` counts."""

    def __init__(self, d: dict):
        self.step, self.layer, self.head = d.get("step"), d.get("layer"), d.get("head")


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (units in the labels; keys read defensively)."""
    rows = [r for r in (d.get("per_step") or []) if isinstance(r, dict)]
    sig = [r for r in rows if r.get("significant")]
    bias = d.get("bias") if isinstance(d.get("bias"), dict) else {}
    focus = d.get("focus") if isinstance(d.get("focus"), dict) else {}
    total = d.get("total") if isinstance(d.get("total"), dict) else {}
    feats = [str(f.get("feature")) for f in (d.get("top_features") or [])[:3] if isinstance(f, dict)]
    return [
        ("(step, layer, head) items with a significant Σδ",
         f"{len(sig)} of {len(rows)} ({count_text(_Item(r) for r in sig)})"),
        ("most significant item", place(bias, "step", "layer", "head")),
        ("its Σ(δ_lp − δ_hp) ± se (gradient units)", pm(bias.get("value"), bias.get("se"))),
        ("its size (rounding units)", number(bias.get("effect"), ".3f")),
        ("its p / Holm p", f"{p_value(bias.get('p_value'))} / {p_value(bias.get('adjusted_p'))}"),
        (f"{place(focus, 'layer', 'head')} over its {text(focus.get('steps'))} step(s) ± se",
         pm(focus.get("delta_err_sum"), focus.get("se"))),
        ("features carrying it", ", ".join(feats) or "n/a"),
        ("every selected head together ± se", pm(total.get("delta_err_sum"), total.get("se"))),
    ]
