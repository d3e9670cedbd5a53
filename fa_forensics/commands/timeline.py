"""`fa-forensics timeline`: training-time figures from a dump's per-step statistics."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from fa_forensics.commands.common import DebugOpt, DumpArg, JsonOpt, OutOpt, console, ensure_out_dir, run_cli, write_json

WarmupOpt = Annotated[Optional[int], typer.Option(
    "--alarm-warmup", metavar="N",
    help="Monitored steps before the replayed alarm rule may fire (default: the capture's setting, else 50).")]
WindowOpt = Annotated[Optional[int], typer.Option(
    "--alarm-window", metavar="N",
    help="Trailing values of the rule's robust z-score (default: the capture's, else 20).")]
ZOpt = Annotated[Optional[float], typer.Option(
    "--alarm-z", metavar="Z", help="Robust z-score a value must exceed (default: the capture's, else 6).")]
TIMELINE_OPTION_OF = {"alarm_warmup": "--alarm-warmup", "alarm_window": "--alarm-window", "alarm_z": "--alarm-z"}


def recorded_rule_settings(dump) -> dict:
    """The alarm settings the capture ran with ({} when it recorded none)."""
    monitor = (dump.attrs.get("capture") or {}).get("monitor") or {}
    return monitor.get("alarm") or {}


def timeline(dump: DumpArg, out: OutOpt = None, json_path: JsonOpt = None, alarm_warmup: WarmupOpt = None,
             alarm_window: WindowOpt = None, alarm_z: ZOpt = None, debug: DebugOpt = False) -> None:
    """Loss, W_Q spectral norms, repeated maxima and max logits over the monitored steps (paper Fig. 2, 3, 11, 13),
    and the capture's alarm rule replayed over them."""

    def body() -> None:
        from fa_forensics.analyses.timeline.compute import (alarm_json, analyse_timeline, replay_alarm, timeline_json,
                                                    timeline_verdict)
        from fa_forensics.commands.capture import worded_settings
        from fa_forensics.dump import open_dump
        from fa_forensics.monitor.alarm import AlarmRule, check_settings

        with worded_settings(TIMELINE_OPTION_OF):
            check_settings(alarm_warmup, alarm_window, alarm_z)
        d = open_dump(dump)
        result = analyse_timeline(d.timeline, where=str(dump))
        recorded = recorded_rule_settings(d)
        rule = AlarmRule.with_settings(alarm_warmup if alarm_warmup is not None else recorded.get("warmup"),
                                       alarm_window if alarm_window is not None else recorded.get("window"),
                                       alarm_z if alarm_z is not None else recorded.get("z_threshold"))
        replay = replay_alarm(result, rule)
        verdict = timeline_verdict(result, replay)
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
            console.print(f"the capture's alarm fired at steps {list(result.alarm_steps)}")
        out_dir = ensure_out_dir(out)
        if out_dir is not None:
            from fa_forensics.analyses.timeline.figure import all_timeline_figures

            for path in all_timeline_figures(result, out_dir):
                console.print(f"wrote {path}")
        write_json(json_path, {**timeline_json(result), **alarm_json(replay), "verdict": verdict})
        console.print(f"[bold]verdict:[/] {verdict}", highlight=False, soft_wrap=True)

    run_cli(debug, body)


def register(app: typer.Typer) -> None:
    app.command("timeline")(timeline)
