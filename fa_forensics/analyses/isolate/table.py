"""Tables of an isolate result."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.isolate.compute import IsolateResult
from fa_forensics.analyses.stats import format_p, format_pm
from fa_forensics.analyses.wording import number


def tables(r: IsolateResult) -> list[Table]:
    """The repairs table (culprits marked ✓) and the ten heads with the largest Σδ error."""
    bm, bn = r.baseline_tiles
    n_layer_steps = len({(h.step, h.layer) for h in r.heads})
    table = Table(title=f"isolate: single repairs of preset {r.preset} vs fp32 ({n_layer_steps} layer-steps, "
                        f"{r.accumulation} accumulation, "
                        f"baseline tiles {bm}x{bn})")
    for c in ("variant", "O bias (mean ± se)", "O RMSE", "Σ(δ_var − δ_hp) ± se", "bias removed", "‖dQ err‖",
              "‖dW_Q err‖"):
        table.add_column(c, justify="left" if c == "variant" else "right")
    rows = [*r.variants, *([r.input_cast] if r.input_cast is not None else [])]
    for v in rows:
        mark = " ✓" if v.name in r.culprits else (" (not a kernel error)" if v is r.input_cast else "")
        table.add_row(v.name + mark, format_pm(v.o_bias, v.o_bias_se), f"{v.o_rmse:.2e}",
                      format_pm(v.delta_err_sum, v.delta_err_se),
                      "—" if v.name == "baseline" or v.reduction != v.reduction else f"{v.reduction:.0%}",
                      f"{v.dq_err:.2e}", "no X" if v.dwq_err is None else f"{v.dwq_err:.2e}")
    ht = Table(title="heads ranked by |Σ_T(δ_lp − δ_hp)| (baseline)")
    for c in ("step", "layer", "head", "Σ(δ_lp − δ_hp) ± se", "t-test p", "sign-test p"):
        ht.add_column(c, justify="right")
    for h in r.heads[:10]:
        ht.add_row(str(h.step), str(h.layer), str(h.head), format_pm(h.delta_err_sum, h.delta_err_se),
                   format_p(h.t_p_value), format_p(h.p_value))
    return [table, ht]


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    culprits = d.get("culprits") or []
    heads = d.get("heads") or []
    top = heads[0] if heads else None
    where = (f"; the largest Σδ error is at step {top.get('step')}, layer {top.get('layer')}, "
             f"head {top.get('head')} ({number(top.get('delta_err_sum'))})") if isinstance(top, dict) else ""
    return (f"isolate: repairs that remove ≥ 90% of the δ error: {', '.join(map(str, culprits)) or 'none'}{where}.")
