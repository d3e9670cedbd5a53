"""The monitor survives the failure it exists to catch: real training runs under `capture --monitor-every 1
--alarm --ring` in which W_Q goes NaN or huge, activations go NaN or the loss infinite. The run goes on (or
ends as the script ends it), the bad step is in the timeline as what it was, it alarms at once, the ring
writes it and the steps before it, and the capture's line, the timeline and its JSON name one alarm alike."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.monitor.alarm import describe

pytestmark = pytest.mark.slow  # starts monitored training scripts

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "monitor_scenarios" / "gpt_scenarios.py"
AT, STEPS = 20, 26
OPTIONS = ["--monitor-every", "1", "--alarm", "--alarm-warmup", "10", "--alarm-steps", "2", "--ring", "3",
           "--layers", "1", "--batch", "0:2"]


def _capture(tmp_path: Path, scenario: str, *script_options: str):
    out, js, losses = tmp_path / f"{scenario}.zarr", tmp_path / f"{scenario}.json", tmp_path / f"{scenario}.txt"
    result = subprocess.run(
        [sys.executable, "-m", "fa_forensics.cli", "capture", "--out", str(out), *OPTIONS, "--json", str(js), "--",
         sys.executable, str(SCRIPT), "--scenario", scenario, "--steps", str(STEPS), "--at", str(AT),
         "--losses", str(losses), *script_options],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    computed = [float(x) for x in losses.read_text().split()]
    return result, open_dump(out), json.loads(js.read_text()), computed


@pytest.mark.parametrize("scenario, first_step, rule, metric", [
    ("wq-nan", AT, "non-finite", "max_logit"),  # the run that died of linalg.eigh inside the monitor
    ("nan-activation", AT, "non-finite", "max_logit"),
    ("inf-loss", AT, "non-finite", "loss"),
    ("wq-x1e36", AT + 2, "jump", "max_logit"),  # finite but huge: a jump, persisting 3 steps
])
def test_a_run_that_goes_bad_is_monitored_through_it(tmp_path, scenario, first_step, rule, metric):
    result, dump, summary, computed = _capture(tmp_path, scenario)
    assert result.returncode == 0, result.stderr  # the monitor never stopped training
    assert "Traceback" not in result.stderr and len(computed) == STEPS
    tl = dump.timeline
    assert tl["step"].tolist() == list(range(STEPS))
    np.testing.assert_array_equal(tl["loss"], computed)  # NaN and inf as the script computed them
    before, bad = tl["wq_sigma"][AT - 1, 1], tl["wq_sigma"][AT, 1]
    if scenario == "wq-nan":
        assert np.isnan(bad).all() and np.isfinite(before).all()
    if scenario == "wq-x1e36":
        np.testing.assert_allclose(bad / before, 1e36, rtol=0.05)  # 1e36 times one more AdamW step: no inf, no crash
    if scenario == "nan-activation":
        assert np.isnan(tl["max_logit"][AT]).all() and np.isfinite(tl["max_logit"][AT - 1]).all()
    if scenario == "inf-loss":
        assert math.isinf(tl["loss"][AT]) and np.isfinite(tl["loss"][AT + 1:]).all()  # training went on
    # one alarm, one description: the capture's line, its --json and `timeline` name the same alarm
    lead = summary["alarms"][0]
    assert (lead["step"], lead["rule"], lead["metric"]) == (first_step, rule, metric), summary["alarms"][:3]
    lines = [line for line in result.stderr.splitlines() if line.startswith("fa-forensics alarm:")]
    assert lines[0].startswith(f"fa-forensics alarm: {describe(lead).removesuffix(f' ({rule})')} ({rule}")
    js = tmp_path / "timeline.json"
    r = CliRunner().invoke(app, ["timeline", str(tmp_path / f"{scenario}.zarr"), "--json", str(js)])
    assert r.exit_code == 0, r.output
    payload = json.loads(js.read_text())
    assert payload["alarms"] == summary["alarms"]
    assert payload["verdict"].startswith(f"the capture's alarm fired at {describe(lead)}")
    # the ring wrote the bad step and the two before it, the alarm the two after it (later alarms, as NaN
    # spreads to other heads, ask for more)
    ring = list(range(first_step - 2, first_step + 1))
    assert dump.steps[:5] == ring + [first_step + 1, first_step + 2] and dump.incomplete_steps == []
    assert [dump.step_attrs(s)["recorded_by"] for s in dump.steps] == ["ring"] * 3 + ["alarm"] * (len(dump.steps) - 3)
    assert dump.read(first_step, 1, "q").shape == (2, 4, 64, 16)


def test_a_script_that_stops_at_a_nan_loss_leaves_the_alarm_the_ring_and_the_timeline(tmp_path):
    result, dump, summary, computed = _capture(tmp_path, "wq-nan", "--stop-on-nonfinite")
    assert result.returncode == 1 and len(computed) == AT + 1  # the script's own exit, at the NaN step
    assert "loss is nan at step 20; stopping" in result.stderr
    assert (f"error: the training command exited with code 1; the steps completed before it and its timeline "
            f"({AT + 1} monitored steps) are kept in") in " ".join(result.stderr.split())
    assert any(line.startswith(f"fa-forensics alarm: step {AT} layer 1 head 0: max_logit = nan (non-finite)")
               for line in result.stderr.splitlines()), result.stderr
    assert dump.timeline["step"].tolist() == list(range(AT + 1)) and summary["alarms"][0]["step"] == AT
    assert dump.steps == [AT - 2, AT - 1, AT] and dump.incomplete_steps == []  # the NaN step and the ones before
    assert np.isnan(dump.read(AT, 1, "q").float()).any() and not np.isnan(dump.read(AT - 1, 1, "q").float()).any()
