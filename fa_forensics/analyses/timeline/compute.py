"""Timeline: the training-time view of a monitored run (paper Fig. 2, 3, 11, 13).

Turns the `timeline/` arrays of a dump into a `TimelineResult`: the loss per monitored step, the
per-(layer, head) series, the correlation between repeated-maximum counts and the loss (Fig. 13's
leading-indicator claim) with a permutation-free Spearman test, the alarms the capture recorded
(what it decided, read back, never re-derived: monitor.alarm.recorded_alarms), and the alarm rule
replayed over the series (the capture's settings unless others are given: a what-if).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from scipy import stats as sps

from fa_forensics.analyses.significance import ALPHA
from fa_forensics.errors import NoTimeline
from fa_forensics.monitor.alarm import ALARMED, WATCHED, alarm_series, describe, readable, recorded_alarms
from fa_forensics.monitor.drops import dropped_steps, dropped_text
from fa_forensics.monitor.stats import TIMELINE_METRICS


@dataclass(frozen=True)
class AlarmReplay:
    """The alarm rule run over the recorded timeline (`monitor.alarm.replay_rule`)."""

    settings: dict  # as AlarmSettings.to_dict()
    alarms: tuple  # monitor.alarm.Alarm, in step order
    monitored_steps: int

    @property
    def warmup_covers_run(self) -> bool:
        return self.monitored_steps <= self.settings["warmup"]


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
    # The alarms the capture recorded: {step, metric, layer, head, value, rule}, in monitor.alarm.lead order
    alarms: tuple[dict, ...] = ()
    capture_rule: Optional[dict] = None  # the settings the capture's alarm ran with (None: run without --alarm)
    replay: Optional[AlarmReplay] = None
    verdict: str = ""
    warnings: tuple[str, ...] = field(default=())
    output_lse: Optional[np.ndarray] = None  # (S,) mean log-sum-exp of the output logits; None: not recorded
    qk_norm: tuple = ()  # per layer: its attention normalizes q and k (W_Q's norm is not watched there)
    dropped: tuple[dict, ...] = ()  # steps an alarm announced that the capture dropped: {step, reason, episode}


def analyse_timeline(timeline: Optional[Mapping[str, np.ndarray]], where: str = "the dump",
                     capture_rule: Optional[dict] = None, monitor_attrs: Optional[Mapping] = None) -> TimelineResult:
    """Build the result from the arrays read by `Dump.timeline` (raises NoTimeline, a DumpError, if none).
    `capture_rule`: the alarm settings the capture recorded (None: it ran without an alarm)."""
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
        flat = np.nanargmax(np.where(np.isnan(wq[-1]), -np.inf, wq[-1]))
        top = tuple(int(i) for i in np.unravel_index(flat, wq.shape[1:]))
    counts = timeline.get("alarms")
    alarm_steps = () if counts is None else tuple(int(s) for s, n in zip(steps, np.asarray(counts)) if n > 0)
    watched = any(alarm_series(m) in timeline for m in WATCHED)
    monitor_attrs = monitor_attrs or {}
    lse = timeline.get("output_lse")
    return TimelineResult(steps=steps, loss=loss, series=series, n_layers=shape[1], n_heads=shape[2],
                          ties_loss_spearman=rho, ties_loss_p_value=p, top_wq_head=top, alarm_steps=alarm_steps,
                          alarms=tuple(recorded_alarms(timeline)),
                          capture_rule=capture_rule if capture_rule is not None else ({} if watched else None),
                          output_lse=None if lse is None else np.asarray(lse, dtype=np.float64),
                          qk_norm=tuple(monitor_attrs.get("qk_norm") or ()),
                          dropped=tuple(dropped_steps({"capture": {"monitor": monitor_attrs}})))


def replay_alarm(result: TimelineResult, rule) -> AlarmReplay:
    """Feed the recorded series to `rule` (a fresh monitor.alarm.AlarmRule) as the capture would have."""
    from fa_forensics.monitor.alarm import replay_rule

    series = {m: result.series.get(m) for m in ALARMED if m not in ("loss", "output_lse")}
    alarms = replay_rule(rule, result.steps, result.loss, qk_norm=result.qk_norm, output_lse=result.output_lse,
                         **series)
    return AlarmReplay(settings=rule.settings(), alarms=tuple(alarms), monitored_steps=len(result.steps))


def run(dump, selections=None, *, alarm_warmup: Optional[int] = None, alarm_window: Optional[int] = None,
        alarm_z: Optional[float] = None, alarm_set: Optional[list[str]] = None) -> TimelineResult:
    """The timeline of `dump` (the report's section and the `timeline` command): its series, the alarms the
    capture recorded, the rule replayed (the capture's settings, changed by the given ones) and the verdict."""
    from dataclasses import replace

    from fa_forensics.monitor.alarm import AlarmRule
    from fa_forensics.monitor.alarm_settings import AlarmSettings, parse_assignments

    recorded = recorded_rule_settings(dump)
    monitor = (dump.attrs.get("capture") or {}).get("monitor") or {}
    result = analyse_timeline(dump.timeline, where=str(dump.path), capture_rule=recorded or None,
                              monitor_attrs=monitor)
    base = AlarmSettings.from_dict(recorded)
    rule = AlarmRule(base.with_overrides({"warmup": alarm_warmup, "window": alarm_window, "z_threshold": alarm_z,
                                          **parse_assignments(alarm_set)}))
    replay = replay_alarm(result, rule)
    result = replace(result, replay=replay)
    return replace(result, verdict=timeline_verdict(result, replay))


def recorded_rule_settings(dump) -> dict:
    """The alarm settings the capture ran with ({} when it recorded none)."""
    monitor = (dump.attrs.get("capture") or {}).get("monitor") or {}
    return dict(monitor.get("alarm") or {})


def lead_indicator(alarms) -> Optional[str]:
    """Which moved first, attention or the loss, from alarm records (None without an alarm)."""
    if not alarms:
        return None
    first: dict[str, dict] = {}
    for a in sorted(alarms, key=lambda a: a["step"]):
        first.setdefault(a["metric"], a)
    attention = [a for m, a in first.items() if m != "loss"]
    loss = first.get("loss")
    if attention and loss is None:
        a = min(attention, key=lambda a: a["step"])
        return f"attention moved and the loss did not alarm ({a['metric']} first, at step {a['step']})"
    if loss is not None and not attention:
        return f"the loss moved (step {loss['step']}) and no attention statistic alarmed"
    a = min(attention, key=lambda a: a["step"])
    if a["step"] < loss["step"]:
        return (f"attention moved first: {a['metric']} at step {a['step']}, {loss['step'] - a['step']} step(s) "
                f"before the loss")
    if a["step"] > loss["step"]:
        return (f"the loss moved first: at step {loss['step']}, {a['step'] - loss['step']} step(s) before "
                f"{a['metric']}")
    return f"attention ({a['metric']}) and the loss alarmed at the same step, {a['step']}"


def _rule_text(s: dict) -> str:
    return f"warm-up {s['warmup']}, window {s['window']}, z > {s['z_threshold']:g}, trend over {s['trend_window']}"


def timeline_verdict(result: TimelineResult, replay: AlarmReplay, alpha: float = ALPHA) -> str:
    """One sentence: what the capture's alarm decided (where, which metric, which moved first), the rule replayed
    when its settings differ or the capture ran without one, and whether repeated maxima track the loss."""
    parts = []
    n = len(result.steps)
    if result.capture_rule is not None:
        if result.alarms:
            lead = result.alarms[0]
            rest = result.alarms[1:]
            more = (f" (+{len(rest)} more, at steps {_steps_text(sorted({a['step'] for a in rest}))})"
                    if rest else "")
            parts.append(f"the capture's alarm fired at {describe(lead)}{more}")
            order = lead_indicator(result.alarms)
            if order:
                parts.append(order)
        elif result.alarm_steps:
            parts.append(f"the capture's alarm fired at steps {list(result.alarm_steps)} (this dump does not record "
                         "which series)")
        elif 0 < n <= result.capture_rule.get("warmup", 0):
            hint = (f"; give --alarm-warmup below {n} to replay the rule over this run"
                    if replay.warmup_covers_run else "")
            parts.append(f"the capture's alarm raised no alarm, but its warm-up ({result.capture_rule['warmup']} "
                         f"monitored steps) covers all {n} monitored steps, so only a non-finite value could fire "
                         f"it{hint}")
        else:
            parts.append(f"the capture's alarm raised no alarm in {n} monitored steps")
    same = result.capture_rule is not None and _same_settings(result.capture_rule, replay.settings)
    if not same:
        s = replay.settings
        rule = f"the alarm rule ({_rule_text(s)})"
        prefix = "" if result.capture_rule is not None else "the capture ran without --alarm; "
        if replay.alarms:
            first = replay.alarms[0]
            rest = replay.alarms[1:]
            more = f" (+{len(rest)} more, at steps {_steps_text(sorted({a.step for a in rest}))})" if rest else ""
            parts.append(f"{prefix}replayed, {rule} fires at step {first.step}{first.where()}: {first.metric} = "
                         f"{readable(first.value)} ({first.detail()}){more}")
        elif replay.warmup_covers_run:
            parts.append(f"{prefix}replayed, no alarm, and only a non-finite value was possible: the rule's "
                         f"warm-up ({s['warmup']} monitored steps) covers all {n} monitored steps; give "
                         f"--alarm-warmup below {n} to watch this run")
        else:
            parts.append(f"{prefix}replayed, no alarm in {n} monitored steps under {rule}")
    if result.dropped:
        parts.append(f"announced after alarms but not in the store: {dropped_text(list(result.dropped))}")
    rho, p = result.ties_loss_spearman, result.ties_loss_p_value
    if rho is None:
        parts.append("too few measured steps (or a constant series) to relate repeated maxima to the loss")
    elif p < alpha:
        how = ("rise and fall with the loss" if rho > 0 else
               "move against the loss (more repeated maxima where the loss is lower)")
        parts.append(f"repeated maxima {how} (Spearman ρ = {rho:+.2f}, p = {p:.2g}; consecutive steps are "
                     "not independent, so p overstates the evidence)")
    else:
        parts.append(f"repeated maxima do not track the loss significantly (Spearman ρ = {rho:+.2f}, p = {p:.2g} "
                     f"≥ {alpha:g})")
    return "; ".join(parts)


def _same_settings(a: dict, b: dict) -> bool:
    from fa_forensics.monitor.alarm_settings import AlarmSettings

    return AlarmSettings.from_dict(a) == AlarmSettings.from_dict(b)


def _steps_text(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", … ({len(steps)} steps)" if len(steps) > limit else "")


def timeline_json(result: TimelineResult) -> dict:
    """The documented --json payload: steps[], loss[], series.<metric>[layer][head][step], the recorded alarms."""
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
        "alarms": [dict(a) for a in result.alarms],
        "capture_alarm_rule": result.capture_rule,
        "output_lse": None if result.output_lse is None else result.output_lse.tolist(),
        "qk_norm": list(result.qk_norm),
        "dropped_steps": [dict(d) for d in result.dropped],
    }


def alarm_json(replay: AlarmReplay) -> dict:
    """The replayed rule for --json: its settings and the alarms it raises."""
    return {"alarm_rule": replay.settings,
            "rule_alarms": [{**a.to_json(), "baseline": a.baseline, "z": a.z} for a in replay.alarms]}


def payload(result: TimelineResult) -> dict[str, Any]:
    """The whole --json payload (keys documented in docs/json.md and the registry)."""
    return {**timeline_json(result), **(alarm_json(result.replay) if result.replay is not None else {}),
            "diagnosis": diagnosis_json(result), "verdict": result.verdict, "warnings": list(result.warnings)}


def diagnosis_json(result: TimelineResult) -> dict:
    """The instability the series show (analyses.timeline.diagnose), for --json and the report's diagnosis."""
    from fa_forensics.analyses.timeline.diagnose import diagnose

    lse = getattr(result, "output_lse", None)
    lse = result.series.get("output_lse") if lse is None else lse
    return diagnose(result.steps, result.loss, **{m: result.series.get(m) for m in
                                                   ("max_logit", "top1_prob", "wq_sigma", "near_max_ties",
                                                    "attn_entropy")}, output_lse=lse).to_json()
