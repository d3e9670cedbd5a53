"""The alarm's defaults on injected instabilities: a tiny bf16 GPT (2 layers, width 64, 4 heads, context 64)
trained 300 steps on stdlib bytes, monitored every step with the alarm on (the whole batch, as `capture`
does), an instability injected from step 200 (tests/data/monitor_scenarios/gpt_scenarios.py). Growing
query logits (1.15x a step) alarm by step 225; an LR jump, W_Q x20 and x1e36 within 2 steps; a slow sink-like
drift of the queries through the trend test; stable controls (three seeds) never. docs/monitor.md tabulates
the steps (benchmarks/monitor_alarm_scenarios.py measures them over more seeds)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fa_forensics

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "monitor_scenarios" / "gpt_scenarios.py"
AT = 200
# scenario -> (the latest step its first alarm may come at, the rule that must raise it)
EXPECTED = {"logit-growth": (225, None), "lr-jump": (AT + 5, None), "wq-x20": (AT + 2, "jump"),
            "wq-x1e36": (AT + 2, "jump"), "sink-drift": (AT + 35, "trend")}


def _scenarios():
    spec = importlib.util.spec_from_file_location("gpt_scenarios", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alarms(tmp_path: Path, scenario: str, seed: int = 0) -> list:
    scenarios = _scenarios()
    sessions = []

    def around(model):
        sessions.append(fa_forensics.capture(model, out=tmp_path / f"{scenario}-{seed}.zarr", steps=None, batch=None,
                                             monitor_every=1, alarm=True, alarm_steps=0))
        return sessions[-1]

    torch.set_num_threads(1)
    scenarios.train(scenario, steps=300, at=AT, seed=seed, around=around)
    return sessions[0].alarms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stable_run_never_alarms(tmp_path, seed):
    alarms = _alarms(tmp_path, "control", seed)
    assert alarms == [], [a.message() for a in alarms[:3]]


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_an_injected_instability_alarms_early_and_not_before(tmp_path, scenario):
    latest, rule = EXPECTED[scenario]
    alarms = _alarms(tmp_path, scenario)
    assert alarms, scenario
    first = alarms[0]  # in step order, then as every reader names them
    assert AT <= first.step <= latest, first.message()
    if rule is not None:
        assert first.rule == rule, first.message()
    if scenario.startswith("wq-"):
        assert first.layer == 1  # the layer whose W_Q was changed
