"""The early-warning rule of the training monitor (settings and defaults: monitor/alarm_settings.py).

Watched series (`WATCHED`): the loss, and per (layer, head) the max logit, the mean top-1 probability,
the rows with a repeated maximum (`near_max_ties`) and W_Q's spectral norm. Each monitored step feeds
every series one value; three tests look at it, and the first that fires names the alarm's `rule`:

- non-finite: a NaN or ±inf value alarms at once, also during the warm-up. (A NaN where a series has
  never had a finite value is "not measured", e.g. W_Q not found or no loss known, and does not alarm;
  ±inf always does.)
- jump: the robust z-score against the trailing `window` monitored values,
      z = (x − median) / (1.4826 · MAD + floor),
  exceeds `z_threshold`, the value has risen by more than `min_rise` (relative to the median for the
  loss and W_Q's norm; absolute for the others: logit units for the max logit, since a rise of d
  multiplies the top key's odds by e^d whatever the logit was, rows for tie counts, probability for
  the top-1 probability), at least `min_history` values are in the window, and this has held for
  `persist` consecutive monitored steps. The floor (10⁻³·|median| for relative series, 0.05 logits,
  0.5 rows, 10⁻³ probability) keeps a flat history from turning noise into alarms.
- trend: the series rises over the last `trend_window` monitored values (Mann–Kendall z-score above
  `trend_z`) and faster than over the `trend_window` values before them: its Theil–Sen slope per
  training step exceeds the earlier window's (counted as 0 when that one falls) by more than
  `min_slope`, for `trend_persist` consecutive monitored steps. Slopes are taken on the metric's trend
  scale (`TREND_SCALE`): logit units for the max logit (a rise of 1 multiplies the top key's odds by e),
  −log(1 − p) for the top-1 probability (≈ p while attention is broad, growing without bound as it
  collapses onto one key), log for W_Q's norm, asinh for the loss (≈ log above 2), log(1 + x) for counts.
  The test runs once both windows hold values from after the warm-up. It catches drifts slow enough to
  drag a trailing median along (a jump test never fires on them), and it does not fire on what training
  does on its own: steady growth (W_Q's norm) and heads that sharpen as they learn (a rise no faster
  than the one before, or below `min_slope`; measured in docs/monitor.md).

Only rises alarm (more ties, sharper attention, larger logits and norms, a higher loss). A series
alarms once per excursion: again only after a monitored step on which no test finds it out. No jump
or trend alarms during the first `warmup` monitored steps (their values still fill the windows):
early training moves every series fast.

One alarm, one description: `Alarm.message()` is the capture's line; the capture records each alarm
in its timeline row (`alarm_<metric>` series holding the rule's code, `RULE_CODES`), and `timeline`
and the report read them back with `recorded_alarms`; `lead` picks the alarm every one of them names
first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fa_forensics.monitor.alarm_settings import DEFAULTS, WATCHED, AlarmSettings, check_settings  # noqa: F401
from fa_forensics.monitor.scale_test import SCALED, ScaleTest
from fa_forensics.monitor.trend import mann_kendall_z, theil_sen_slope

RULES = ("non-finite", "jump", "trend", "scale")  # in the order they are tried
ALARMED = (*WATCHED, "attn_entropy", "output_lse")  # every series an alarm can name
RULE_CODES = {rule: code for code, rule in enumerate(RULES, start=1)}  # 0: no alarm
RELATIVE = {"loss": True, "max_logit": False, "top1_prob": False, "near_max_ties": False, "wq_sigma": True}
ABSOLUTE_FLOOR = {"near_max_ties": 0.5, "top1_prob": 1e-3, "max_logit": 0.05}
TREND_SCALE = {"loss": "asinh", "max_logit": "linear", "top1_prob": "-log(1-p)", "near_max_ties": "log1p",
               "wq_sigma": "log"}
LEAD_ORDER = ("max_logit", "attn_entropy", "top1_prob", "near_max_ties", "wq_sigma", "output_lse",
              "loss")  # attention first


def alarm_series(metric: str) -> str:
    """The timeline series in which the capture records the alarms of `metric`."""
    return f"alarm_{metric}"


@dataclass(frozen=True)
class Alarm:
    """One alarm: the step, the series (metric; layer and head, None for the loss), its value, the rule that
    fired and that rule's numbers (jump: trailing median and robust z; trend: the fitted value at the window's
    start and the Mann–Kendall z, `slope` per step on the trend scale; non-finite: NaN)."""

    step: int
    metric: str
    value: float
    baseline: float
    z: float
    layer: Optional[int] = None
    head: Optional[int] = None
    rule: str = "jump"
    slope: float = float("nan")  # trend: Theil–Sen slope per step of the recent window, on the trend scale
    slope_before: float = float("nan")  # trend: the same over the window before it
    span: int = 0  # trend: the monitored steps of each window

    def where(self) -> str:
        return "" if self.layer is None else f" layer {self.layer} head {self.head}"

    def message(self) -> str:
        """The one line the capture prints (and raises as an AlarmWarning)."""
        return f"fa-forensics alarm: step {self.step}{self.where()}: {self.metric} = {readable(self.value)} " \
               f"({self.detail()})"

    def detail(self) -> str:
        if self.rule == "non-finite":
            return "non-finite"
        if self.rule == "scale":
            ref = readable(self.baseline)
            if self.metric == "attn_entropy":
                ratio = readable(self.value / self.baseline)
                return f"saturated: top-1 probability {readable(self.z)}, entropy {ratio}× its reference {ref} nats"
            if self.metric == "output_lse":
                return f"scale: {readable(self.value - self.baseline):s} nats from its reference {ref}"
            return f"scale: {readable(self.value / self.baseline)}× its reference {ref}"
        if self.rule == "trend":
            return (f"trend: rising {_per_step(self.metric, self.slope)} over the last {self.span} monitored steps "
                    f"(from {readable(self.baseline)}), against {_per_step(self.metric, self.slope_before)} over the "
                    f"{self.span} before; Mann–Kendall z = {self.z:.1f}")
        if RELATIVE[self.metric] and self.baseline > 0:
            rise = f"{readable(self.value / self.baseline)}× the trailing median {readable(self.baseline)}"
        else:
            rise = f"+{readable(self.value - self.baseline)} over the trailing median {readable(self.baseline)}"
        return f"jump: {rise}, robust z = {readable(self.z)}"

    def to_json(self) -> dict:
        """The documented alarm record (`timeline --json` `alarms`): what every reader names."""
        return {"step": self.step, "metric": self.metric, "layer": self.layer, "head": self.head, "value": self.value,
                "rule": self.rule, "value_text": readable(self.value)}


def readable(x: float) -> str:
    """A number for a person: 4 significant digits, an exponent for very large or small ones (1.2e+36)."""
    return f"{x:.4g}"


def _per_step(metric: str, slope: float) -> str:
    """A trend's slope in words, on the metric's trend scale."""
    kind = TREND_SCALE[metric]
    if kind in ("log", "asinh"):
        return f"×{np.exp(slope):.3g} a step"
    if kind == "log1p":
        return f"×{np.exp(slope):.3g} a step in 1 + count"
    if kind == "linear":
        return f"{slope:+.3g} a step"
    return f"{slope:+.3g} a step in {kind}"


def lead_key(alarm) -> tuple:
    """The order in which alarms are named: earliest step, then non-finite before jump before trend, then the
    attention metrics before the loss, then layer and head. Works on Alarm and on its JSON record."""
    get = (lambda k: alarm[k]) if isinstance(alarm, dict) else (lambda k: getattr(alarm, k))
    layer, head = get("layer"), get("head")
    return (get("step"), RULES.index(get("rule")), LEAD_ORDER.index(get("metric")),
            -1 if layer is None else layer, -1 if head is None else head)


def lead(alarms):
    """The alarm a one-line description names (None for none)."""
    return min(alarms, key=lead_key) if alarms else None


def trend_scale(metric: str, x: np.ndarray) -> np.ndarray:
    """Values on the metric's trend scale (NaN where x is not finite)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        kind = TREND_SCALE[metric]
        if kind == "log":
            y = np.log(np.maximum(x, np.finfo(np.float64).tiny))
        elif kind == "-log(1-p)":
            y = -np.log1p(-np.clip(x, 0.0, 1 - 1e-12))
        elif kind == "log1p":
            y = np.log1p(np.maximum(x, 0.0))
        elif kind == "linear":
            y = x
        else:
            y = np.arcsinh(x)
    return np.where(np.isfinite(x), y, np.nan)


def from_trend_scale(metric: str, y: np.ndarray) -> np.ndarray:
    kind = TREND_SCALE[metric]
    with np.errstate(all="ignore"):
        if kind == "log":
            return np.exp(y)
        if kind == "-log(1-p)":
            return -np.expm1(-y)
        if kind == "log1p":
            return np.expm1(y)
        if kind == "linear":
            return y
        return np.sinh(y)


def _finite_median(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(median over axis 0 of each cell's finite values (NaN where there is none), their count). One sort:
    NaN sorts last, so the middle of the first `count` entries is the median."""
    ordered = np.sort(values, axis=0)
    count = np.isfinite(values).sum(axis=0)
    n = len(values)
    if n and count.min() == n:  # every cell full (the rule's steady state): the middle rows, no index arrays
        return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2, count
    lo, hi = np.maximum((count - 1) // 2, 0), count // 2
    a = np.take_along_axis(ordered, np.expand_dims(lo, 0), axis=0)[0]
    b = np.take_along_axis(ordered, np.expand_dims(np.minimum(hi, len(values) - 1), 0), axis=0)[0]
    return np.where(count > 0, (a + b) / 2, np.nan), count


def _slopes_where(candidates: np.ndarray, steps: np.ndarray, y: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Theil–Sen slopes of the recent window (y[w:]) and of the one before (y[:w]), per cell, computed only where
    `candidates` holds (NaN elsewhere): a median of pairwise slopes is the rule's dearest step."""
    shape = candidates.shape
    flat = np.asarray(candidates).reshape(-1)
    slope, before = np.full(flat.shape, np.nan), np.full(flat.shape, np.nan)
    if flat.any():
        cells = y.reshape(len(y), -1)[:, flat]  # (2w, K)
        slope[flat] = theil_sen_slope(steps[w:], cells[w:])
        before[flat] = theil_sen_slope(steps[:w], cells[:w])
    return slope.reshape(shape), before.reshape(shape)


class _Series:
    """The rule's state for one watched metric, over all its cells ((L, H), or () for the loss)."""

    def __init__(self, metric: str, shape: tuple, s: AlarmSettings):
        self.metric, self.shape = metric, shape
        self.values = np.full((int(s.window), *shape), np.nan)  # ring of the last `window` values
        self.trend = np.full((2 * int(s.trend_window), *shape), np.nan)  # ring on the trend scale: 2 windows
        self.trend_steps = np.zeros(2 * int(s.trend_window))
        self.n = 0  # values observed
        self.n_active = 0  # values observed after the warm-up
        self.jump_streak = np.zeros(shape, dtype=np.int64)
        self.trend_streak = np.zeros(shape, dtype=np.int64)
        self.seen_finite = np.zeros(shape, dtype=bool)
        self.alarmed = np.zeros(shape, dtype=bool)  # in an excursion that has alarmed

    def observe(self, step: int, x: np.ndarray, s: AlarmSettings, active: bool) -> list[tuple]:
        """Feed one value per cell; return [(rule, index, baseline, z, (slope, slope before))] for the cells that
        alarm."""
        m = self.metric
        finite = np.isfinite(x)
        non_finite = ~finite & (np.isinf(x) | self.seen_finite)
        self.seen_finite |= finite
        med, count = _finite_median(self.values)
        mad, _ = _finite_median(np.abs(self.values - med))
        if RELATIVE[m]:
            floor = np.maximum(np.abs(med) * 1e-3, 1e-6)
            change = np.where(med != 0, (x - med) / np.where(med != 0, np.abs(med), 1.0), x - med)
        else:
            floor = ABSOLUTE_FLOOR[m]
            change = x - med
        with np.errstate(all="ignore"):
            z = (x - med) / (1.4826 * mad + floor)
            jump = finite & (count >= s.min_history) & (z > s.z_threshold) & (change > s.min_rise[m])
        self.values[self.n % self.values.shape[0]] = np.where(finite, x, np.nan)
        ring = self.n % self.trend.shape[0]
        self.trend[ring] = trend_scale(m, x)
        self.trend_steps[ring] = step
        self.n += 1
        self.n_active += active
        trend = np.zeros(self.shape, dtype=bool)
        if self.n_active >= self.trend.shape[0] and np.isfinite(s.min_slope[m]):  # both windows after the warm-up
            order = np.roll(np.arange(self.trend.shape[0]), -(ring + 1))  # oldest first
            y, steps = self.trend[order], self.trend_steps[order]
            w = self.trend.shape[0] // 2
            mk = mann_kendall_z(y[w:])
            slope, before = _slopes_where(mk > s.trend_z, steps, y, w)  # only where the rise is significant
            with np.errstate(invalid="ignore"):
                trend = (mk > s.trend_z) & (slope - np.maximum(before, 0.0) > s.min_slope[m])
        self.jump_streak = np.where(jump & active, self.jump_streak + 1, 0)
        self.trend_streak = np.where(trend & active, self.trend_streak + 1, 0)
        fire_nf = non_finite & ~self.alarmed
        fire_jump = (self.jump_streak >= s.persist[m]) & ~self.alarmed & ~fire_nf
        fire_trend = (self.trend_streak >= s.trend_persist) & ~self.alarmed & ~fire_nf & ~fire_jump
        out = non_finite | (jump & active) | (trend & active)
        self.alarmed = (self.alarmed & out) | fire_nf | fire_jump | fire_trend
        raised = []
        for rule, fired in (("non-finite", fire_nf), ("jump", fire_jump), ("trend", fire_trend)):
            for index in zip(*np.nonzero(np.atleast_1d(fired))) if self.shape else ([()] if fired else []):
                if rule == "jump":
                    raised.append((rule, index, float(med[index]), float(z[index]), (float("nan"), float("nan"))))
                elif rule == "trend":
                    y_cell = y[(slice(None), *index)][w:]  # the recent window, oldest first
                    start = float(np.median(y_cell - slope[index] * (steps[w:] - steps[w])))  # Theil–Sen intercept
                    raised.append((rule, index, float(from_trend_scale(m, start)), float(mk[index]),
                                   (float(slope[index]), float(before[index]))))
                else:
                    raised.append((rule, index, float("nan"), float("nan"), (float("nan"), float("nan"))))
        return raised


class AlarmRule:
    """The rule over all watched series; call `observe` once per monitored step (in step order)."""

    def __init__(self, settings: Optional[AlarmSettings] = None, **overrides: Any):
        settings = settings or DEFAULTS
        self.config = settings.with_overrides(overrides) if overrides else settings
        self._series: dict[str, _Series] = {}
        self._scale: dict[str, ScaleTest] = {}
        self._observed = 0

    @property
    def warmup(self) -> int:
        return int(self.config.warmup)

    @classmethod
    def with_settings(cls, warmup: Optional[int] = None, window: Optional[int] = None,
                      z_threshold: Optional[float] = None, base: Optional[AlarmSettings] = None,
                      **more: Any) -> AlarmRule:
        """The rule with the given settings (None: `base`'s, else the default), checked: InvalidSetting for a
        value that cannot work. `more`: any other key of alarm_settings.KEYS."""
        base = base or DEFAULTS
        return cls(base.with_overrides({"warmup": warmup, "window": window, "z_threshold": z_threshold, **more}))

    def settings(self) -> dict:
        """The settings a capture records and `timeline` reads back."""
        return self.config.to_dict()

    def observe(self, step: int, loss: Optional[float] = None, qk_norm=None, **tables: Any) -> list[Alarm]:
        """Feed one step's values; return the alarms it raises, in `lead` order.

        loss: a number or None (not known); tables: per watched metric an (L, H) array-like (NaN where not
        measured) or None, and `output_lse` a number or None; qk_norm: per layer, True where the attention
        normalizes q and k (W_Q's norm is not watched there); other keyword arguments (metrics the rule does
        not watch) are ignored."""
        self._observed += 1
        active = self._observed > self.config.warmup
        alarms = []
        values = {"loss": loss, **tables}
        behind_norm = [i for i, v in enumerate(qk_norm or ()) if v]
        for metric, x in _fed(values, WATCHED):
            series = _state(self._series, metric, x.shape, lambda m, shape: _Series(m, shape, self.config))
            for rule, index, baseline, z, (slope, before) in series.observe(step, x, self.config, active):
                layer, head = _cell(index)
                if metric == "wq_sigma" and layer in behind_norm:
                    continue
                alarms.append(Alarm(step=int(step), metric=metric, value=float(x[index]), baseline=baseline, z=z,
                                    layer=layer, head=head, rule=rule, slope=slope, slope_before=before,
                                    span=int(self.config.trend_window) if rule == "trend" else 0))
        taken = {(a.metric, a.layer, a.head) for a in alarms}
        alarms += [a for a in self._observe_scale(step, values) if (a.metric, a.layer, a.head) not in taken]
        return sorted(alarms, key=lead_key)

    def _observe_scale(self, step: int, values: dict) -> list[Alarm]:
        """The scale test's alarms (monitor/scale_test.py); a cell already alarmed by another test this step keeps
        that alarm alone."""
        out = []
        for metric, x in _fed(values, SCALED):
            test = _state(self._scale, metric, x.shape,
                          lambda m, shape: ScaleTest(m, shape, int(self.config.reference_steps)))
            top1 = values.get("top1_prob") if metric == "attn_entropy" else None
            for index, reference in test.observe(x, self.config, top1):
                layer, head = _cell(index)
                z = float(np.asarray(top1, dtype=np.float64)[index]) if top1 is not None else float("nan")
                out.append(Alarm(step=int(step), metric=metric, value=float(x[index]), baseline=reference, z=z,
                                 layer=layer, head=head, rule="scale"))
        return out


def _fed(values: dict, metrics: tuple) -> list[tuple[str, np.ndarray]]:
    """(metric, its values as float64) for each of `metrics` fed this step (None: not fed)."""
    return [(m, np.asarray(values[m], dtype=np.float64)) for m in metrics if values.get(m) is not None]


def _state(states: dict, metric: str, shape: tuple, make):
    """A test's state for `metric`, made anew (`make(metric, shape)`) the first time or when the series changes
    shape."""
    state = states.get(metric)
    if state is None or state.shape != shape:
        state = states[metric] = make(metric, shape)
    return state


def _cell(index: tuple) -> tuple[Optional[int], Optional[int]]:
    """(layer, head) of a cell's index; (None, None) for a scalar series (the loss, output_lse)."""
    return (None, None) if not index else (int(index[0]), int(index[1]))


def rule_from_settings(settings) -> Optional[AlarmRule]:
    """The rule a capture's `alarm` setting asks for: False/None = no alarm, True = the defaults, an
    AlarmSettings or a dict of settings (as `AlarmRule.settings()` gives; checked) = those, an AlarmRule = itself."""
    if isinstance(settings, AlarmRule):
        return settings
    if not settings:
        return None
    if settings is True:
        return AlarmRule()
    if isinstance(settings, AlarmSettings):
        return AlarmRule(settings)
    return AlarmRule(AlarmSettings.from_dict(settings))


def replay_rule(rule: AlarmRule, steps, loss=None, qk_norm=None, **series) -> list[Alarm]:
    """The alarms `rule` raises over a recorded timeline: steps (S,), loss (S,) and per watched metric an
    (S, L, H) array or None, fed one monitored step at a time as the capture fed them. The timeline stores an
    unknown loss as NaN, so a NaN loss is fed as NaN (it alarms after a finite one, as a NaN loss did in the
    capture); a loss never known is not fed. `output_lse` (S,) and `attn_entropy` (S, L, H) feed the scale test;
    qk_norm (per layer, the store's `capture.monitor.qk_norm`) as the capture gave it."""
    alarms: list[Alarm] = []
    known = loss is not None and bool(np.isfinite(np.asarray(loss, dtype=np.float64)).any())
    for i, step in enumerate(steps):
        loss_i = float(loss[i]) if known else None
        alarms += rule.observe(int(step), loss=loss_i, qk_norm=qk_norm,
                               **{m: (None if a is None else a[i]) for m, a in series.items() if m in ALARMED})
    return alarms


def alarm_codes(alarms: list[Alarm], shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """The alarms of one step as the capture records them in its timeline row: per watched metric with a shape
    in `shapes` (() for the loss), the series `alarm_<metric>` holding each cell's rule code (0: none)."""
    codes = {m: np.zeros(shape) for m, shape in shapes.items()}
    for a in alarms:
        if a.metric not in codes:
            continue
        codes[a.metric][() if a.layer is None else (a.layer, a.head)] = RULE_CODES[a.rule]
    return {alarm_series(m): c for m, c in codes.items()}


def recorded_alarms(timeline: dict) -> list[dict]:
    """The alarms a capture recorded in a timeline (arrays as `Dump.timeline` reads them), as JSON records
    {step, metric, layer, head, value, rule, value_text} (value_text: the value as `readable` writes it, also
    for NaN and inf, which JSON has no number for), in `lead` order. [] when the capture recorded none."""
    steps = np.asarray(timeline.get("step", []))
    out = []
    for metric in ALARMED:
        codes, values = timeline.get(alarm_series(metric)), timeline.get(metric)
        if codes is None or values is None:
            continue
        codes = np.nan_to_num(np.asarray(codes, dtype=np.float64))
        for index in zip(*np.nonzero(codes)):
            code = int(codes[index])
            if not 1 <= code <= len(RULES):
                continue
            i, cell = index[0], index[1:]
            value = float(np.asarray(values)[index])
            out.append({"step": int(steps[i]), "metric": metric,
                        "layer": int(cell[0]) if cell else None, "head": int(cell[1]) if cell else None,
                        "value": value, "rule": RULES[code - 1], "value_text": readable(value)})
    return sorted(out, key=lead_key)


def describe(record: dict) -> str:
    """One alarm record in words: 'step 202 layer 1 head 0: wq_sigma = 30.2 (jump)'."""
    where = "" if record.get("layer") is None else f" layer {record['layer']} head {record['head']}"
    value = record.get("value_text") or ("n/a" if record.get("value") is None else readable(record["value"]))
    return f"step {record['step']}{where}: {record['metric']} = {value} ({record['rule']})"
