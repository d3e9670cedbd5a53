"""The body of `fa-forensics timeline` (its options are registered in fa_forensics.analyses.registry):
training-time figures from a dump's per-step statistics, the alarms the capture recorded, the rule replayed."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from fa_forensics.commands.common import console, ensure_out_dir, open_rank, run_cli, write_json

TIMELINE_OPTION_OF = {"alarm_warmup": "--alarm-warmup", "alarm_window": "--alarm-window", "alarm_z": "--alarm-z",
                      "alarm_set": "--alarm-set"}


def run(dump: Path, rank: Optional[int], out: Optional[Path], json_path: Optional[Path],
        alarm_warmup: Optional[int], alarm_window: Optional[int], alarm_z: Optional[float],
        alarm_set: Optional[list[str]], tensorboard: Optional[Path], debug: bool) -> None:
    """The `timeline` command (options: the registry's): the per-step statistics, their figures, the alarms."""

    def body() -> None:
        from fa_forensics.analyses.timeline import compute
        from fa_forensics.analyses.timeline.table import tables
        from fa_forensics.commands.capture import worded_settings
        from fa_forensics.monitor.alarm_settings import check_settings

        with worded_settings(TIMELINE_OPTION_OF):
            check_settings(alarm_warmup, alarm_window, alarm_z, alarm_set)
        if tensorboard is not None:  # a missing extra is said before any work
            from fa_forensics.optional import require

            require("tensorboard", "timeline --tensorboard (TensorBoard event files of the monitor's timeline)")
        d = open_rank(dump, rank)
        with worded_settings(TIMELINE_OPTION_OF):
            result = compute.run(d, alarm_warmup=alarm_warmup, alarm_window=alarm_window, alarm_z=alarm_z,
                                 alarm_set=alarm_set)
        for table in tables(result):
            console.print(table)
        out_dir = ensure_out_dir(out)
        figures = []
        if out_dir is not None:
            from fa_forensics.analyses.timeline.figure import draw

            figures = [str(p) for p in draw(result, out_dir)]
            for path in figures:
                console.print(f"wrote {path}")
        if tensorboard is not None:
            from fa_forensics.monitor.tensorboard import write_timeline

            logdir = write_timeline(d.timeline, tensorboard, list(result.alarms))
            console.print(f"wrote TensorBoard event files into {logdir}")
        write_json(json_path, {**compute.payload(result), "figures": figures})
        console.print(f"[bold]verdict:[/] {result.verdict}", highlight=False, soft_wrap=True)

    run_cli(debug, body)
