"""The capture session's monitor: per-step statistics, the timeline row, the alarm and the ring.

Every `every`-th step (step % every == 0) is monitored: each attention call of the recorded forward
pass feeds a `StepCollector` (per-head statistics on the batch slice, W_Q spectral norms), and when
the step ends ONE timeline row waits for its loss (given by `cap.step(loss)`, else the loss tap's
sum) and is then written. Each row feeds the alarm rule; the row records the alarms it raised (the
`alarm_<metric>` series, monitor/alarm.py), so what `timeline` and the report show is what the
capture decided. With `tensorboard` the row also goes to TensorBoard event files.

Episodes: the alarms of one unstable stretch form one episode. The first alarm opens it: ONE line on
stderr, the next `alarm_steps` steps asked for in full and the ring's steps (monitored steps not
written, the last `ring` of them, held in host memory) written through the session's store. Later
alarms join it (recorded in their rows, no line, no new recording) until `episode_gap` monitored steps
pass without one. A step announced as recorded that the writer has no room for is dropped, and its drop
is written into the store (`capture.monitor.dropped_steps`: step, reason, episode), with at most one
line per episode on stderr. `monitor.episodes` and `qk_norm` (per layer: its attention normalizes q and
k, so W_Q's norm does not reach the logits) are kept beside it.

Output logits: the loss tap hands the logits of `F.cross_entropy` on a monitored step; their mean
log-sum-exp is the row's `output_lse` (one scalar per step, NaN when no cross-entropy was seen).

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

import numpy as np
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
        self.output_lse: Optional[torch.Tensor] = None  # sum of the step's mean log-sum-exps (no synchronization)
        self.output_lse_calls = 0
        self.row_output_lse: Optional[tuple[torch.Tensor, int]] = None  # the waiting row's
        self.episodes: list[dict] = []  # {"first_alarm", "last_alarm", "alarms", "recorded", "ring"}
        self.dropped_steps: list[dict] = []  # {"step", "reason", "episode", "mb"}
        self.qk_norm: list = []  # per layer: True/False, None where unknown
        self.extra_attrs: dict = {}  # set by the session: attributes of its own kept beside the monitor's
        self.episode_gap = int(self.rule.config.episode_gap) if self.rule is not None else 0
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
            "qk_norm": self.qk_norm, "episodes": self.episodes, "dropped_steps": self.dropped_steps,
        }

    # -- step events -------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Decide whether the step that starts now is monitored."""
        self.hot = step % self.every == 0
        self.reported_loss = None
        self.output_lse, self.output_lse_calls = None, 0
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

    def add_output_logits(self, logits: torch.Tensor) -> None:
        """Add the mean log-sum-exp of a cross-entropy's logits to the step's (no synchronization)."""
        from fa_forensics.capture.loss_tap import mean_lse

        try:
            value = mean_lse(logits)
        except Exception as exc:  # the monitor never stops training
            self._failed(exc, "the output logits")
            return
        if value is not None:
            self.output_lse = value if self.output_lse is None else self.output_lse + value
            self.output_lse_calls += 1

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
            self.row_output_lse = (self.output_lse, self.output_lse_calls) if self.output_lse is not None else None
            self.output_lse, self.output_lse_calls = None, 0
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
        lse, self.row_output_lse = self.row_output_lse, None
        series = {**series, "output_lse": float("nan") if lse is None else float(lse[0]) / lse[1]}
        self._note_qk_norm()
        alarms, codes = self._judge(row.step, loss, series)
        writer.put_timeline(row.step, loss=float("nan") if loss is None else loss, alarms=len(alarms), **series,
                            **codes)
        self.monitored_steps.append(row.step)
        if self.board is not None:
            try:
                self.board.write_row(row.step, loss, {m: v for m, v in series.items() if m != "output_lse"},
                                     tuple(a.message() for a in alarms))
            except Exception as exc:
                self._failed(exc, f"the TensorBoard row of step {row.step}")
        if alarms:
            self._raise_alarm(row.step, alarms, writer, write_held)

    def _judge(self, step: int, loss: Optional[float], series: dict) -> tuple[list, dict]:
        """The alarms the rule raises on this row, and their codes as the row records them ({} without a rule)."""
        if self.rule is None:
            return [], {}
        from fa_forensics.monitor.alarm import ALARMED, alarm_codes

        shapes = {m: (() if m == "loss" else np.shape(series[m])) for m in ALARMED if m == "loss" or m in series}
        try:
            alarms = self.rule.observe(step, loss=loss, qk_norm=self.qk_norm,
                                       **{m: series[m] for m in ALARMED if m in series})
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
    def _note_qk_norm(self) -> None:
        """The per-layer qk-norm facts the collector found (once per layer)."""
        found = self.collector.qk_norm if self.collector is not None else {}
        if found and len(found) != len(self.qk_norm):
            self.qk_norm = [found.get(layer) for layer in range(max(found) + 1)]

    def _open_episode(self, step: int) -> Optional[dict]:
        """The episode an alarm at `step` belongs to, if one is open (its last alarm within `episode_gap`
        monitored steps)."""
        if not self.episodes:
            return None
        last = self.episodes[-1]
        return last if step - last["last_alarm"] <= self.episode_gap * self.every else None

    def _raise_alarm(self, step: int, alarms: list, writer: BackgroundWriter, write_held: WriteHeld) -> None:
        """A new episode: one AlarmWarning (one line), the next alarm_steps steps asked for, the ring's steps
        written. An alarm within an open episode joins it: no line, no new recording."""
        self.alarms.extend(alarms)
        episode = self._open_episode(step)
        if episode is not None:
            episode["last_alarm"], episode["alarms"] = step, episode["alarms"] + len(alarms)
            return
        follow = list(range(step + 1, step + 1 + self.alarm_steps))
        episode = {"first_alarm": step, "last_alarm": step, "alarms": len(alarms), "recorded": follow, "ring": []}
        self.episodes.append(episode)
        self.extra_steps.update(follow)
        written = [held.step for held in (self.ring.drain() if self.ring is not None else []) if write_held(held, step)]
        episode["ring"] = written
        writer.put_run_attrs({"capture": {"monitor": self.store_attrs()}})
        writer.flush_timeline()  # the alarm's row (and those before it) on disk now
        if self.board is not None:
            self.board.flush()
        from fa_forensics.monitor.alarm import lead

        more = f" (+{len(alarms) - 1} more)" if len(alarms) > 1 else ""
        what = (f"recording {_steps(follow)} in full" if self.alarm_steps > 0
                else "no steps after it recorded (alarm_steps = 0)")
        if written:
            what += f", and {_steps(written)} from the ring"
        what += f"; later alarms within {self.episode_gap} monitored steps join this episode"
        warnings.warn(AlarmWarning(f"{lead(alarms).message()}{more}; {what}"), stacklevel=2)

    def store_attrs(self) -> dict:
        """The monitor's attributes as the store keeps them (`capture.monitor`), facts of the run included."""
        return {**self.attrs(), **self.extra_attrs}

    def note_dropped(self, step: int, reason: str, nbytes: int, writer: BackgroundWriter) -> Optional[int]:
        """A step an alarm announced (after it, or from the ring) found no room: written into the store's monitor
        attributes; the episode it belongs to, or None. Returns the episode's first alarm step when this is its
        first drop (the caller says it once)."""
        episode = self.episodes[-1] if self.episodes else None
        first = episode is not None and not any(d["episode"] == episode["first_alarm"] for d in self.dropped_steps)
        self.dropped_steps.append({"step": int(step), "reason": reason, "mb": round(nbytes / 2 ** 20, 2),
                                   "episode": None if episode is None else episode["first_alarm"]})
        writer.put_run_attrs({"capture": {"monitor": self.store_attrs()}})
        return episode["first_alarm"] if first and episode is not None else None


def _steps(steps: list[int]) -> str:
    """'step 5', 'steps 5..8' for consecutive steps, else 'steps 5, 7, 9'."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}..{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))
