"""The monitor's timeline in TensorBoard: event files written while a real run trains (and from a recorded
timeline), read back with TensorBoard's own EventAccumulator, equal to the store's timeline."""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import fa_forensics
from fa_forensics.cli import app
from fa_forensics.dump import open_dump

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tiny_training import monitored_run

REPO = Path(__file__).resolve().parents[3]
STEPS, NAN_AT = 8, 6


def _run(tmp_path: Path) -> tuple[Path, Path]:
    """A real monitored run of the tiny demo GPT whose loss is NaN at step NAN_AT (it alarms there)."""
    out, board = tmp_path / "run.zarr", tmp_path / "tb"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitored_run(out, STEPS, nan_at=NAN_AT, steps=None, monitor_every=1, alarm=True, alarm_steps=0,
                      monitor_tensorboard=board)
    return out, board


def _scalars(board: Path) -> tuple[dict, dict]:
    acc = EventAccumulator(str(board))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"]}
    return scalars, texts


def _check(scalars: dict, texts: dict, tl: dict) -> None:
    steps = tl["step"].tolist()
    assert [s for s, _ in scalars["fa-forensics/loss"]] == steps
    np.testing.assert_allclose([v for _, v in scalars["fa-forensics/loss"]], tl["loss"].astype(np.float32),
                               rtol=0, equal_nan=True)
    for metric in ("max_logit", "top1_prob", "near_max_ties", "p_one_extra", "wq_sigma"):
        for layer in (0, 1):
            for head in (0, 1):
                got = [v for _, v in scalars[f"{metric}/layer_{layer}/head_{head}"]]
                np.testing.assert_array_equal(got, tl[metric][:, layer, head].astype(np.float32))
        per_layer = [v for _, v in scalars[f"{metric}/layer_1"]]
        want = tl[metric][:, 1].sum(axis=1) if metric in ("near_max_ties", "p_one_extra") else tl[metric][:, 1].max(1)
        np.testing.assert_allclose(per_layer, want.astype(np.float32), rtol=1e-6)
    counts = dict(scalars["fa-forensics/alarms"])
    assert counts[NAN_AT] == 1 and sum(counts.values()) == 1
    (step, line), = texts["fa-forensics/alarm/text_summary"]
    assert step == NAN_AT and f"step {NAN_AT}: loss = nan (non-finite)" in line


def test_a_monitored_run_writes_its_timeline_to_tensorboard_as_it_trains(tmp_path):
    out, board = _run(tmp_path)
    tl = open_dump(out).timeline
    assert math.isnan(tl["loss"][NAN_AT])
    _check(*_scalars(board), tl)
    # the same from the recorded timeline, through `timeline --tensorboard`
    again = tmp_path / "again"
    r = CliRunner().invoke(app, ["timeline", str(out), "--tensorboard", str(again)])
    assert r.exit_code == 0, r.output
    _check(*_scalars(again), tl)


@pytest.mark.parametrize("argv", [
    ["capture", "--out", "x.zarr", "--monitor-every", "1", "--monitor-tensorboard", "tb", "--", "python", "t.py"],
    ["timeline", str(REPO / "sample_dumps" / "demo.zarr"), "--tensorboard", "tb"],
])
def test_without_tensorboard_the_option_is_one_line_naming_the_extra(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # every import of it raises ImportError
    (tmp_path / "t.py").write_text("print('never runs')\n")
    r = CliRunner().invoke(app, argv)
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "needs tensorboard" in text, r.output
    assert text.endswith("pip install 'fa-forensics[tensorboard]'") and "never runs" not in text
    assert not (tmp_path / "x.zarr").exists() and not (tmp_path / "tb").exists()


def test_tensorboard_output_needs_the_monitor(tmp_path):
    from fa_forensics.capture import CaptureError

    with pytest.raises(CaptureError, match="monitor_tensorboard: needs monitor_every"):
        fa_forensics.capture(None, out=tmp_path / "a.zarr", steps=[1], monitor_tensorboard=tmp_path / "tb")
