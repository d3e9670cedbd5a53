"""`fa-forensics delta-bias`: the sign and origin of Σ_T(δ_lp − δ_hp) (paper §3.3.1-3.3.2, Fig. 5)."""
from __future__ import annotations

import math

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    console, ensure_out_dir, progress_bar, register_selection_command, write_json,
)
from fa_forensics.commands.isolate import open_selection


def run(dump_path, step, layer, head, accumulation, backend, out, json_path, preset="bf16"):
    from fa_forensics.analyses.delta_bias import delta_bias
    from fa_forensics.analyses.stats import format_p, format_pm

    dump, sels = open_selection(dump_path, step, layer, head, accumulation, backend, preset)
    out = ensure_out_dir(out)
    with progress_bar("delta-bias", len(sels)) as advance:
        r = delta_bias(dump, sels, accumulation=accumulation, backend=backend, preset=preset, progress=advance)

    table = Table(title=f"delta-bias: Σ_T(δ_lp − δ_hp) per step, layer, head (lp = preset {r.preset}, {accumulation} accumulation)")
    for c in ("step", "layer", "head", "Σ(δ_lp − δ_hp) ± se", "frac > 0", "sign-test p"):
        table.add_column(c, justify="right")
    rows = sorted(r.per_step, key=lambda p: -abs(p.delta_err_sum))
    for p in rows[:20]:
        table.add_row(str(p.step), str(p.layer), str(p.head), format_pm(p.delta_err_sum, p.delta_err_se), f"{p.frac_positive:.2f}", format_p(p.p_value))
    if len(rows) > 20:
        table.caption = f"{len(rows) - 20} more rows in --json"
    console.print(table)
    ft = Table(title=f"features carrying it in layer {r.focus_layer} head {r.focus_head}: Σ_T dO·(O_lp − O_hp)")
    for c in ("feature", "contribution", "share", "sign agreement dO vs O error"):
        ft.add_column(c, justify="right")
    no_difference = r.total == 0 and all(p.delta_err_sum == 0 for p in r.per_step)
    for f in r.top_features:
        share = f"{f.share:.0%}" if math.isfinite(f.share) else "—"
        ft.add_row(str(f.feature), f"{f.contribution:+.3e}", share, f"{f.sign_agreement:.2f}")
    if not no_difference:
        console.print(ft)

    figures = []
    if out is not None:
        from fa_forensics.figures.delta_bias import plot_cumulative, plot_top_token

        figures.append(str(plot_cumulative(r, out / "delta_bias_cumulative.png")))
        if r.top_token is not None:
            figures.append(str(plot_top_token(r, out / "delta_bias_top_token.png")))
    sign = "positive" if r.total > 0 else "negative"
    verdict = (f"preset {r.preset}: no difference from the fp32 replay (δ_lp = δ_hp for all {r.n_tokens} tokens): "
               f"nothing to analyse; choose a low-precision --preset" if no_difference else
               f"preset {r.preset}: Σ(δ_lp − δ_hp) = {r.total:+.3g} ± {r.total_se:.2g} over {r.n_tokens} tokens ({sign}; t-test p {format_p(_t_p(r))}, "
               f"sign-test p {format_p(r.total_p_value)}); largest in layer {r.focus_layer} head {r.focus_head}, "
               f"carried by features {[f.feature for f in r.top_features[:3]]}")
    payload = {
        "per_step": r.per_step, "steps": r.steps, "step_sums": r.step_sums, "cumulative": r.cumulative,
        "top_features": r.top_features, "focus": {"layer": r.focus_layer, "head": r.focus_head},
        "total": {"delta_err_sum": r.total, "se": r.total_se, "t_p_value": _t_p(r), "p_value": r.total_p_value,
                  "frac_positive": r.total_frac_positive, "n_tokens": r.n_tokens},
        "top_token": r.top_token, "cumulative_tokens": r.cumulative_tokens,
        "preset": r.preset, "accumulation": r.accumulation, "backend": r.backend, "figures": figures, "verdict": verdict,
    }
    write_json(json_path, payload)
    console.print(f"[bold]verdict:[/] {verdict}")


def _t_p(r) -> float:
    from fa_forensics.analyses.stats import MeanSE

    return MeanSE(r.total, r.total_se, r.n_tokens).p_value


def register(app: typer.Typer) -> None:
    register_selection_command(app, "delta-bias", "Sign and origin of Σ_T(δ_lp − δ_hp): per step/layer/head, cumulative, per feature (paper §3.3, Fig. 5).", run)
