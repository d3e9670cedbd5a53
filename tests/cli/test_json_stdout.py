"""`--json -`: the standard output is the one JSON object (a pipe reads it), every other line goes to stderr."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa_forensics.commands.common import json_goes_to_stdout

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, expected", [
    (["info", "d.zarr", "--json", "-"], True),
    (["info", "d.zarr", "--json=-"], True),
    (["report", "d.zarr", "--json", "/dev/stdout", "--out", "r"], True),
    (["info", "d.zarr", "--json", "out.json"], False),
    (["info", "d.zarr", "--json", "/dev/stderr"], False),
    (["capture", "--out", "r.zarr", "--", "python", "train.py", "--json", "-"], False),  # the script's own option
])
def test_which_command_lines_send_their_json_to_stdout(argv, expected):
    assert json_goes_to_stdout(argv) is expected


@pytest.mark.parametrize("command", [("info",), ("delta-bias", "--preset", "bf16")], ids=" ".join)
def test_json_to_stdout_is_the_whole_standard_output(make_dump, command):
    dump = make_dump(steps=(0,))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "fa_forensics", command[0], str(dump), *command[1:], "--json", "-"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)  # nothing but the object
    assert isinstance(payload, dict) and "warnings" in payload
    assert run.stderr.strip(), "the tables and lines a person reads are still printed, on stderr"
