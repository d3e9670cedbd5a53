"""The alarm on instabilities that arise on their own (tests/helpers/unstable_training.py, after Wortsman et al.
2023), under `capture(monitor_every=1, alarm=True, ring=4)` at default settings: attention-logit growth alarms at
least 25 steps before its loss spike, output-logit divergence before its spike, healthy controls never; one
episode, one line; every step an alarm announced is in the store or its drop is written there and shown by
`info`, `verify` and `timeline`. benchmarks/natural_instabilities.py measures the whole set (docs/monitor.md)."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

import fa_forensics
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from tests.helpers.unstable_training import HEALTHY, UNSTABLE, loss_spike, train

pytestmark = pytest.mark.slow
SPECS = {s.name: s for s in (*UNSTABLE, *HEALTHY)}


def _run(tmp_path, name, steps, seed=0, **capture_options):
    spec = replace(SPECS[name], steps=steps, seed=seed)
    out = tmp_path / f"{name}-{seed}.zarr"
    sessions = []

    def around(model):
        sessions.append(fa_forensics.capture(model, out=out, steps=None, batch=None, monitor_every=1, alarm=True,
                                             alarm_steps=3, ring=4, **capture_options))
        return sessions[-1]

    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(spec, around=around)
    lines = [str(w.message) for w in caught if type(w.message).__name__ in ("AlarmWarning", "CaptureWarning")]
    return sessions[0], losses, lines, out


def _announced_steps_are_kept_or_dropped_in_the_store(out):
    dump = open_dump(out)
    monitor = dump.attrs["capture"]["monitor"]
    dropped = {d["step"] for d in monitor["dropped_steps"]}
    for episode in monitor["episodes"]:
        for step in (*episode["recorded"], *episode["ring"]):
            assert step in dump.steps or step in dropped, (step, dump.steps, dropped)
    return dump, monitor


def test_attention_logit_growth_alarms_25_steps_before_its_spike_in_one_episode(tmp_path):
    cap, losses, lines, out = _run(tmp_path, "attn-logit-growth", steps=150)
    spike = loss_spike(losses)
    first = cap.alarms[0]
    assert spike is not None and spike - first.step >= 25, (spike, first.message())
    assert (first.metric, first.rule) == ("max_logit", "scale")
    assert len(cap.alarms) > 5 and len([line for line in lines if "alarm:" in line]) == 1  # one episode, one line
    dump, monitor = _announced_steps_are_kept_or_dropped_in_the_store(out)
    assert len(monitor["episodes"]) == 1 and monitor["qk_norm"] == [False, False]
    assert set(dump.timeline) >= {"attn_entropy", "output_lse"}


def test_output_logit_divergence_alarms_before_its_spike(tmp_path):
    cap, losses, _, out = _run(tmp_path, "output-logit-divergence", steps=60)
    spike = loss_spike(losses)
    first = cap.alarms[0]
    assert spike is not None and first.step < spike, (spike, first.message())
    assert first.metric == "output_lse"
    assert open_dump(out).attrs["capture"]["monitor"]["qk_norm"] == [True, True]


@pytest.mark.parametrize("name,seed", [("healthy-qk-norm", 0), ("healthy-low-lr", 2)])
def test_healthy_runs_never_alarm(tmp_path, name, seed):
    cap, losses, lines, _ = _run(tmp_path, name, steps=160, seed=seed)
    assert loss_spike(losses) is None
    assert cap.alarms == [] and lines == [], [a.message() for a in cap.alarms[:3]]


def test_a_drop_is_written_into_the_store_said_once_and_shown(tmp_path):
    cap, _, lines, out = _run(tmp_path, "output-logit-divergence", steps=30, max_held_mb=0.01)
    dump, monitor = _announced_steps_are_kept_or_dropped_in_the_store(out)
    dropped = monitor["dropped_steps"]
    assert dropped and all(d["episode"] == cap.alarms[0].step for d in dropped)
    assert len([line for line in lines if "was dropped" in line]) == 1
    runner = CliRunner()
    for command in (["info", str(out)], ["verify", str(out)], ["timeline", str(out)]):
        result = runner.invoke(app, command, terminal_width=400)
        assert f"step {dropped[0]['step']}" in result.output or f"{dropped[0]['step']}," in result.output, command
        assert "alarm episode from step" in " ".join(result.output.split()), command
