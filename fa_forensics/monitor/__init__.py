"""Cheap per-step attention statistics for the training monitor.

- `stats.head_statistics(q, k, ...)`: max logit, repeated-maximum rows, extra P̄ == 1 entries,
  mean top-1 probability per head, computed in row chunks (no whole T×T matrix).
- `p_one`: the exact thresholds that let the statistics count P̄ == 1 without a cast per score.
- `spectral.head_spectral_norms`: exact per-head ‖W_Q‖₂ (float64 Gram eigenvalue).
- `alarm.AlarmRule`: robust z-score rule over a trailing window that flags a step/layer/head.
"""
from fa_forensics.monitor.alarm import Alarm, AlarmRule  # noqa: F401
from fa_forensics.monitor.spectral import find_query_weights, head_spectral_norms  # noqa: F401
from fa_forensics.monitor.stats import HeadStats, head_statistics  # noqa: F401
from fa_forensics.monitor.collector import StepCollector  # noqa: F401,E402
