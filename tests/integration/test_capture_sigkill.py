"""A training process killed with SIGKILL while capture writes: finished steps read back, the cut one is incomplete."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from fa_forensics.dump import TENSOR_NAMES, open_dump

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")

TRAIN = textwrap.dedent('''
    import os, signal, sys, torch
    import fa_forensics
    from fa_forensics.demo.model import GPT, GPTConfig

    out, kill_at = sys.argv[1], int(sys.argv[2])
    if kill_at >= 0:  # SIGKILL ourselves from the writer thread in the middle of step `kill_at`
        from fa_forensics.dump import DumpWriter
        real = DumpWriter.write_array
        def write_array(self, step, layer, name, tensor, layer_attrs=None):
            if step == kill_at and name == "v":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, step, layer, name, tensor, layer_attrs=layer_attrs)
        DumpWriter.write_array = write_array
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, attention="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fa_forensics.capture(model, out=out, steps=range(0, 100000), batch=None) as cap:
        for it in range(100000):
            idx = torch.randint(0, 256, (4, 32))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            loss.backward(); opt.step(); opt.zero_grad()
            cap.step(loss)
''')


def _check_store(out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(out)
    for step in dump.steps:  # every finished step reads back whole
        assert dump.layers(step) == [0, 1]
        for layer in (0, 1):
            for name in TENSOR_NAMES:
                tensor = dump.read(step, layer, name)
                assert torch.isfinite(tensor.float()).all()
        assert "loss" in dump.step_attrs(step)
    return dump


def test_sigkill_mid_step_leaves_finished_steps_and_an_incomplete_cut_step(tmp_path):
    script, out = tmp_path / "train.py", tmp_path / "run.zarr"
    script.write_text(TRAIN)
    proc = subprocess.run([sys.executable, str(script), str(out), "3"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dump = _check_store(out)
    assert dump.steps == [0, 1, 2]
    cut = dump.incomplete_steps  # the cut step, and those training finished while the writer was on it
    assert cut == list(range(3, 3 + len(cut))) and len(cut) >= 1


def test_sigkill_from_outside_while_writing(tmp_path):
    script, out = tmp_path / "train.py", tmp_path / "run.zarr"
    script.write_text(TRAIN)
    proc = subprocess.Popen([sys.executable, str(script), str(out), "-1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            time.sleep(0.2)
            steps = out.glob("step_*/zarr.json") if out.exists() else []
            complete = [p for p in steps if '"complete": true' in p.read_text()]
            if len(complete) >= 2 or proc.poll() is not None:
                break
        assert proc.poll() is None, proc.stderr.read().decode()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    dump = _check_store(out)
    assert len(dump.steps) >= 2
    assert dump.steps == list(range(len(dump.steps)))  # finished steps are a prefix; anything after is listed apart
    assert all(step > dump.steps[-1] for step in dump.incomplete_steps)


SLOW_WRITER_TRAIN = textwrap.dedent('''
    import os, signal, sys, time, torch
    import fa_forensics
    from fa_forensics.demo.model import GPT, GPTConfig
    from fa_forensics.dump import DumpWriter

    out, side, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = DumpWriter.write_array
    def slow(self, step, *args, **kwargs):  # a disk that cannot keep up: steps wait in the writer's queue
        if step >= 1:
            time.sleep(0.5)
        return real(self, step, *args, **kwargs)
    DumpWriter.write_array = slow
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, attention="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fa_forensics.capture(model, out=out, steps=range(0, 1000), batch=None, max_queue=1000) as cap:
        for it in range(1000):
            idx = torch.randint(0, 256, (2, 16))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            torch.save(model.transformer.h[0].attn.last_o.detach().clone(), os.path.join(side, f"o_{it}.pt"))
            loss.backward(); opt.step(); opt.zero_grad()
            cap.step(loss)
            if it == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # training finished step `it`; the writer is far behind
''')


def test_sigkill_with_steps_still_queued_lists_every_selected_step(tmp_path):
    """Every step training finished is either complete and bit-exact or listed as incomplete; none vanishes."""
    script, out, side = tmp_path / "train.py", tmp_path / "run.zarr", tmp_path / "side"
    side.mkdir()
    script.write_text(SLOW_WRITER_TRAIN)
    proc = subprocess.run([sys.executable, str(script), str(out), str(side), "5"], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(out)
    assert sorted(dump.steps + dump.incomplete_steps) == list(range(6))  # steps 0..5 all accounted for
    assert dump.incomplete_steps, "the slow writer cannot have written every step"
    for step in dump.steps:
        assert torch.equal(dump.read(step, 0, "o").view(torch.int16),
                           torch.load(side / f"o_{step}.pt").view(torch.int16))
