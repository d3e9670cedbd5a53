"""The background writer's bounds: arrays of selected steps wait (never dropped); held steps (the ring's,
those recorded after an alarm) are handed over whole within max_held_mb or dropped whole, said in one line
naming the step, and never make training wait."""
from __future__ import annotations

import warnings

import pytest
import torch

import fa_forensics
from fa_forensics.capture import CaptureError
from fa_forensics.capture.ring import RingArray, RingStep
from fa_forensics.capture.writer import BackgroundWriter
from fa_forensics.dump import DumpWriter, open_dump


def _held(step: int, mb: float) -> RingStep:
    n = int(mb * 2 ** 20 / 4 / 4)
    held = RingStep(step, loss=1.5)
    for name in ("q", "k", "v", "o"):
        held.arrays.append(RingArray(0, name, torch.randn(1, 1, n // 8, 8), None, {"module": "attn"}))
    return held


def test_held_steps_are_written_whole_or_dropped_whole(tmp_path):
    writer = BackgroundWriter(DumpWriter(tmp_path / "run.zarr", {"model": {}}), held_bytes=3 << 20)
    first, second = _held(4, 2.0), _held(5, 2.0)
    assert writer.put_held_step(first.step, first.arrays, loss=first.loss, recorded_by="ring")
    # 4 MiB would be held if the second came now: dropped whole unless the first is written by then
    accepted = writer.put_held_step(second.step, second.arrays, loss=second.loss, recorded_by="ring")
    writer.close()
    d = open_dump(tmp_path / "run.zarr")
    assert d.incomplete_steps == []  # nothing half-written either way
    assert d.steps == ([4, 5] if accepted else [4])
    assert d.step_attrs(4)["recorded_by"] == "ring" and d.step_attrs(4)["loss"] == 1.5
    assert torch.equal(d.read(4, 0, "q"), first.arrays[0].tensor)


def test_a_held_step_larger_than_the_bound_is_dropped_and_said_by_the_session(tmp_path):
    with pytest.warns(fa_forensics.capture.events.CaptureWarning,
                      match=r"step 7 \(held by the ring for the alarm at step 9, 4.0 MB\) was dropped: .*bound is 1 MB "
                            r"\(max_held_mb\); training goes on"):
        with fa_forensics.capture(None, out=tmp_path / "run.zarr", steps=[100], max_held_mb=1) as cap:
            assert cap._write_held(_held(7, 4.0), alarm_step=9) is False
            assert cap._write_held(_held(8, 0.5), alarm_step=9) is True
    assert open_dump(tmp_path / "run.zarr").steps == [8]


def test_selected_arrays_wait_for_room_and_bad_bounds_are_refused(tmp_path):
    writer = BackgroundWriter(DumpWriter(tmp_path / "run.zarr", {"model": {}}), max_queue=2, duty=1.0)
    writer.register_step(0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for name in ("q", "k", "v", "o", "do"):  # more than max_queue: the later ones wait, none is dropped
            writer.put_array(0, 0, name, torch.randn(1, 2, 16, 8), layer_attrs={"module": "attn"})
    writer.put_complete(0)
    writer.close()
    assert sorted(open_dump(tmp_path / "run.zarr")._array_names(0, 0)) == ["do", "k", "o", "q", "v"]
    for kwargs in ({"duty": 0}, {"duty": 1.5}):
        with pytest.raises(CaptureError):
            BackgroundWriter(DumpWriter(tmp_path / f"b{kwargs['duty']}.zarr", {"model": {}}), **kwargs)
    for option in ({"max_held_mb": 0}, {"writer_duty": 0}):
        with pytest.raises(CaptureError):
            fa_forensics.capture(None, out=tmp_path / "c.zarr", steps=[0], **option)
