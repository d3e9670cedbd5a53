"""Timeline: the training-time view of a monitored run (paper Fig. 2, 3, 11, 13).

Turns the `timeline/` arrays of a dump into a `TimelineResult`: the loss per monitored step,
the per-(layer, head) series, and the correlation between repeated-maximum counts and the
loss (Fig. 13's leading-indicator claim) with a permutation-free Spearman test.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import stats as sps

from fa_forensics.analyses.significance import ALPHA
from fa_forensics.errors import NoTimeline
from fa_forensics.monitor.stats import TIMELINE_METRICS


@dataclass(frozen=True)
class TimelineResult:
    """Series over monitored steps. `series[metric]` is (S, L, H); NaN where not measured."""

    steps: np.ndarray  # (S,)
    loss: np.ndarray  # (S,)
    series: Mapping[str, np.ndarray]
    n_layers: int
    n_heads: int
    # Leading indicator: Spearman ρ between the total repeated-maximum count and the loss
    ties_loss_spearman: Optional[float]
    ties_loss_p_value: Optional[float]
    # Which head has the largest final W_Q spectral norm (the paper's Fig. 3 picks head 8)
    top_wq_head: Optional[tuple[int, int]]
    # Steps at which the capture's alarm fired (timeline series `alarms` > 0); empty without --alarm
    alarm_steps: tuple[int, ...] = ()


def analyse_timeline(timeline: Optional[Mapping[str, np.ndarray]], where: str = "the dump") -> TimelineResult:
    """Build the result from the arrays read by `read_timeline` (raises NoTimeline, a DumpError, if none)."""
    if not timeline or "step" not in timeline or len(timeline["step"]) == 0:
        raise NoTimeline(f"{where} has no timeline; a capture with monitoring (monitor_every) records one")
    steps = np.asarray(timeline["step"])
    loss = np.asarray(timeline.get("loss", np.full(len(steps), np.nan)), dtype=np.float64)
    series = {m: np.asarray(timeline[m], dtype=np.float64) for m in TIMELINE_METRICS if m in timeline}
    shape = next(iter(series.values())).shape if series else (len(steps), 0, 0)
    ties = series.get("near_max_ties")
    rho = p = None
    if ties is not None:
        total = np.nansum(ties, axis=(1, 2))
        ok = np.isfinite(loss) & np.isfinite(ties).any(axis=(1, 2))  # a step without a ties row is unmeasured, not 0
        if ok.sum() >= 3 and np.ptp(total[ok]) > 0 and np.ptp(loss[ok]) > 0:
            res = sps.spearmanr(total[ok], loss[ok])
            rho, p = float(res.statistic), float(res.pvalue)
    top = None
    wq = series.get("wq_sigma")
    if wq is not None and np.isfinite(wq[-1]).any():
        flat = np.nanargmax(wq[-1])
        top = tuple(int(i) for i in np.unravel_index(flat, wq.shape[1:]))
    alarms = timeline.get("alarms")
    alarm_steps = () if alarms is None else tuple(int(s) for s, n in zip(steps, np.asarray(alarms)) if n > 0)
    return TimelineResult(steps=steps, loss=loss, series=series, n_layers=shape[1], n_heads=shape[2],
                          ties_loss_spearman=rho, ties_loss_p_value=p, top_wq_head=top, alarm_steps=alarm_steps)


def timeline_json(result: TimelineResult) -> dict:
    """The documented --json payload: steps[], loss[], series.<metric>[layer][head][step]."""
    return {
        "steps": result.steps.tolist(),
        "loss": result.loss.tolist(),
        "n_layers": result.n_layers,
        "n_heads": result.n_heads,
        "series": {m: np.transpose(a, (1, 2, 0)).tolist() for m, a in result.series.items()},
        "ties_loss_spearman": result.ties_loss_spearman,
        "ties_loss_p_value": result.ties_loss_p_value,
        "top_wq_head": list(result.top_wq_head) if result.top_wq_head else None,
        "alarm_steps": list(result.alarm_steps),
    }


@dataclass(frozen=True)
class AlarmReplay:
    """The alarm rule run over the recorded timeline (`monitor.alarm.replay_rule`)."""

    settings: dict  # warmup, window, min_history, z_threshold, min_change, persist
    alarms: tuple  # monitor.alarm.Alarm, in step order
    monitored_steps: int

    @property
    def warmup_covers_run(self) -> bool:
        return self.monitored_steps <= self.settings["warmup"]


def replay_alarm(result: TimelineResult, rule) -> AlarmReplay:
    """Feed the recorded series to `rule` (a fresh monitor.alarm.AlarmRule) as the capture would have."""
    from fa_forensics.monitor.alarm import replay_rule

    series = result.series
    alarms = replay_rule(rule, result.steps, result.loss, series.get("near_max_ties"), series.get("wq_sigma"))
    return AlarmReplay(settings=rule.settings(), alarms=tuple(alarms), monitored_steps=len(result.steps))


def timeline_verdict(result: TimelineResult, replay: AlarmReplay, alpha: float = ALPHA) -> str:
    """One sentence: does the alarm rule fire on this run (where, or why it cannot), and do repeated
    maxima track the loss (Spearman, at level alpha)."""
    s = replay.settings
    rule = f"warm-up {s['warmup']}, window {s['window']}, z > {s['z_threshold']:g}"
    n = replay.monitored_steps
    if replay.alarms:
        first = replay.alarms[0]
        where = "" if first.layer is None else f" layer {first.layer} head {first.head}"
        rest = replay.alarms[1:]
        more = f" (+{len(rest)} more, at steps {sorted({a.step for a in rest})})" if rest else ""
        text = (f"the alarm rule ({rule}) fires at step {first.step}{where}: {first.metric} = {first.value:.4g} "
                f"against a trailing median {first.baseline:.4g} (robust z = {first.z:.1f}){more}")
    elif replay.warmup_covers_run:
        text = (f"no alarm, and none was possible: the rule's warm-up ({s['warmup']} monitored steps) covers all {n} "
                f"monitored steps; give --alarm-warmup below {n} to watch this run")
    else:
        text = f"no alarm in {n} monitored steps under the rule ({rule})"
    rho, p = result.ties_loss_spearman, result.ties_loss_p_value
    if rho is None:
        corr = "too few measured steps (or a constant series) to relate repeated maxima to the loss"
    elif p < alpha:
        corr = f"repeated maxima track the loss (Spearman ρ = {rho:+.2f}, p = {p:.2g})"
    else:
        corr = f"repeated maxima do not track the loss significantly (Spearman ρ = {rho:+.2f}, p = {p:.2g} ≥ {alpha:g})"
    return f"{text}; {corr}"


def alarm_json(replay: AlarmReplay) -> dict:
    """The replayed rule for --json: its settings and the alarms it raises."""
    return {"alarm_rule": replay.settings,
            "rule_alarms": [{"step": a.step, "metric": a.metric, "layer": a.layer, "head": a.head, "value": a.value,
                             "baseline": a.baseline, "z": a.z} for a in replay.alarms]}
