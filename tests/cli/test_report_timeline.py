"""`report` with a timeline: its section comes first (what the capture saw and decided while training), a dump
that holds only a timeline gets a report (the step analyses skipped with a note), and a dump without one has no
timeline section."""
from __future__ import annotations

import json
import warnings

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.report.run import NO_STEP_NOTE, SECTIONS, run_all
from tiny_training import monitored_run

STEPS, NAN_AT = 10, 7


def _timeline_only(tmp_path):
    """A real monitored run (tiny demo GPT) whose loss goes NaN at step NAN_AT: the alarm fires there."""
    out = tmp_path / "timeline_only.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitored_run(out, STEPS, nan_at=NAN_AT, steps=None, monitor_every=1, alarm=True, alarm_steps=0)
    return out


@pytest.mark.slow  # about 3 s of CPU or more
def test_a_dump_holding_only_a_timeline_gets_a_report_led_by_it(tmp_path):
    out = _timeline_only(tmp_path)
    assert open_dump(out).steps == []
    page, js = tmp_path / "report", tmp_path / "report.json"
    r = CliRunner().invoke(app, ["report", str(out), "--out", str(page), "--json", str(js)])
    assert r.exit_code == 0, r.output
    sections = json.loads(js.read_text())["sections"]
    assert sections[0]["name"] == "timeline" and sections[0]["ok"], sections[0]
    timeline = sections[0]["json"]
    assert timeline["alarms"][0]["step"] == NAN_AT and timeline["alarms"][0]["metric"] == "loss"
    assert timeline["verdict"].startswith(f"the capture's alarm fired at step {NAN_AT}: loss = nan (non-finite)")
    assert len(sections[0]["figures"]) == 6
    for s in sections[1:]:
        assert not s["ok"] and s["note"] == NO_STEP_NOTE, s["name"]
    html = (page / "index.html").read_text()
    diagnosis = timeline["diagnosis"]  # the loss went non-finite with no precursor: the timeline cannot say why
    assert diagnosis["mechanism"] == "loss-spike" and diagnosis["step"] == NAN_AT == diagnosis["loss_spike_step"]
    summary = json.loads(js.read_text())["summary"]
    assert summary["cause"] == "loss-spike" and summary["lead"].startswith(f"A loss spike without a precursor from "
                                                                           f"step {NAN_AT}. What to do: look at")
    assert summary["actions"][-1]["what"] == f"Capture the steps the monitor flagged ({NAN_AT}) in full"
    assert "biased-rounding" not in summary["causes"] and "nothing to fix" not in summary["answer"]
    assert html.index("<h2 id='timeline'>") < html.index("<h2 id='isolate'>")
    assert f"the capture&#x27;s alarm fired at step {NAN_AT}: loss = nan (non-finite)" in html
    assert all((page / f).is_file() for f in sections[0]["figures"])


def test_a_dump_without_a_timeline_has_no_timeline_section(make_dump, tmp_path):
    dump = open_dump(make_dump("plain.zarr", steps=(0,)))
    assert SECTIONS[0].name == "timeline"
    assert run_all(dump, dump.path, tmp_path / "r", sections=SECTIONS[:1]) == []
