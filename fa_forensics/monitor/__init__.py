"""Cheap per-step attention statistics for the training monitor, and the alarm that watches them.

- `stats.head_statistics(q, k, ...)`: max logit, repeated-maximum rows, extra P̄ == 1 entries,
  mean top-1 probability per head, computed in row chunks (no whole T×T matrix).
- `p_one`: the exact thresholds that let the statistics count P̄ == 1 without a cast per score.
- `spectral.head_spectral_norms`: exact per-head ‖W_Q‖₂ (float64 Gram eigenvalue; NaN/inf for
  non-finite weights, never an exception).
- `alarm.AlarmRule`: non-finite values, jumps (robust z-score over a trailing window) and trends
  (Mann–Kendall, Theil–Sen: `trend`) over the loss and the per-head leading indicators; its settings
  and their defaults in `alarm_settings.AlarmSettings`.
- `tensorboard.TimelineBoard`: the timeline as TensorBoard event files (the `tensorboard` extra).
"""
from typing import TYPE_CHECKING

from fa_forensics import lazy_exports

if TYPE_CHECKING:  # the same names, for readers of the source (type checkers, the API docs)
    from fa_forensics.monitor.alarm import Alarm, AlarmRule
    from fa_forensics.monitor.alarm_settings import AlarmSettings
    from fa_forensics.monitor.collector import StepCollector
    from fa_forensics.monitor.spectral import find_query_weights, head_spectral_norms
    from fa_forensics.monitor.stats import HeadStats, head_statistics

__all__ = ["Alarm", "AlarmRule", "AlarmSettings", "StepCollector", "find_query_weights", "head_spectral_norms",
           "HeadStats", "head_statistics"]

__getattr__ = lazy_exports(__name__, {
    "Alarm": "fa_forensics.monitor.alarm",
    "AlarmRule": "fa_forensics.monitor.alarm",
    "AlarmSettings": "fa_forensics.monitor.alarm_settings",
    "find_query_weights": "fa_forensics.monitor.spectral",
    "head_spectral_norms": "fa_forensics.monitor.spectral",
    "HeadStats": "fa_forensics.monitor.stats",
    "head_statistics": "fa_forensics.monitor.stats",
    "StepCollector": "fa_forensics.monitor.collector",
})
