"""Every setting of the monitor's alarm rule, with its default: the one place they are defined.

The capture records the settings it ran with (`to_dict`, in the store's capture attributes), `timeline`
reads them back (`from_dict`), and the command-line options set them: `--alarm-warmup`, `--alarm-window`
and `--alarm-z` for the three most used, `--alarm-set KEY=VALUE` for any of them (`KEYS`; per-metric
settings as `min_rise.max_logit=0.5`). docs/monitor.md tabulates the defaults below (a test compares).

What each setting does is in monitor/alarm.py. Settings per watched metric (`WATCHED`):
- min_rise: how far above the trailing median a value must be for a jump (relative for the loss and
  W_Q's norm, e.g. 0.25 = +25 %; absolute for the others: logits, rows, probability);
- persist: for how many consecutive monitored steps a jump must last before it alarms;
- min_slope: the least growth per training step, on the metric's trend scale (see alarm.py), that a
  significant trend must have to alarm; `inf` switches a metric's trend test off.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional

from fa_forensics.errors import InvalidSetting

# The series the rule watches: the loss, then per (layer, head) the leading indicators of attention.
WATCHED = ("loss", "max_logit", "top1_prob", "near_max_ties", "wq_sigma")
PER_METRIC = ("min_rise", "persist", "min_slope")
MIN_WINDOW = 3  # a median and a MAD need a few values
MIN_TREND_WINDOW = 4


def _per_metric(**values: float) -> dict:
    return {m: values[m] for m in WATCHED}


@dataclass(frozen=True)
class AlarmSettings:
    """The alarm rule's settings (frozen; `with_overrides` gives a checked copy)."""

    warmup: int = 50  # monitored steps observed before a jump or a trend may alarm
    window: int = 20  # trailing monitored values of the jump test's median and MAD
    min_history: int = 8  # values the window needs before the jump test runs
    z_threshold: float = 6.0  # robust z-score a jump must exceed
    trend_window: int = 20  # monitored values in each of the trend test's two windows
    trend_z: float = 3.0  # Mann–Kendall z-score a trend must exceed
    trend_persist: int = 3  # consecutive monitored steps a trend must last
    reference_steps: int = 5  # the scale test's reference: median of each series' first finite monitored values
    logit_ratio: float = 20.0  # scale test: max logit >= this × its reference ...
    logit_rise: float = 50.0  # ... and this many logits above it
    saturation_top1: float = 0.99  # saturation: mean top-1 probability >= this ...
    entropy_fraction: float = 0.1  # ... and attention entropy <= this × its reference
    output_lse_rise: float = 5.0  # output-logit divergence: |output_lse − its reference| >= this, nats
    scale_persist: int = 3  # consecutive monitored steps the scale test must hold
    episode_gap: int = 50  # monitored steps without an alarm that end an episode (one line, one recording)
    min_rise: dict = field(default_factory=lambda: _per_metric(
        loss=0.25, max_logit=6.0, top1_prob=0.15, near_max_ties=8.0, wq_sigma=0.25))
    persist: dict = field(default_factory=lambda: _per_metric(
        loss=2, max_logit=3, top1_prob=3, near_max_ties=3, wq_sigma=3))
    min_slope: dict = field(default_factory=lambda: _per_metric(
        loss=0.03, max_logit=0.5, top1_prob=math.inf, near_max_ties=0.25, wq_sigma=0.03))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in PER_METRIC:
                if not isinstance(value, Mapping) or set(value) != set(WATCHED):
                    raise InvalidSetting("alarm_set", f"{f.name} must give a value for each of {', '.join(WATCHED)}")
                for metric in WATCHED:
                    _check(f"{f.name}.{metric}", value[metric])
            else:
                _check(f.name, value)
        if self.min_history > self.window:
            raise InvalidSetting("alarm_set", f"min_history ({self.min_history}) must be <= window ({self.window})")

    def to_dict(self) -> dict:
        """The settings as plain JSON data (what a capture records; an infinite min_slope as "inf")."""
        def plain(v):
            return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else (
                "inf" if isinstance(v, float) and math.isinf(v) else v)

        return plain(asdict(self))

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> AlarmSettings:
        """Settings from recorded data; keys it lacks keep their defaults (a capture made before a setting
        existed), and the older name `min_change` reads as `min_rise`."""
        data = dict(data or {})
        if "min_change" in data and "min_rise" not in data:
            data["min_rise"] = data.pop("min_change")
        known = {f.name for f in fields(cls)}
        base = cls()
        values = {}
        for key, value in data.items():
            if key not in known:
                continue
            if key in PER_METRIC:
                value = {**getattr(base, key), **{m: _number(v) for m, v in dict(value or {}).items()}}
            values[key] = _number(value)
        if "window" in values and "min_history" not in values:
            values["min_history"] = min(base.min_history, int(values["window"]))
        return replace(base, **values)

    def with_overrides(self, overrides: Mapping[str, Any]) -> AlarmSettings:
        """A checked copy with `overrides` ({KEY: value}, KEY as in `KEYS`, or a per-metric setting's name with
        a {metric: value} dict; None values are skipped)."""
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            if value is None:
                continue
            if key in PER_METRIC and isinstance(value, Mapping):
                unknown = set(value) - set(WATCHED)
                if unknown:
                    raise InvalidSetting("alarm_set", f"{key}: unknown metric(s) {sorted(unknown)}; the metrics are "
                                                      f"{', '.join(WATCHED)}")
                values[key] = {**values.get(key, getattr(self, key)), **value}
                continue
            if key not in KEYS:
                raise InvalidSetting("alarm_set", f"unknown setting {key!r}; the settings are {', '.join(KEYS)}")
            name, _, metric = key.partition(".")
            if metric:
                values.setdefault(name, dict(getattr(self, name)))[metric] = value
            else:
                values[name] = value
        window = values.get("window")
        if isinstance(window, int) and not isinstance(window, bool) and "min_history" not in values:
            values["min_history"] = min(self.min_history, window)  # a short window can alarm too
        return replace(self, **values)


def _number(value: Any) -> Any:
    """A recorded "inf" back to a float; anything else as it is."""
    return float(value) if isinstance(value, str) else value


def _check(key: str, value: Any) -> None:
    """InvalidSetting for a value out of the setting's domain."""
    name = key.split(".")[0]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    whole = number and float(value).is_integer() and math.isfinite(value)
    if name == "warmup" and not (whole and value >= 0):
        raise InvalidSetting("alarm_warmup", f"must be a whole number of monitored steps >= 0, got {value!r}")
    if name == "window" and not (whole and value >= MIN_WINDOW):
        raise InvalidSetting("alarm_window", f"must be a whole number of monitored steps >= {MIN_WINDOW}, got "
                                             f"{value!r}")
    if name == "z_threshold" and not (number and math.isfinite(value) and value > 0):
        raise InvalidSetting("alarm_z", f"must be a finite robust z-score > 0 (default {DEFAULTS.z_threshold:g}), "
                                        f"got {value!r}")
    if name == "min_history" and not (whole and value >= 2):
        raise InvalidSetting("alarm_set", f"min_history must be a whole number >= 2, got {value!r}")
    if name == "trend_window" and not (whole and value >= MIN_TREND_WINDOW):
        raise InvalidSetting("alarm_set", f"trend_window must be a whole number of monitored steps >= "
                                          f"{MIN_TREND_WINDOW}, got {value!r}")
    if name == "trend_z" and not (number and math.isfinite(value) and value > 0):
        raise InvalidSetting("alarm_set", f"trend_z must be a finite z-score > 0, got {value!r}")
    if name in ("trend_persist", "persist") and not (whole and value >= 1):
        raise InvalidSetting("alarm_set", f"{key} must be a whole number of monitored steps >= 1, got {value!r}")
    if name in ("reference_steps", "scale_persist", "episode_gap") and not (whole and value >= 1):
        raise InvalidSetting("alarm_set", f"{key} must be a whole number of monitored steps >= 1, got {value!r}")
    if name in ("logit_ratio", "logit_rise", "output_lse_rise") and not (number and not math.isnan(value)
                                                                          and value > 0):
        raise InvalidSetting("alarm_set", f"{key} must be a number > 0 (inf: off), got {value!r}")
    if name in ("saturation_top1", "entropy_fraction") and not (number and math.isfinite(value) and value >= 0):
        raise InvalidSetting("alarm_set", f"{key} must be a finite number >= 0 (saturation_top1 above 1: no "
                                          f"saturation test), got {value!r}")
    if name == "min_rise" and not (number and math.isfinite(value) and value >= 0):
        raise InvalidSetting("alarm_set", f"{key} must be a finite number >= 0, got {value!r}")
    if name == "min_slope" and not (number and not math.isnan(value) and value >= 0):
        raise InvalidSetting("alarm_set", f"{key} must be a number >= 0 per step (inf: no trend test), got "
                                          f"{value!r}")


DEFAULTS = AlarmSettings()

# Every key --alarm-set accepts, in the order docs/monitor.md lists them.
KEYS: tuple[str, ...] = (
    *(f.name for f in fields(AlarmSettings) if f.name not in PER_METRIC),
    *(f"{name}.{metric}" for name in PER_METRIC for metric in WATCHED),
)
_WHOLE = {"warmup", "window", "min_history", "trend_window", "trend_persist", "persist", "reference_steps",
          "scale_persist", "episode_gap"}


def parse_assignments(items: Optional[Iterable[str]]) -> dict[str, float]:
    """`["min_rise.max_logit=0.5", "trend_z=4"]` → {key: number}; InvalidSetting (setting "alarm_set") for an
    item that is not KEY=NUMBER with a known KEY."""
    out: dict[str, float] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise InvalidSetting("alarm_set", f"{item!r} is not KEY=VALUE (e.g. trend_z=4)")
        if key not in KEYS:
            raise InvalidSetting("alarm_set", f"unknown setting {key!r}; the settings are {', '.join(KEYS)}")
        try:
            value = float(text)
        except ValueError:
            raise InvalidSetting("alarm_set", f"{key}={text!r}: the value must be a number") from None
        if key.split(".")[0] in _WHOLE and value.is_integer():
            value = int(value)
        out[key] = value
    return out


def check_settings(warmup=None, window=None, z_threshold=None, assignments: Optional[Iterable[str]] = None) -> None:
    """InvalidSetting for a setting out of its domain (None = the default, always fine): the three named
    ones, then `--alarm-set` items."""
    DEFAULTS.with_overrides({"warmup": warmup, "window": window, "z_threshold": z_threshold,
                             **parse_assignments(assignments)})
