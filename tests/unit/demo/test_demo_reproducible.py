"""The demo run reproduces: the same settings train to bit-identical losses and record bit-identical arrays.

Real training runs on the CPU (marked slow): the demo corpus is generated (the same bytes everywhere), the model and
the batches are seeded, and the attention is the emulator's, so a rerun with the same torch gives the same bits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from fa_forensics.dump import open_dump

pytestmark = pytest.mark.slow

ARRAYS = ("q", "k", "v", "o", "do", "x")
STEPS, CAPTURED, LAYERS = 4, (2, 3), (1, 3)


@pytest.fixture
def one_thread():
    """One torch thread, as `demo-train` runs by default (--threads 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _monitored_run(out):
    from fa_forensics.capture.settings import CaptureSettings
    from fa_forensics.demo.train import DemoConfig, train

    settings = CaptureSettings(out=out, steps=f"{CAPTURED[0]}:{CAPTURED[-1] + 1}",
                               layers=",".join(map(str, LAYERS)), batch="0:2", monitor_every=1)
    return train(DemoConfig(steps=STEPS, seed=0, capture=settings))


def test_two_monitored_runs_record_the_same_bits(one_thread, tmp_path):
    a, b = _monitored_run(tmp_path / "a.zarr"), _monitored_run(tmp_path / "b.zarr")
    assert a.losses == b.losses and len(a.losses) == STEPS
    assert a.losses[0] == pytest.approx(5.6, abs=0.05)  # ln 256 ≈ 5.55 at initialisation
    da, db = open_dump(tmp_path / "a.zarr"), open_dump(tmp_path / "b.zarr")
    assert da.steps == db.steps == list(CAPTURED)
    ga, gb = zarr.open_group(str(tmp_path / "a.zarr"), mode="r"), zarr.open_group(str(tmp_path / "b.zarr"), mode="r")
    for step in CAPTURED:
        for layer in LAYERS:
            where = f"step_{step:09d}/layer_{layer:03d}"
            for name in ARRAYS:
                x, y = np.asarray(ga[f"{where}/{name}"]), np.asarray(gb[f"{where}/{name}"])
                assert x.dtype == y.dtype and np.array_equal(x, y), f"{where}/{name} differs"
    ta, tb = da.timeline, db.timeline
    assert ta is not None and len(ta["step"]) == STEPS and set(ta) == set(tb)
    for key in tb:
        assert np.array_equal(ta[key], tb[key], equal_nan=True), f"timeline/{key} differs"
    assert np.array_equal(ta["loss"], np.asarray(a.losses, dtype=ta["loss"].dtype))
