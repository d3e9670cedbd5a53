"""The monitor's timeline as TensorBoard scalars, beside the loss in the dashboard a run already has.

`capture --monitor-tensorboard DIR` (library `monitor_tensorboard=DIR`) writes one event file into DIR
while training, through torch.utils.tensorboard (the `tensorboard` extra); `timeline DUMP --tensorboard
DIR` writes a recorded timeline the same way. Point TensorBoard at DIR, or at the folder holding the
run's own log folders with DIR beside them (`--logdir runs/` with `runs/fa-forensics/`).

Tags (TensorBoard groups a tag by its first path element):
  fa-forensics/loss                 the loss of the monitored step
  fa-forensics/alarms               alarms raised at the step (0 when none); each alarm's line as text
                                    under fa-forensics/alarm
  <metric>/layer_<l>                per layer: the largest value over heads (max_logit, top1_prob,
                                    wq_sigma) or the sum over heads (near_max_ties, p_one_extra)
  <metric>/layer_<l>/head_<h>       per head
Values are written as they are: a NaN or infinite statistic appears as such in the dashboard.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import numpy as np

from fa_forensics.optional import require

SUMMED = ("near_max_ties", "p_one_extra")  # counts: a layer's value is the sum over its heads
BOARD_METRICS = ("max_logit", "top1_prob", "near_max_ties", "p_one_extra", "wq_sigma")


class TimelineBoard:
    """One TensorBoard event file of timeline rows; `write_row` per monitored step, `close` at the end."""

    def __init__(self, logdir, needed_for: str = "--monitor-tensorboard"):
        require("tensorboard", f"{needed_for} (TensorBoard event files of the monitor's timeline)")
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir))

    def write_row(self, step: int, loss: Optional[float], series: Mapping[str, np.ndarray],
                  alarm_lines: tuple[str, ...] = ()) -> None:
        """One monitored step: its loss, each metric per layer and per head, its alarms."""
        w = self._writer
        if loss is not None:
            w.add_scalar("fa-forensics/loss", float(loss), step)
        for metric in BOARD_METRICS:
            table = series.get(metric)
            if table is None:
                continue
            table = np.asarray(table, dtype=np.float64)  # (L, H)
            with warnings.catch_warnings():  # a layer with no measured head is NaN, written as such
                warnings.simplefilter("ignore", RuntimeWarning)
                per_layer = np.nansum(table, axis=1) if metric in SUMMED else np.nanmax(table, axis=1)
            for layer in range(table.shape[0]):
                w.add_scalar(f"{metric}/layer_{layer}", float(per_layer[layer]), step)
                for head in range(table.shape[1]):
                    w.add_scalar(f"{metric}/layer_{layer}/head_{head}", float(table[layer, head]), step)
        w.add_scalar("fa-forensics/alarms", float(len(alarm_lines)), step)
        for line in alarm_lines:
            w.add_text("fa-forensics/alarm", line, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def write_timeline(timeline: Mapping[str, np.ndarray], logdir, alarms: list[dict]) -> Path:
    """A recorded timeline (arrays as `Dump.timeline` reads them) into TensorBoard event files in `logdir`;
    `alarms`: its alarm records (monitor.alarm.recorded_alarms), written as text at their steps."""
    from fa_forensics.monitor.alarm import describe

    board = TimelineBoard(logdir, needed_for="timeline --tensorboard")
    steps = np.asarray(timeline["step"])
    loss = timeline.get("loss")
    lines: dict[int, list[str]] = {}
    for record in alarms:
        lines.setdefault(record["step"], []).append(describe(record))
    known = loss is not None and bool(np.isfinite(loss).any())  # as the capture wrote it: NaN once a loss was known
    try:
        for i, step in enumerate(steps):
            value = float(loss[i]) if known else None
            board.write_row(int(step), value, {m: timeline[m][i] for m in BOARD_METRICS if m in timeline},
                            tuple(lines.get(int(step), ())))
    finally:
        board.close()
    return board.logdir
