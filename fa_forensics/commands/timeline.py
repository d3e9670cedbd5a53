"""The body of `fa-forensics timeline` (its options are registered in fa_forensics.analyses.registry):
training-time figures from a dump's per-step statistics."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from fa_forensics.commands.common import console, ensure_out_dir, open_rank, run_cli, write_json

TIMELINE_OPTION_OF = {"alarm_warmup": "--alarm-warmup", "alarm_window": "--alarm-window", "alarm_z": "--alarm-z"}


def recorded_rule_settings(dump) -> dict:
    """The alarm settings the capture ran with ({} when it recorded none)."""
    monitor = (dump.attrs.get("capture") or {}).get("monitor") or {}
    return monitor.get("alarm") or {}


def run(dump: Path, rank: Optional[int], out: Optional[Path], json_path: Optional[Path], alarm_warmup: Optional[int],
        alarm_window: Optional[int], alarm_z: Optional[float], debug: bool) -> None:
    """The `timeline` command (options: the registry's): the per-step statistics, their figures, the alarm rule."""

    def body() -> None:
        from fa_forensics.analyses.timeline.compute import (alarm_json, analyse_timeline, replay_alarm,
                                                            timeline_json, timeline_verdict)
        from fa_forensics.commands.capture import worded_settings
        from fa_forensics.monitor.alarm import AlarmRule, check_settings

        with worded_settings(TIMELINE_OPTION_OF):
            check_settings(alarm_warmup, alarm_window, alarm_z)
        d = open_rank(dump, rank)
        result = analyse_timeline(d.timeline, where=str(dump))
        recorded = recorded_rule_settings(d)
        rule = AlarmRule.with_settings(alarm_warmup if alarm_warmup is not None else recorded.get("warmup"),
                                       alarm_window if alarm_window is not None else recorded.get("window"),
                                       alarm_z if alarm_z is not None else recorded.get("z_threshold"))
        replay = replay_alarm(result, rule)
        verdict = timeline_verdict(result, replay)
        from fa_forensics.analyses.timeline.table import tables

        for table in tables(result, str(dump)):
            console.print(table)
        if result.ties_loss_spearman is not None:
            console.print(f"repeated maxima vs loss: Spearman ρ = {result.ties_loss_spearman:+.3f} (p = "
                          f"{result.ties_loss_p_value:.3g})")
        if result.top_wq_head is not None:
            console.print(f"largest W_Q spectral norm at the last step: layer {result.top_wq_head[0]} head "
                          f"{result.top_wq_head[1]}")
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

