"""The early-warning rule of the training monitor.

Rule (documented in docs/monitor.md): for each watched series — per (layer, head) the count of
rows with a repeated maximum (`near_max_ties`) and the W_Q spectral norm (`wq_sigma`), and the
loss — keep a trailing window of the last `window` monitored values. A new value is "out" when
its robust z-score

    z = (x − median(window)) / (1.4826 · MAD(window) + floor)

exceeds `z_threshold` and it has moved up by more than `min_change` (relative to the median for
the spectral norm and the loss, absolute rows for tie counts), once at least `min_history`
values are in the window. The floor keeps a perfectly flat history from turning noise into
alarms. A series raises ONE alarm when it has been out for `persist` consecutive monitored steps
(default 3 for tie counts and W_Q, 1 for the loss: a single batch with repeated text gives a
one-step burst of ties, a real drift stays); it can alarm again only after it has come back.
Only upward moves alarm: more tied maxima, a growing W_Q norm, a loss spike.

No alarm is raised during the first `warmup` monitored steps (their values still fill the
windows): early training moves every series fast (learning-rate warmup, W_Q growing from its
initialization, ties collapsing as scores leave 0). A run with no more monitored steps than
`warmup` can therefore never alarm: a short run needs a short warm-up (`capture --alarm-warmup`).
`warmup`, `window` and `z_threshold` are settings of the capture and of `timeline` (which replays
the rule over a recorded timeline, `replay_rule`); `AlarmRule.with_settings` checks them.

Defaults (window 20, min_history 8, warmup 50, z 6, min_change ties +8 rows / W_Q +25 % /
loss +25 %, persist 3 / 3 / 1) were chosen on the demo run (300 steps, 4 × 4 heads): they raise
no alarm there, while a planted tie drift or loss spike alarms within `persist` steps
(tests/cli/test_monitor_cli.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fa_forensics.errors import InvalidSetting

DEFAULT_WARMUP = 50
DEFAULT_WINDOW = 20
DEFAULT_Z = 6.0
MIN_WINDOW = 3  # a median and a MAD need a few values


@dataclass(frozen=True)
class Alarm:
    """One alarm: which step, where (layer/head; None for the loss), which metric, how far out."""

    step: int
    metric: str
    value: float
    baseline: float
    z: float
    layer: Optional[int] = None
    head: Optional[int] = None

    def message(self) -> str:
        where = "" if self.layer is None else f" layer {self.layer} head {self.head}"
        return (f"fa-forensics alarm: step {self.step}{where}: {self.metric} = {self.value:.4g} "
                f"(trailing median {self.baseline:.4g}, robust z = {self.z:.1f})")


_RELATIVE = {"wq_sigma": True, "loss": True, "near_max_ties": False}


@dataclass
class AlarmRule:
    """Robust z-score rule over a trailing window; call `observe` once per monitored step."""

    window: int = DEFAULT_WINDOW
    min_history: int = 8
    warmup: int = DEFAULT_WARMUP  # monitored steps observed before any alarm (learning-rate warmup moves everything)
    z_threshold: float = DEFAULT_Z
    min_change: dict = field(default_factory=lambda: {"near_max_ties": 8.0, "wq_sigma": 0.25, "loss": 0.25})
    persist: dict = field(default_factory=lambda: {"near_max_ties": 3, "wq_sigma": 3, "loss": 1})
    _history: dict = field(default_factory=dict, repr=False)
    _streak: dict = field(default_factory=dict, repr=False)
    _observed: int = field(default=0, repr=False)

    @classmethod
    def with_settings(cls, warmup: Optional[int] = None, window: Optional[int] = None,
                      z_threshold: Optional[float] = None) -> AlarmRule:
        """The rule with the given settings (None: the default), checked: InvalidSetting (setting
        "alarm_warmup", "alarm_window" or "alarm_z") for a value that cannot work. The history a
        value needs is min(8, window), so a short window can alarm too."""
        check_settings(warmup, window, z_threshold)
        rule = cls()
        if warmup is not None:
            rule.warmup = int(warmup)
        if window is not None:
            rule.window = int(window)
            rule.min_history = min(rule.min_history, rule.window)
        if z_threshold is not None:
            rule.z_threshold = float(z_threshold)
        return rule

    def settings(self) -> dict:
        """The settings a capture records and `timeline` reads back."""
        return {"warmup": self.warmup, "window": self.window, "min_history": self.min_history,
                "z_threshold": self.z_threshold, "min_change": dict(self.min_change), "persist": dict(self.persist)}

    def _check(self, key: tuple, metric: str, step: int, value: float, layer=None, head=None) -> Optional[Alarm]:
        out = self._out(key, metric, step, value, layer, head)
        if self._observed <= self.warmup:
            out = None
        streak = self._streak.get(key, 0) + 1 if out is not None else 0
        self._streak[key] = streak
        return out if streak == self.persist.get(metric, 1) else None  # once per excursion

    def _out(self, key: tuple, metric: str, step: int, value: float, layer=None, head=None) -> Optional[Alarm]:
        """The alarm this value would raise on its own (None if it is within the trailing window's range)."""
        hist = self._history.setdefault(key, deque(maxlen=self.window))
        alarm = None
        if np.isfinite(value) and len(hist) >= self.min_history:
            arr = np.asarray(hist, dtype=np.float64)
            med = float(np.median(arr))
            mad = float(np.median(np.abs(arr - med)))
            floor = max(abs(med) * 1e-3, 1e-6) if _RELATIVE[metric] else 0.5
            z = (value - med) / (1.4826 * mad + floor)
            change = (value - med) / abs(med) if _RELATIVE[metric] and med != 0 else value - med
            if z > self.z_threshold and change > self.min_change[metric]:
                alarm = Alarm(step=step, metric=metric, value=float(value), baseline=med, z=float(z), layer=layer,
                              head=head)
        if np.isfinite(value):
            hist.append(float(value))
        return alarm

    def observe(self, step: int, loss: Optional[float] = None, near_max_ties=None, wq_sigma=None) -> list[Alarm]:
        """Feed one step's statistics; return the alarms it raises.

        near_max_ties, wq_sigma: array-likes of shape (L, H) (NaN where unknown) or None.
        """
        self._observed += 1
        alarms = []
        if loss is not None:
            a = self._check(("loss",), "loss", step, float(loss))
            if a:
                alarms.append(a)
        for metric, table in (("near_max_ties", near_max_ties), ("wq_sigma", wq_sigma)):
            if table is None:
                continue
            table = np.asarray(table, dtype=np.float64)
            for layer in range(table.shape[0]):
                for head in range(table.shape[1]):
                    a = self._check((metric, layer, head), metric, step, table[layer, head], layer, head)
                    if a:
                        alarms.append(a)
        return alarms


def check_settings(warmup=None, window=None, z_threshold=None) -> None:
    """InvalidSetting for an alarm setting out of its domain (None = the default, always fine)."""
    if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
        raise InvalidSetting("alarm_warmup", f"must be a whole number of monitored steps >= 0, got {warmup!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < MIN_WINDOW):
        raise InvalidSetting("alarm_window", f"must be a whole number of monitored steps >= {MIN_WINDOW}, "
                                             f"got {window!r}")
    number = isinstance(z_threshold, (int, float)) and not isinstance(z_threshold, bool)
    if z_threshold is not None and not (number and np.isfinite(z_threshold) and z_threshold > 0):
        raise InvalidSetting("alarm_z", f"must be a finite robust z-score > 0 (default {DEFAULT_Z:g}), "
                                        f"got {z_threshold!r}")


def rule_from_settings(settings) -> Optional[AlarmRule]:
    """The rule a capture's `alarm` setting asks for: False/None = no alarm, True = the defaults,
    a dict {warmup, window, z_threshold} = those settings (checked), an AlarmRule = itself."""
    if isinstance(settings, AlarmRule):
        return settings
    if not settings:
        return None
    if settings is True:
        return AlarmRule()
    return AlarmRule.with_settings(settings.get("warmup"), settings.get("window"), settings.get("z_threshold"))


def replay_rule(rule: AlarmRule, steps, loss=None, near_max_ties=None, wq_sigma=None) -> list[Alarm]:
    """The alarms `rule` raises over a recorded timeline: steps (S,), loss (S,), near_max_ties and
    wq_sigma (S, L, H) or None, fed one monitored step at a time as the capture fed them."""
    alarms: list[Alarm] = []
    for i, step in enumerate(steps):
        loss_i = None if loss is None or not np.isfinite(loss[i]) else float(loss[i])
        alarms += rule.observe(int(step), loss=loss_i,
                               near_max_ties=None if near_max_ties is None else near_max_ties[i],
                               wq_sigma=None if wq_sigma is None else wq_sigma[i])
    return alarms
