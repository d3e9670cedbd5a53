"""CaptureSettings: one default per option (the commands read theirs from it), checks at construction, JSON round
trip, unknown keys refused in one line."""
from __future__ import annotations

import json
from dataclasses import fields

import click
import pytest
import typer

from fa_forensics.capture import CaptureSettings, InvalidCaptureSetting, capture
from fa_forensics.capture.selection import CaptureError, StepSet

# Options of the commands whose default is theirs on purpose: `capture` needs --out, takes --steps as optional
# beside --monitor-every and records the whole batch unless told (its help says so).
COMMAND_OWN_DEFAULTS = {"capture": {"out", "steps", "batch", "attention_modules"}}
DEMO_OPTION_OF_FIELD = {"capture_batch": "batch", "overwrite": "overwrite", "alarm_steps": "alarm_steps",
                        "ring": "ring", "monitor_every": "monitor_every"}


def _params(name: str) -> dict[str, click.Parameter]:
    from fa_forensics.cli import app

    command = typer.main.get_command(app).commands[name]
    return {p.name: p for p in command.params}


def test_capture_command_defaults_are_the_settings_defaults():
    params = _params("capture")
    defaults = CaptureSettings()
    shared = [f.name for f in fields(CaptureSettings) if f.name in params
              and f.name not in COMMAND_OWN_DEFAULTS["capture"]]
    assert {"micro_batch", "overwrite", "allow_other_model", "alarm_steps", "ring", "monitor_every"} <= set(shared)
    for name in shared:  # the option's default, taken as the setting, is the setting's default
        assert defaults.replace(**{name: params[name].default}) == defaults, name
    assert [params[n].default for n in ("alarm_steps", "ring", "micro_batch")] == [3, 0, 0]


def test_demo_train_defaults_are_the_settings_defaults():
    params = _params("demo-train")
    defaults = CaptureSettings()
    for option, field in DEMO_OPTION_OF_FIELD.items():
        assert CaptureSettings(**{field: params[option].default}) == defaults, option


def test_settings_travel_as_json_and_come_back_equal():
    settings = CaptureSettings(out="run.zarr", steps="1,5:9,20:40:5", layers="0,2", heads=[1], batch=None,
                               micro_batch=1, monitor_every=2, alarm={"warmup": 4}, alarm_steps=2, ring=1,
                               attention=["attention:FlashAttentionFunction,layout=BTHD"], softmax="STABLE=1",
                               run_id="abc")
    back = CaptureSettings.from_json(settings.to_json())
    assert back == settings
    assert back.steps == StepSet.of([1, 5, 6, 7, 8, 20, 25, 30, 35]) and back.layers == (0, 2) and back.batch is None
    assert back.alarm.warmup == 4 and back.attention[0].to_text() == "attention:FlashAttentionFunction,layout=BTHD"
    assert json.loads(settings.to_json())["steps"] == "1,5:9,20:40:5"


def test_settings_left_out_of_the_json_take_their_defaults():
    assert CaptureSettings.from_json('{"out": "a.zarr"}') == CaptureSettings(out="a.zarr")


@pytest.mark.parametrize("text, said", [
    ('{"out": "a.zarr", "alarm_step": 3}', "unknown capture setting(s) 'alarm_step'"),
    ("[1, 2]", "must be a JSON object"), ("{out", "not valid JSON")])
def test_bad_json_is_refused_in_one_line(text, said):
    with pytest.raises(CaptureError, match=r"^[^\n]*$") as caught:
        CaptureSettings.from_json(text)
    assert said in str(caught.value)


@pytest.mark.parametrize("options, setting", [({"ring": 2}, "ring"), ({"alarm": True}, "alarm"),
                                              ({"monitor_every": 0}, "monitor_every"),
                                              ({"attention_modules": "("}, "attention_modules"),
                                              ({"monitor_tensorboard": "tb"}, "monitor_tensorboard")])
def test_settings_that_cannot_work_are_refused_at_construction(options, setting):
    with pytest.raises(InvalidCaptureSetting) as caught:
        CaptureSettings(**options)
    assert caught.value.setting == setting


def test_the_library_call_takes_the_same_options_positionally_and_by_name(tmp_path):
    by_name = capture(None, out=tmp_path / "a.zarr", steps="3", layers=[0], batch=None)
    positional = capture(None, tmp_path / "a.zarr", "3", [0], None, None)
    assert by_name.settings == positional.settings and by_name.selection.batch is None
    with pytest.raises(CaptureError, match="writer_duty"):
        capture(None, out=tmp_path / "b.zarr", writer_duty=2)


def test_the_commands_read_the_defaults_without_importing_torch():
    import subprocess
    import sys

    probe = ("import sys; from fa_forensics.capture.settings import default_of; import fa_forensics.commands.capture; "
             "print(default_of('alarm_steps'), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["3", "False"], done.stderr[-2000:]
