"""The capture session's monitor: per-step statistics, the timeline row, the alarm and the ring.

Every `every`-th step (step % every == 0) is monitored: each attention call of the recorded forward
pass feeds a `StepCollector` (per-head statistics on the batch slice, W_Q spectral norms), and when
the step ends ONE timeline row waits for its loss (given by `cap.step(loss)`, else the loss tap's
sum) and is then written. Each row feeds the alarm rule; the row records the alarms it raised (the
`alarm_<metric>` series, monitor/alarm.py), so what `timeline` and the report show is what the
capture decided. An alarm asks the session to record the next `alarm_steps` steps in full and writes
the ring's steps (monitored steps not written, the last `ring` of them, held in host memory) through
the session's store. With `tensorboard` the row also goes to TensorBoard event files.

The monitor never stops training: NaN, infinite or huge inputs give NaN/inf statistics (recorded,
and alarmed on at once), and anything the monitor's own computation raises becomes one warning and a
NaN in the row, never an exception in the training loop.

The session owns the hooks and the step boundaries and tells the monitor about them:
`begin_step`, `observe`, `add_tapped_loss`, `end_step`, `flush_row`, `close`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch

from fa_forensics.capture.events import AlarmWarning, AttentionCall, TimelineRow
from fa_forensics.capture.ring import RingStep, StepRing

if TYPE_CHECKING:
    from fa_forensics.capture.settings import CaptureSettings
    from fa_forensics.capture.writer import BackgroundWriter
    from fa_forensics.monitor.collector import StepCollector
    from fa_forensics.monitor.tensorboard import TimelineBoard

# (held ring step, the alarm's step) -> whether the step was written (False: it is recorded already)
WriteHeld = Callable[[RingStep, int], bool]


class StepMonitor:
    """Monitor, alarm and ring of one capture session (see the module docstring)."""

    def __init__(self, settings: CaptureSettings):
        if settings.monitor_every is None:
            raise ValueError("a StepMonitor needs settings with monitor_every (the session makes one only then)")
        self.every = int(settings.monitor_every)
        self.eps = settings.monitor_eps
        self.alarm_steps = settings.alarm_steps
        self.rule = settings.alarm_rule()  # None without an alarm
        self.tensorboard = settings.monitor_tensorboard
        self.board: Optional[TimelineBoard] = None  # from `start` on, with `tensorboard`
        self.ring: Optional[StepRing] = StepRing(settings.ring) if settings.ring else None
        self.collector: Optional[StepCollector] = None  # from `start` on
        self.hot = False  # the current step is monitored
        self.ring_step: Optional[RingStep] = None  # the current step's arrays, held for the ring
        self.reported_loss: Optional[float] = None  # cap.step(loss) before the boundary
        self.tapped_loss: Optional[torch.Tensor] = None  # sum of the scalars backward() was called on
        self.row: Optional[TimelineRow] = None  # the ended monitored step's row awaiting its loss
        self.extra_steps: set[int] = set()  # steps an alarm asked for
        self.alarms: list = []  # every Alarm raised
        self.monitored_steps: list[int] = []
        self.warn: Callable[[str, str], None] = lambda key, message: None  # set by `start`

    def start(self, warn: Callable[[str, str], None]) -> None:
        """Start the statistics' background worker (and the TensorBoard writer); warn(key, message) reports once
        per key."""
        from fa_forensics.monitor.collector import StepCollector

        self.warn = warn
        if self.tensorboard is not None:
            from fa_forensics.monitor.tensorboard import TimelineBoard

            self.board = TimelineBoard(self.tensorboard)
        self.collector = StepCollector(eps=self.eps, warn=warn, background=True)

    def attrs(self) -> dict:
        """The monitor's settings, as the store's capture attributes keep them."""
        rule = self.rule
        return {
            "every": self.every, "eps": self.eps,
            "alarm": None if rule is None else rule.settings(),
            "alarm_steps": self.alarm_steps, "ring": 0 if self.ring is None else self.ring.capacity,
            "tensorboard": self.tensorboard,
        }

    # -- step events -------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Decide whether the step that starts now is monitored."""
        self.hot = step % self.every == 0
        self.reported_loss = None
        if self.hot:
            self._started().begin(step)

    def ring_step_for(self, step: int) -> RingStep:
        """The ring entry collecting the arrays of `step` (made at its first array)."""
        if self.ring_step is None:
            self.ring_step = RingStep(step)
        return self.ring_step

    def observe(self, call: AttentionCall, batch: Optional[slice], module_name: str,
                module: Optional[torch.nn.Module]) -> None:
        """Feed one attention call of a monitored step to the statistics (on the capture's batch slice)."""
        if call.q.dim() != 4:
            return
        from fa_forensics.monitor.collector import p_bar_dtype

        try:
            q, k = (call.q, call.k) if batch is None else (call.q[batch], call.k[batch])
            self._started().observe_call(call.layer, q, k, scale=call.scale, causal=call.causal,
                                        p_dtype=p_bar_dtype(call.kernel_dtype), score_dtype=call.score_dtype,
                                        module=module, module_name=module_name)
        except Exception as exc:  # the monitor never stops training
            self._failed(exc, f"attention call {call.layer} of step {call.step}")

    def add_tapped_loss(self, value: torch.Tensor) -> None:
        """Add a scalar backward() was called on to the step's loss (no synchronization)."""
        self.tapped_loss = value if self.tapped_loss is None else self.tapped_loss + value

    def take_tapped_loss(self) -> Optional[torch.Tensor]:
        """The step's tapped loss, handed over at its end."""
        tapped, self.tapped_loss = self.tapped_loss, None
        return tapped

    def end_step(self, step: int, loss: Optional[float], tapped: Optional[torch.Tensor]) -> None:
        """The monitored step ended: its ring entry is pushed and its row waits for its loss."""
        if self.hot:
            given = loss if loss is not None else self.reported_loss
            if self.ring_step is not None and self.ring is not None:  # a ring step is only asked for with a ring
                self.ring_step.loss = given
                self.ring.push(self.ring_step)
            self.row = TimelineRow(step, self._started().finish(), given, tapped)
        self.ring_step = None

    def flush_row(self, loss: Optional[float], writer: BackgroundWriter, write_held: WriteHeld,
                  warn: Callable[[str, str], None]) -> None:
        """Write the waiting row, if any (its loss: given now, else reported, else tapped), and run the alarm rule."""
        row, self.row = self.row, None
        if row is None:
            return
        series = row.series
        if loss is None:
            loss = row.given_loss
        if loss is None and row.tapped_loss is not None:
            loss = float(row.tapped_loss)  # the one read of the tapped scalar (a device sync on GPU)
        ring_last = self.ring.last() if self.ring is not None else None
        if ring_last is not None and ring_last.step == row.step:
            ring_last.loss = loss
        if series is None:
            warn("monitor-empty", f"fa-forensics monitor: step {row.step} was monitored but no attention call was seen "
                                  "(with gradients enabled); its timeline row holds only the loss")
            series = {}
        alarms, codes = self._judge(row.step, loss, series)
        writer.put_timeline(row.step, loss=float("nan") if loss is None else loss, alarms=len(alarms), **series,
                            **codes)
        self.monitored_steps.append(row.step)
        if self.board is not None:
            try:
                self.board.write_row(row.step, loss, series, tuple(a.message() for a in alarms))
            except Exception as exc:
                self._failed(exc, f"the TensorBoard row of step {row.step}")
        if alarms:
            self._raise_alarm(row.step, alarms, writer, write_held)

    def _judge(self, step: int, loss: Optional[float], series: dict) -> tuple[list, dict]:
        """The alarms the rule raises on this row, and their codes as the row records them ({} without a rule)."""
        if self.rule is None:
            return [], {}
        from fa_forensics.monitor.alarm import alarm_codes
        from fa_forensics.monitor.alarm_settings import WATCHED

        shapes = {m: (() if m == "loss" else series[m].shape) for m in WATCHED if m == "loss" or m in series}
        try:
            alarms = self.rule.observe(step, loss=loss, **{m: series[m] for m in WATCHED if m in series})
        except Exception as exc:  # the monitor never stops training
            self._failed(exc, f"the alarm rule at step {step}")
            alarms = []
        return alarms, alarm_codes(alarms, shapes)

    def _failed(self, exc: Exception, what: str) -> None:
        self.warn(f"monitor-failed:{type(exc).__name__}",
                  f"fa-forensics monitor: {what} could not be monitored ({type(exc).__name__}: {exc}); its "
                  "statistics are NaN and training goes on")

    def _started(self) -> StepCollector:
        """The statistics' collector (made by `start`)."""
        if self.collector is None:
            raise RuntimeError("the monitor was not started (StepMonitor.start)")
        return self.collector

    def close(self) -> None:
        self.ring_step = None
        self.hot = False
        if self.collector is not None:
            self.collector.close()
        if self.board is not None:
            self.board.close()

    # -- alarm -------------------------------------------------------------------------------
    def _raise_alarm(self, step: int, alarms: list, writer: BackgroundWriter, write_held: WriteHeld) -> None:
        """One AlarmWarning (one line); the next alarm_steps steps are asked for; the ring's steps are written."""
        self.alarms.extend(alarms)
        follow = range(step + 1, step + 1 + self.alarm_steps)
        self.extra_steps.update(follow)
        written = [held.step for held in (self.ring.drain() if self.ring is not None else []) if write_held(held, step)]
        writer.flush_timeline()  # the alarm's row (and those before it) on disk now
        if self.board is not None:
            self.board.flush()
        from fa_forensics.monitor.alarm import lead

        more = f" (+{len(alarms) - 1} more)" if len(alarms) > 1 else ""
        what = (f"recording {_steps(list(follow))} in full" if self.alarm_steps > 0
                else "no steps after it recorded (alarm_steps = 0)")
        if written:
            what += f", and {_steps(written)} from the ring"
        warnings.warn(AlarmWarning(f"{lead(alarms).message()}{more}; {what}"), stacklevel=2)


def _steps(steps: list[int]) -> str:
    """'step 5', 'steps 5..8' for consecutive steps, else 'steps 5, 7, 9'."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}..{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))
