"""`fa-forensics timeline`: training-time figures from a dump's per-step statistics."""
from __future__ import annotations

import typer
from rich.table import Table

from fa_forensics.commands.common import DebugOpt, DumpArg, JsonOpt, OutOpt, console, ensure_out_dir, run_cli, write_json


def timeline(dump: DumpArg, out: OutOpt = None, json_path: JsonOpt = None, debug: DebugOpt = False) -> None:
    """Loss, W_Q spectral norms, repeated maxima and max logits over the monitored steps (paper Fig. 2, 3, 11, 13)."""

    def body() -> None:
        from fa_forensics.analyses.timeline import analyse_timeline, timeline_json
        from fa_forensics.dump import open_dump

        d = open_dump(dump)
        result = analyse_timeline(d.timeline, where=str(dump))
        table = Table(title=f"timeline of {dump}: {len(result.steps)} monitored steps "
                            f"({int(result.steps[0])}..{int(result.steps[-1])}), {result.n_layers} layers × {result.n_heads} heads")
        for col in ("layer", "head", "max logit (last)", "repeated-max rows (last)", "extra P̄=1 (last)", "‖W_Q‖₂ first → last"):
            table.add_column(col, justify="right")
        import numpy as np

        s = result.series
        for layer in range(result.n_layers):
            for head in range(result.n_heads):
                def last(m):
                    return f"{s[m][-1, layer, head]:.4g}" if m in s and np.isfinite(s[m][-1, layer, head]) else "–"
                wq = s.get("wq_sigma")
                wq_txt = (f"{wq[0, layer, head]:.3f} → {wq[-1, layer, head]:.3f}"
                          if wq is not None and np.isfinite(wq[-1, layer, head]) else "–")
                table.add_row(str(layer), str(head), last("max_logit"), last("near_max_ties"), last("p_one_extra"), wq_txt)
        console.print(table)
        if result.ties_loss_spearman is not None:
            console.print(f"repeated maxima vs loss: Spearman ρ = {result.ties_loss_spearman:+.3f} (p = {result.ties_loss_p_value:.3g})")
        if result.top_wq_head is not None:
            console.print(f"largest W_Q spectral norm at the last step: layer {result.top_wq_head[0]} head {result.top_wq_head[1]}")
        if result.alarm_steps:
            console.print(f"alarms fired at steps {list(result.alarm_steps)}")
        out_dir = ensure_out_dir(out)
        if out_dir is not None:
            from fa_forensics.figures.timeline import all_timeline_figures

            for path in all_timeline_figures(result, out_dir):
                console.print(f"wrote {path}")
        write_json(json_path, timeline_json(result))

    run_cli(debug, body)


def register(app: typer.Typer) -> None:
    app.command("timeline")(timeline)
