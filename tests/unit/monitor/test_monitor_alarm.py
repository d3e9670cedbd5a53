"""The alarm rule: its trend tests against scipy, its settings (one home, documented), non-finite values at
once, slow drifts the jump test misses, one description of each alarm as the capture records it."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from fa_forensics.errors import InvalidSetting
from fa_forensics.monitor.alarm import (
    Alarm, AlarmRule, _finite_median, alarm_codes, describe, lead, lead_key, recorded_alarms, replay_rule, trend_scale,
)
from fa_forensics.monitor.alarm_settings import DEFAULTS, KEYS, WATCHED, AlarmSettings, parse_assignments
from fa_forensics.monitor.trend import mann_kendall_z, theil_sen_slope

DOCS = Path(__file__).resolve().parents[3] / "docs" / "monitor.md"


def test_mann_kendall_and_theil_sen_equal_scipy_series_by_series():
    rng = np.random.default_rng(0)
    n = 20
    x = np.arange(100, 100 + 3 * n, 3)  # monitored every 3rd step
    y = rng.standard_normal((n, 4, 5)) + np.linspace(0, 2, n)[:, None, None] * rng.random((1, 4, 5))
    z, slope = mann_kendall_z(y), theil_sen_slope(x, y)
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    for i in range(4):
        for j in range(5):
            tau = sps.kendalltau(np.arange(n), y[:, i, j])  # no ties: tau-b = S / (n(n-1)/2)
            s = tau.statistic * n * (n - 1) / 2
            assert z[i, j] == pytest.approx((s - np.sign(s)) / sd, abs=1e-9)
            assert slope[i, j] == pytest.approx(sps.theilslopes(y[:, i, j], x).slope, rel=1e-12)
    assert np.isnan(mann_kendall_z(np.array([1.0, np.nan, 3.0, 4.0])))  # a NaN in the window: no test


def test_window_medians_equal_numpy_on_full_windows_and_on_windows_with_gaps():
    """The rule's median of each cell's window: the steady state (every cell full) takes the middle rows, a window
    with NaN (not yet filled, or a non-finite value left out) the middle of its finite values; both as np.nanmedian,
    bit for bit (the mean of the two middle values, the same float operations)."""
    rng = np.random.default_rng(3)
    for n in (19, 20):  # odd and even windows
        full = rng.standard_normal((n, 3, 4))
        med, count = _finite_median(full)
        assert np.array_equal(med, np.nanmedian(full, axis=0)) and (count == n).all()
        gappy = full.copy()
        gappy[rng.random(gappy.shape) < 0.3] = np.nan
        gappy[:, 0, 0] = np.nan  # a cell with no finite value: NaN, count 0
        med, count = _finite_median(gappy)
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
            expected = np.nanmedian(gappy, axis=0)
        assert np.array_equal(med, expected, equal_nan=True)
        assert np.array_equal(count, np.isfinite(gappy).sum(axis=0))


def test_mann_kendall_counts_tied_pairs_as_zero_like_the_pairwise_sum():
    """Counts (repeated-maximum rows) tie often: S is the sum over pairs i < j of sign(y_j − y_i), ties adding 0."""
    rng = np.random.default_rng(4)
    y = rng.integers(0, 4, size=(20, 2, 3)).astype(np.float64)
    s = sum(np.sign(y[j] - y[i]) for i in range(20) for j in range(i + 1, 20))
    sd = math.sqrt(20 * 19 * 45 / 18)
    assert np.array_equal(mann_kendall_z(y), (s - np.sign(s)) / sd)


def test_every_default_is_in_the_docs_table_and_every_key_can_be_set():
    text = DOCS.read_text()
    documented = dict(re.findall(r"^\| `([a-z_0-9.]+)` \| ([^|]+?) \|", text, flags=re.M))
    settings = DEFAULTS.to_dict()
    for key in KEYS:
        name, _, metric = key.partition(".")
        value = float(settings[name][metric] if metric else settings[name])  # an infinite one is recorded "inf"
        assert key in documented, key
        assert float(documented[key].split()[0]) == pytest.approx(float(value)), key
        changed = DEFAULTS.with_overrides({key: value + 1 if math.isfinite(value) else 1.0})  # inf: a test that is off
        assert changed != DEFAULTS


def test_settings_round_trip_through_their_recorded_form_and_bad_values_are_refused():
    s = DEFAULTS.with_overrides(parse_assignments(["min_slope.loss=inf", "persist.wq_sigma=1", "trend_z=4"]))
    assert s.min_slope["loss"] == math.inf and s.persist["wq_sigma"] == 1 and s.trend_z == 4.0
    assert AlarmSettings.from_dict(s.to_dict()) == s
    old = AlarmSettings.from_dict({"warmup": 6, "window": 5, "min_change": {"loss": 0.5}})  # an older capture's record
    assert (old.warmup, old.window, old.min_history, old.min_rise["loss"]) == (6, 5, 5, 0.5)
    for items, text in ((["nope=1"], "unknown"), (["trend_z=x"], "must be a number"), (["persist.loss=0"], ">= 1"),
                        (["trend_window=2"], ">= 4"), (["min_rise.max_logit=-1"], ">= 0"), (["warmup"], "KEY=VALUE")):
        with pytest.raises(InvalidSetting, match=text):
            DEFAULTS.with_overrides(parse_assignments(items))


def _feed(rule, steps, **series):
    out = []
    for i, step in enumerate(steps):
        out += rule.observe(step, **{m: (v[i] if m != "loss" else v[i]) for m, v in series.items()})
    return out


def test_non_finite_values_alarm_at_once_even_in_the_warmup_and_once_per_excursion():
    rule = AlarmRule(warmup=50)
    table = np.full((2, 3), 5.0)
    table[1, 2] = np.nan  # never measured (e.g. no W_Q found): never an alarm
    raised = []
    for step in range(10):
        t = table.copy()
        if step in (4, 5, 8):
            t[0, 1] = np.nan  # NaN after finite values: non-finite
        if step == 6:
            t[1, 0] = np.inf
        raised += rule.observe(step, loss=math.inf if step == 7 else 2.0, wq_sigma=t)
    got = [(a.step, a.metric, a.layer, a.head, a.rule) for a in raised]
    assert got == [(4, "wq_sigma", 0, 1, "non-finite"), (6, "wq_sigma", 1, 0, "non-finite"),
                   (7, "loss", None, None, "non-finite"), (8, "wq_sigma", 0, 1, "non-finite")]  # 5: same excursion
    assert raised[2].message() == "fa-forensics alarm: step 7: loss = inf (non-finite)"


def test_a_slow_drift_alarms_as_a_trend_where_the_jump_test_stays_silent():
    rng = np.random.default_rng(1)
    steps = np.arange(300)
    base = 8 + 1.5 * rng.standard_normal((300, 2, 2))  # max logits wander by a logit or two from step to step
    drift = base.copy()
    drift[200:, 1, 0] += 0.6 * np.arange(100)  # +0.6 logits a step: slow enough to drag the trailing median
    growth = base.copy()
    growth[:, 0, 1] += 0.6 * steps  # as fast, but from the start: steady growth, never faster than before
    quiet = _feed(AlarmRule(), steps, max_logit=growth)
    assert quiet == []
    alarms = _feed(AlarmRule(), steps, max_logit=drift)
    assert [(a.metric, a.layer, a.head, a.rule) for a in alarms] == [("max_logit", 1, 0, "trend")]
    assert 200 < alarms[0].step <= 225
    assert "trend: rising +0." in alarms[0].message() and "a step over the last 20 monitored steps" in \
        alarms[0].message()
    jump_only = AlarmRule(min_slope={m: math.inf for m in WATCHED})
    assert _feed(jump_only, steps, max_logit=drift) == []  # the jump test alone never sees it


def test_the_rule_over_a_table_equals_the_rule_over_each_cell_alone():
    rng = np.random.default_rng(2)
    S = 160
    x = rng.gamma(4.0, 1.0, size=(S, 2, 3))
    x[90:, 0, 2] += 20.0  # a jump
    x[120:, 1, 1] = np.nan  # goes non-finite
    x[100:, 1, 0] += 0.8 * np.arange(S - 100)  # a drift
    whole = _feed(AlarmRule(warmup=20), range(S), max_logit=x)
    cells = []
    for i in range(2):
        for j in range(3):
            for a in _feed(AlarmRule(warmup=20), range(S), max_logit=x[:, i:i + 1, j:j + 1]):
                cells.append((a.step, a.rule, i, j, repr(a.value)))
    assert sorted((a.step, a.rule, a.layer, a.head, repr(a.value)) for a in whole) == sorted(cells)
    assert {a.rule for a in whole} == {"jump", "trend", "non-finite"}


def test_recorded_codes_read_back_as_the_same_alarms_and_the_lead_is_named_the_same_everywhere():
    rng = np.random.default_rng(3)
    S = 120
    series = {"max_logit": 6 + rng.standard_normal((S, 2, 2)), "wq_sigma": 1 + 0.01 * rng.standard_normal((S, 2, 2)),
              "top1_prob": 0.3 + 0.01 * rng.standard_normal((S, 2, 2))}
    loss = 3 + 0.05 * rng.standard_normal(S)
    series["wq_sigma"][80:, 1] *= 20  # W_Q of layer 1 times 20
    series["max_logit"][80:, 1] *= 20
    loss[100] = np.nan
    rule = AlarmRule()
    timeline = {"step": np.arange(S), "loss": loss, **series}
    rows: dict[str, list] = {}
    raised = []
    for i in range(S):
        alarms = rule.observe(i, loss=float(loss[i]), **{m: v[i] for m, v in series.items()})
        raised += alarms
        codes = alarm_codes(alarms, {"loss": (), **{m: (2, 2) for m in series}})
        for name, c in codes.items():
            rows.setdefault(name, []).append(c)
    timeline.update({k: np.stack(v) for k, v in rows.items()})
    records = recorded_alarms(timeline)
    assert _comparable(records) == _comparable(sorted([a.to_json() for a in raised], key=lead_key))
    first = lead(raised)
    assert records[0] == first.to_json()
    assert first.message().startswith(f"fa-forensics alarm: {describe(records[0]).split(' (')[0]} (")
    assert {(r["step"], r["metric"], r["layer"]) for r in records if r["step"] == 82} >= {(82, "max_logit", 1),
                                                                                          (82, "wq_sigma", 1)}
    assert any(r["metric"] == "loss" and r["rule"] == "non-finite" and r["step"] == 100 for r in records)
    # the rule replayed over the stored timeline decides exactly what the capture decided
    replayed = replay_rule(AlarmRule(), timeline["step"], timeline["loss"], **series)
    assert _comparable([a.to_json() for a in replayed]) == _comparable([a.to_json() for a in raised])


def _comparable(records: list[dict]) -> list[dict]:
    return [{**r, "value": repr(r["value"])} for r in records]  # NaN == NaN


def test_trend_scales_are_finite_where_the_values_are():
    assert np.isfinite(trend_scale("top1_prob", np.array([0.0, 0.5, 1.0]))).all()
    assert np.isfinite(trend_scale("wq_sigma", np.array([0.0, 1e-300, 1e300]))).all()
    assert np.isnan(trend_scale("max_logit", np.array([np.inf, np.nan]))).all()
    assert Alarm(step=1, metric="wq_sigma", value=1.5e36, baseline=0.75, z=3e36, layer=0,
                 head=1).message() == ("fa-forensics alarm: step 1 layer 0 head 1: wq_sigma = 1.5e+36 (jump: 2e+36× "
                                       "the trailing median 0.75, robust z = 3e+36)")
