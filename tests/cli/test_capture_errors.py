"""Capture and demo-train refuse bad arguments with one line and exit 2, before anything is written."""
from __future__ import annotations

import sys

import pytest
import torch
from typer.testing import CliRunner

import fa_forensics
from fa_forensics.capture import CaptureError, parse_batch
from fa_forensics.cli import app
from fa_forensics.demo.model import GPT, GPTConfig


@pytest.mark.parametrize(
    "args, message",
    [
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--", "python", "{tmp}/missing.py"],
         "no training script at"),
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--attention-modules", "(", "--", "python", "{tmp}/t.py"],
         "not a valid regular expression"),
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--batch", "5:2", "--", "python", "{tmp}/t.py"],
         "'5:2' selects no sample"),
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--batch", "-1", "--", "python", "{tmp}/t.py"],
         "selects no sample"),
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--alarm", "--", "python", "{tmp}/t.py"],
         "--alarm needs --monitor-every N: the alarm watches the monitor's statistics"),
        (["capture", "--out", "{tmp}/r.zarr", "--monitor-every", "1", "--ring", "4", "--", "python", "{tmp}/t.py"],
         "--ring needs --alarm and --monitor-every N: the ring keeps recent steps"),
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--attention-modules", "(", "--", "python", "{tmp}/t.py"],
         "--attention-modules: '(' is not a valid regular expression"),
        (["capture", "--out", "{tmp}/r.zarr", "--steps", "1", "--", sys.executable, "-m", "no_such_module_here"],
         "no module named 'no_such_module_here'"),
        (["demo-train", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["demo-train", "--lr", "-1"], "--lr must be a positive number"),
    ],
)
def test_bad_capture_arguments_give_one_line_and_leave_nothing(args, message, tmp_path):
    (tmp_path / "t.py").write_text("print('training')\n")
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "r.zarr").exists()


def test_a_batch_slice_beyond_the_batch_is_refused_at_the_first_recorded_call(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, attention="sdpa"))
    with pytest.raises(CaptureError, match="batch: 5:7 selects no sample of layer 0's batch of 2"):
        with fa_forensics.capture(model, out=tmp_path / "r.zarr", steps=[0], batch=slice(5, 7)):
            idx = torch.randint(0, 256, (2, 16))
            model(idx, idx)[1].backward()
    assert not (tmp_path / "r.zarr").exists()  # a failed run that wrote nothing leaves no store behind
    assert parse_batch("2") == slice(2, 3) and parse_batch("0:") == slice(0, None)
