"""Tables of a timeline result, and its sentence for the report."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.timeline.compute import TimelineResult
from fa_forensics.monitor.alarm import describe, readable

ALARM_ROWS = 12  # alarms listed one per row; the rest are counted


def tables(result: TimelineResult) -> list:
    """Per layer and head: the last step's statistics and ‖W_Q‖₂ first → last; the recorded alarms; two lines on
    repeated maxima against the loss and the largest W_Q."""
    table = Table(title=f"timeline: {len(result.steps)} monitored steps "
                        f"({int(result.steps[0])}..{int(result.steps[-1])}), "
                        f"{result.n_layers} layers × {result.n_heads} heads")
    for col in ("layer", "head", "max logit (last)", "top-1 prob. (last)", "repeated-max rows (last)",
                "extra P̄=1 (last)", "‖W_Q‖₂ first → last"):
        table.add_column(col, justify="right")
    s = result.series

    def last(metric: str, layer: int, head: int) -> str:
        return readable(s[metric][-1, layer, head]) if metric in s else "–"

    for layer in range(result.n_layers):
        for head in range(result.n_heads):
            wq = s.get("wq_sigma")
            wq_txt = "–" if wq is None else f"{readable(wq[0, layer, head])} → {readable(wq[-1, layer, head])}"
            table.add_row(str(layer), str(head), last("max_logit", layer, head), last("top1_prob", layer, head),
                          last("near_max_ties", layer, head), last("p_one_extra", layer, head), wq_txt)
    out: list = [table]
    if result.alarms:
        alarms = Table(title=f"alarms the capture recorded ({len(result.alarms)})")
        for col in ("step", "metric", "layer", "head", "value", "rule"):
            alarms.add_column(col, justify="right")
        for a in result.alarms[:ALARM_ROWS]:
            alarms.add_row(str(a["step"]), a["metric"], "–" if a["layer"] is None else str(a["layer"]),
                           "–" if a["head"] is None else str(a["head"]), readable(a["value"]), a["rule"])
        if len(result.alarms) > ALARM_ROWS:
            alarms.caption = f"… and {len(result.alarms) - ALARM_ROWS} more (all of them in --json `alarms`)"
        out.append(alarms)
    if result.ties_loss_spearman is not None:
        out.append(f"repeated maxima vs loss: Spearman ρ = {result.ties_loss_spearman:+.3f} "
                   f"(p = {result.ties_loss_p_value:.3g})")
    if result.top_wq_head is not None:
        layer, head = result.top_wq_head
        out.append(f"largest W_Q spectral norm at the last step: layer {layer} head {head} "
                   f"({readable(s['wq_sigma'][-1, layer, head])})")
    return out


def finding(d: dict) -> str:
    """The report's sentence of the timeline, from its --json payload (keys read defensively)."""
    steps = d.get("steps") or []
    alarms = d.get("alarms") or []
    head = f"timeline: {len(steps)} monitored steps"
    if alarms:
        first = alarms[0]
        more = f" (+{len(alarms) - 1} more)" if len(alarms) > 1 else ""
        return f"{head}; the capture's alarm fired at {describe(first)}{more}."
    rule = d.get("capture_alarm_rule")
    if rule is not None:
        if 0 < len(steps) <= (rule.get("warmup") or 0):
            return (f"{head}; the capture's alarm raised no alarm, but its warm-up ({rule['warmup']} monitored "
                    "steps) covers the whole run, so only a non-finite value could fire it.")
        return f"{head}; the capture's alarm raised no alarm."
    fired = d.get("rule_alarms") or []
    if fired:
        return (f"{head}; the capture ran without --alarm, and the rule replayed over the timeline fires at "
                f"{describe(fired[0])}.")
    return f"{head}; no alarm (the capture ran without --alarm; the rule replayed raises none)."
