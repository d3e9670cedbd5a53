"""Tables of an isolate result."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.isolate.compute import IsolateResult
from fa_forensics.analyses.quantities import claim_place
from fa_forensics.analyses.stats import format_p, format_pm
from fa_forensics.analyses.wording import number, p_value, place, pm, text


def tables(r: IsolateResult) -> list[Table]:
    """The repairs table (culprits marked ✓) and the ten heads with the largest Σδ error."""
    bm, bn = r.baseline_tiles
    n_layer_steps = len({(h.step, h.layer) for h in r.heads})
    table = Table(title=f"isolate: single repairs of preset {r.preset} vs fp32 ({n_layer_steps} layer-steps, "
                        f"{r.accumulation} accumulation, "
                        f"baseline tiles {bm}x{bn}); Σδ summed over every selected head")
    for c in ("variant", "O bias (mean ± se)", "O RMSE", "Σ(δ_var − δ_hp) ± se", "bias removed", "residual Holm p",
              "‖dQ err‖", "‖dW_Q err‖"):
        table.add_column(c, justify="left" if c == "variant" else "right")
    rows = [*r.variants, *([r.input_cast] if r.input_cast is not None else [])]
    for v in rows:
        mark = " ✓" if v.name in r.culprits else (" (not a kernel error)" if v is r.input_cast else "")
        table.add_row(v.name + mark, format_pm(v.o_bias, v.o_bias_se), f"{v.o_rmse:.2e}",
                      format_pm(v.delta_err_sum, v.delta_err_se),
                      "—" if v.name == "baseline" or v.reduction != v.reduction else f"{v.reduction:.0%}",
                      "—" if v.name == "baseline" else number(v.residual_p, ".2g", missing="—"),
                      f"{v.dq_err:.2e}", "no X" if v.dwq_err is None else f"{v.dwq_err:.2e}")
    table.caption = ("Σ(δ_var − δ_hp) sums every selected head, biased or not; bias removed and the residual's Holm p "
                     "concern the significant items only (a repair removes the bias when ≥ 90 % of it is gone, or ≥ "
                     "50 % with no significant residual)")
    ht = Table(title=f"(step, layer, head) items of the baseline, most significant first; significant: "
                     f"{r.family.describe()}")
    for c in ("step", "layer", "head", "Σ(δ_lp − δ_hp) ± se", "rounding units", "t-test p", "Holm p",
              "significant"):
        ht.add_column(c, justify="right")
    for h in r.heads[:10]:
        ht.add_row(str(h.step), str(h.layer), str(h.head), format_pm(h.delta_err_sum, h.delta_err_se),
                   number(h.effect, ".3f"), format_p(h.t_p_value), format_p(h.adjusted_p),
                   "yes" if h.significant else "no")
    return [table, ht]


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    culprits = d.get("culprits") or []
    heads = [h for h in (d.get("heads") or []) if isinstance(h, dict)]
    biased = [h for h in heads if h.get("significant")]
    top = heads[0] if heads else None
    where = (f"; the most significant item is {place(top, 'step', 'layer', 'head')} "
             f"({number(top.get('delta_err_sum'), '+.3g')} ± {number(top.get('delta_err_se'), '.2g')})"
             if top else "")
    bias = d.get("bias") if isinstance(d.get("bias"), dict) else {}
    if bias.get("found") and len(bias.get("steps") or []) > 1:
        stats = f"{pm(bias.get('value'), bias.get('se'))} over {text(bias.get('n_units'))} units"
        return (f"isolate: the baseline's Σδ bias of the run at {claim_place(bias)} ({stats}, its sign held at every "
                f"step) is removed by: "
                f"{', '.join(map(str, culprits)) or 'no single repair'}{where}.")
    if biased and not bias.get("found") and len(bias.get("steps") or []) > 1:
        return (f"isolate: Σδ is significant at single steps, but no Σδ pooled over steps is a bias of the run (most "
                f"significant: {claim_place(bias)}), so no repair is credited with removing one{where}.")
    if not biased:
        return f"isolate: no significant Σδ bias in the baseline, so no repair has one to remove{where}."
    layers_heads = {(h.get("layer"), h.get("head")) for h in biased}
    steps = {h.get("step") for h in biased}
    counted = (f"{len(layers_heads)} head{'s' if len(layers_heads) != 1 else ''} over {len(steps)} "
               f"step{'s' if len(steps) != 1 else ''}")
    return (f"isolate: the baseline's Σδ bias ({counted}) is removed by: "
            f"{', '.join(map(str, culprits)) or 'no single repair'}{where}.")


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (units in the labels; keys read defensively)."""
    heads = [h for h in (d.get("heads") or []) if isinstance(h, dict)]
    biased = [h for h in heads if h.get("significant")]
    top = heads[0] if heads else {}
    bias = d.get("bias") if isinstance(d.get("bias"), dict) else {}
    base = next((v for v in d.get("variants") or [] if isinstance(v, dict) and v.get("name") == "baseline"), {})
    tiles = d.get("baseline_tiles") or []
    return [
        ("the Σδ claim's place", claim_place(bias) if bias else "n/a"),
        ("its Σ(δ_lp − δ_hp) ± se over its units", f"{pm(bias.get('value'), bias.get('se'))} over "
                                                   f"{text(bias.get('n_units'))} units" if bias else "n/a"),
        ("a bias of the run", "yes" if bias.get("found") else "no"),
        ("(step, layer, head) items with a significant Σδ", f"{len(biased)} of {len(heads)}"),
        ("most significant item", place(top, "step", "layer", "head")
         if top else "n/a"),
        ("its Σ(δ_lp − δ_hp) ± se (gradient units)", pm(top.get("delta_err_sum"), top.get("delta_err_se"))),
        ("its size (rounding units)", number(top.get("effect"), ".3f")),
        ("its t-test p / Holm p", f"{p_value(top.get('t_p_value'))} / "
                                            f"{p_value(top.get('adjusted_p'))}" if top else "n/a"),
        ("baseline Σδ over every selected head ± se", pm(base.get("delta_err_sum"), base.get("delta_err_se"))),
        ("repairs that remove it", ", ".join(map(str, d.get("culprits") or [])) or "none"),
        ("baseline tiles (block_m × block_n)", " × ".join(map(str, tiles)) or "n/a"),
    ]
