"""Tables of a delta-bias result."""
from __future__ import annotations

import math
from typing import Optional

from rich.table import Table

from fa_forensics.analyses.delta_bias.compute import DeltaBiasResult
from fa_forensics.analyses.quantities import claim_place, count_text, steps_text
from fa_forensics.analyses.stats import format_p, format_pm
from fa_forensics.analyses.wording import number, p_value, place, pm, text


def tables(r: DeltaBiasResult) -> list[Table]:
    """The per-(step, layer, head) table (most significant first) and, when there is a difference, the feature
    table of the focus head."""
    table = Table(title=f"delta-bias: Σ_T(δ_lp − δ_hp) per step, layer, head (lp = preset {r.preset}, "
                        f"{r.recipe.accumulation_name} accumulation); significant: {r.family.describe()}")
    for c in ("step", "layer", "head", "Σ(δ_lp − δ_hp) ± se", "rounding units", "units > 0", "t-test p",
              "Holm p", "significant"):
        table.add_column(c, justify="right")
    rows = sorted(r.per_step, key=lambda p: (p.adjusted_p, p.tested_p))
    for p in rows[:20]:
        table.add_row(str(p.step), str(p.layer), str(p.head), format_pm(p.delta_err_sum, p.delta_err_se),
                      number(p.effect, ".3f"), number(p.frac_positive, ".2f"), format_p(p.t_p_value),
                      format_p(p.adjusted_p), "yes" if p.significant else "no")
    if len(rows) > 20:
        table.caption = f"{len(rows) - 20} more rows in --json"
    pooled = pooled_table(r)
    if r.no_difference:
        return [t for t in (pooled, table) if t is not None]
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
    return [t for t in (pooled, table, ft) if t is not None]


def pooled_table(r: DeltaBiasResult) -> Optional[Table]:
    """Σδ per (layer, head) pooled over its steps, most significant first (None when every head has one step):
    the evidence of a bias of the run, found only where its sign holds at every step."""
    if not r.pooled:
        return None
    steps = sorted({s for p in r.pooled for s in p.steps})
    table = Table(title=f"delta-bias: Σ_T(δ_lp − δ_hp) per layer, head pooled over {steps_text(steps)} (units of "
                        f"every step; a bias of the run: significant and its sign held at every step); "
                        f"{r.family.describe()}")
    for c in ("layer", "head", "rows", "Σ(δ_lp − δ_hp) ± se", "rounding units", "units", "sign by step", "Holm p",
              "significant", "sign holds", "bias of the run"):
        table.add_column(c, justify="right")
    rows = sorted((x for p in r.pooled for x in p.subsets), key=lambda x: (x.adjusted_p, x.tested_p))
    for x in rows[:20]:
        table.add_row(str(x.layer), str(x.head), x.subset, format_pm(x.delta_err_sum, x.delta_err_se),
                      number(x.effect, ".3f"), str(x.n_units),
                      " ".join("+" if v > 0 else "−" if v < 0 else "0" for v in x.step_signs),
                      format_p(x.adjusted_p), "yes" if x.significant else "no", "yes" if x.sign_holds else "no",
                      "yes" if x.holds else "no")
    if len(rows) > 20:
        table.caption = f"{len(rows) - 20} more rows in --json"
    return table


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
    run = _run_sentence(d)
    if not sig:
        return (f"delta-bias: {run}no (step, layer, head) item has a significant Σ(δ_lp − δ_hp) (0 of {len(rows)}; "
                f"{family}); features carrying the most significant head's Σδ: {', '.join(feats) or 'n/a'}.")
    counted = count_text(_Item(r) for r in sig)
    return (f"delta-bias: {run}Σ(δ_lp − δ_hp) is significant in {counted} ({len(sig)} of {len(rows)} (step, layer, "
            f"head) items; {family}), {len(pos)} of them positive{where}; features carrying the focus head's Σδ: "
            f"{', '.join(feats) or 'n/a'}.")


def _run_sentence(d: dict) -> str:
    """The Σδ claim pooled over steps, first ('' when the claim is one step's item)."""
    bias = d.get("bias") if isinstance(d.get("bias"), dict) else {}
    if len([s for s in (bias.get("steps") or []) if isinstance(s, int)]) < 2:
        return ""
    stats = (f"{pm(bias.get('value'), bias.get('se'))} over {text(bias.get('n_units'))} units, Holm p "
             f"{p_value(bias.get('adjusted_p'))}")
    if bias.get("found"):
        return f"Σδ pooled at {claim_place(bias)} is a bias of the run ({stats}; its sign holds at every step); "
    opposed = [str(s) for s in (bias.get("opposed_steps") or [])]
    if bias.get("sign_holds") is False and opposed:
        return (f"Σδ pooled at {claim_place(bias)} ({stats}) is no bias of the run: its sign does not hold at step(s) "
                f"{', '.join(opposed)}; ")
    return f"no Σδ pooled over steps is significant (most significant: {claim_place(bias)}, {stats}); "


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
        ("the Σδ claim's place", claim_place(bias)),
        ("its units", text(bias.get("n_units"))),
        ("its Σ(δ_lp − δ_hp) ± se (gradient units)", pm(bias.get("value"), bias.get("se"))),
        ("its size (rounding units)", number(bias.get("effect"), ".3f")),
        ("its p / Holm p", f"{p_value(bias.get('p_value'))} / {p_value(bias.get('adjusted_p'))}"),
        (f"{place(focus, 'layer', 'head')} over its {text(focus.get('steps'))} step(s) ± se",
         pm(focus.get("delta_err_sum"), focus.get("se"))),
        ("features carrying it", ", ".join(feats) or "n/a"),
        ("every selected head together ± se", pm(total.get("delta_err_sum"), total.get("se"))),
    ]
