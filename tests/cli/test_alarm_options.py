"""The alarm's warm-up, window and threshold as options: a short monitored run alarms when its warm-up is
short, `timeline` replays the rule with any settings, and bad values are one line with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app

from test_monitor_cli import SCRIPT  # the unmodified training script with planted ties from step tie_from on

pytestmark = pytest.mark.slow  # starts monitored training scripts

runner = CliRunner()
STEPS, TIE_FROM = 20, 12


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A 20-step monitored run whose keys tie from step 12 on, captured with --alarm-warmup 6."""
    tmp = tmp_path_factory.mktemp("alarm")
    script, out, js = tmp / "train.py", tmp / "short.zarr", tmp / "capture.json"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "fa_forensics.cli", "capture", "--out", str(out), "--monitor-every", "1", "--alarm",
         "--alarm-warmup", "6", "--alarm-steps", "0", "--json", str(js),
         "--", sys.executable, str(script), str(STEPS), str(tmp / "losses.txt"), str(TIE_FROM)],
        capture_output=True, text=True, timeout=240, cwd=tmp)
    assert result.returncode == 0, result.stderr
    return out, json.loads(js.read_text()), result.stderr


def test_a_short_run_alarms_with_a_short_warmup(short_run):
    out, summary, stderr = short_run
    # the tie count is out at steps 12, 13, 14 (persist 3): one alarm at 14, well before the default warm-up of 50
    assert summary["alarm_steps"] == [TIE_FROM + 2], stderr
    assert "fa-forensics alarm: step 14" in stderr and "warm-up" not in stderr


def test_timeline_replays_the_rule_and_says_when_the_warmup_covers_the_run(short_run, tmp_path):
    out, _, stderr = short_run
    js = tmp_path / "t.json"
    r = runner.invoke(app, ["timeline", str(out), "--json", str(js)])  # the capture's own settings (warm-up 6)
    d = json.loads(js.read_text())
    assert r.exit_code == 0 and d["alarm_rule"]["warmup"] == 6 and d["capture_alarm_rule"]["warmup"] == 6, r.output
    assert [a["step"] for a in d["rule_alarms"]][:1] == [TIE_FROM + 2] and d["alarm_steps"] == [TIE_FROM + 2]
    lead = d["alarms"][0]  # what the capture recorded, read back
    assert (lead["step"], lead["metric"], lead["rule"]) == (TIE_FROM + 2, "near_max_ties", "jump")
    where = f"step 14 layer {lead['layer']} head {lead['head']}: near_max_ties = {lead['value_text']}"
    assert d["verdict"].startswith(f"the capture's alarm fired at {where} (jump)")
    assert f"fa-forensics alarm: {where} (jump:" in stderr  # one alarm, one description: the capture's line
    assert "verdict: the capture's alarm fired" in " ".join(r.output.split())
    r = runner.invoke(app, ["timeline", str(out), "--alarm-warmup", "50", "--json", str(js)])
    d = json.loads(js.read_text())
    assert r.exit_code == 0 and d["rule_alarms"] == [], r.output
    assert ("only a non-finite value was possible: the rule's warm-up (50 monitored steps) covers all 20 monitored "
            "steps") in d["verdict"]
    assert d["alarms"][0]["step"] == TIE_FROM + 2  # the capture's decision stays what it was


@pytest.mark.parametrize("option, value, text", [
    ("--alarm-warmup", "-1", "--alarm-warmup: must be a whole number of monitored steps >= 0"),
    ("--alarm-window", "2", "--alarm-window: must be a whole number of monitored steps >= 3"),
    ("--alarm-z", "nan", "--alarm-z: must be a finite robust z-score > 0"),
    ("--alarm-z", "0", "--alarm-z: must be a finite robust z-score > 0"),
    ("--alarm-set", "trend_z=0", "--alarm-set: trend_z must be a finite z-score > 0"),
    ("--alarm-set", "nope=1", "--alarm-set: unknown setting 'nope'; the settings are warmup, window"),
    ("--alarm-set", "persist.loss", "--alarm-set: 'persist.loss' is not KEY=VALUE"),
])
def test_bad_alarm_settings_are_one_line_and_exit_2(tmp_path, option, value, text):
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    for command in (["capture", "--out", str(tmp_path / "x.zarr"), "--monitor-every", "1", "--alarm", option, value,
                     "--", sys.executable, str(script)],
                    ["timeline", str(tmp_path / "missing.zarr"), option, value]):
        r = runner.invoke(app, command)
        assert r.exit_code == 2 and text in " ".join(r.output.split()), r.output
        assert "Traceback" not in r.output and "never runs" not in r.output
    assert not (tmp_path / "x.zarr").exists()


def test_alarm_settings_without_the_alarm_are_one_line(tmp_path):
    r = runner.invoke(app, ["capture", "--out", str(tmp_path / "x.zarr"), "--monitor-every", "1", "--alarm-warmup", "5",
                            "--", sys.executable, str(tmp_path / "t.py")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--alarm-warmup set the alarm's rule: add --alarm" in text, r.output


def test_a_run_inside_the_warmup_is_warned_about():
    from fa_forensics.commands.capture import warn_if_warmup_covers_run
    from fa_forensics.monitor.alarm import AlarmRule

    with pytest.warns(UserWarning, match=r"covered all 20 monitored steps, so only a non-finite value could fire"):
        warn_if_warmup_covers_run(AlarmRule(), 20)
