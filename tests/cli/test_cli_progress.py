"""Progress in a log: when stderr is not a terminal, a long phase says what it is doing in a plain line every
few seconds ($FA_FORENSICS_PROGRESS_SECONDS), and a short one says nothing."""
from __future__ import annotations

import io
import re
import time

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.commands.progress import INTERVAL_ENV, ProgressLines, progress_interval
from fa_forensics.errors import UserError

LINE = re.compile(r"^(?P<what>[^:]+): (?:(?P<done>\d+)/(?P<total>\d+) \((?P<pct>\d+)%\), )?(?:(?P<msg>.+), )?\d+ s$")


def test_a_long_phase_prints_its_state_every_interval_and_nothing_after_it_ends():
    stream = io.StringIO()
    with ProgressLines("isolate", 4, interval=0.02, stream=stream) as lines:
        for i in range(4):
            time.sleep(0.06)
            lines.advance(f"step {i} layer 0")
    said = stream.getvalue().splitlines()
    time.sleep(0.1)
    assert stream.getvalue().splitlines() == said  # the ticker stopped with the phase
    assert len(said) >= 4
    parsed = [LINE.match(line) for line in said]
    assert all(parsed), said
    done = [int(m["done"]) for m in parsed]
    assert done == sorted(done) and done[-1] >= 3 and {m["total"] for m in parsed} == {"4"}
    assert any(m["msg"] == "step 2 layer 0" for m in parsed)


def test_a_phase_shorter_than_the_interval_says_nothing():
    stream = io.StringIO()
    with ProgressLines("delta-bias", 3, interval=5.0, stream=stream) as lines:
        for _ in range(3):
            lines.advance()
    assert stream.getvalue() == ""


def test_an_error_in_the_phase_is_the_last_thing_said():
    stream = io.StringIO()
    with pytest.raises(ValueError), ProgressLines("pv-trace", 2, interval=0.01, stream=stream):
        time.sleep(0.05)
        raise ValueError("bad row")
    said = stream.getvalue()
    time.sleep(0.05)
    assert said and stream.getvalue() == said


@pytest.mark.parametrize("raw, interval", [("", 5.0), ("2.5", 2.5), ("0", 0.0)])
def test_the_interval_comes_from_the_environment(raw, interval, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, raw)
    assert progress_interval() == interval


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_interval_is_a_user_error_naming_the_variable(raw, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, raw)
    with pytest.raises(UserError, match=INTERVAL_ENV):
        progress_interval()


def test_zero_turns_the_lines_off():
    stream = io.StringIO()
    with ProgressLines("report", 7, interval=0.0, stream=stream):
        time.sleep(0.05)
    assert stream.getvalue() == ""


def test_an_analysis_command_writes_progress_lines_to_a_log(planted_dump, monkeypatch):
    """CliRunner's stderr is not a terminal, as a log file is not."""
    monkeypatch.setenv(INTERVAL_ENV, "0.01")
    res = CliRunner().invoke(app, ["delta-bias", str(planted_dump), "--head", "1", "--preset", "bf16"])
    assert res.exit_code == 0, res.output
    said = [LINE.match(line) for line in res.stderr.splitlines() if line.startswith("delta-bias")]
    assert said and all(said) and {m["total"] for m in said} == {"3"}  # one work item per step
    assert not any(LINE.match(line) for line in res.stdout.splitlines())  # stdout keeps to the result


def test_pcast_simulation_writes_its_phase_to_a_log(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.01")
    res = CliRunner().invoke(app, ["pcast", "--seq", "256", "--sink-strength", "4,8", "--seeds", "2", "--queries", "2",
                                   "--head-dim", "16"])
    assert res.exit_code == 0, res.output
    assert any(line.startswith("pcast: simulating the FP8 P-cast kernel: ") for line in res.stderr.splitlines())


def test_without_the_variable_a_quick_command_prints_no_progress(planted_dump, monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    res = CliRunner().invoke(app, ["delta-bias", str(planted_dump), "--step", "0", "--head", "1", "--preset", "bf16"])
    assert res.exit_code == 0 and res.stderr == "", res.stderr


@pytest.mark.slow  # the report runs all seven analyses (about 6 s of CPU)
def test_report_says_which_analysis_runs(make_dump, tmp_path, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.01")
    dump = make_dump(steps=(0,), heads=2, seq=16, head_dim=8)
    res = CliRunner().invoke(app, ["report", str(dump), "--out", str(tmp_path / "rep"), "--preset", "bf16"])
    assert res.exit_code == 0, res.output
    said = [m for m in (LINE.match(line) for line in res.stderr.splitlines()) if m and m["what"] == "report"]
    running = [m["msg"].removeprefix("running ") for m in said if m["msg"] and m["msg"].startswith("running ")]
    assert said and {m["total"] for m in said} == {"7"}
    assert running[0] == "isolate" and len(set(running)) >= 3, running  # the phases, in the report's order
