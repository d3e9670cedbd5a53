"""No lost or mixed data: one writer per store, a store keeps to one model, --overwrite never loses the
old dump when the new run fails, and a step is in the store (incomplete) from its first queued array."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import fa_forensics
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.dump import DumpWriter, open_dump
from fa_forensics.dump.lock import lock_path
from fa_forensics.commands.errors import cli_line
from fa_forensics.errors import DumpError, OtherModel, UserError

TINY = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, attention="sdpa")


def _train(model, cap, n_steps, fail_at=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(n_steps):
        if step == fail_at:
            raise RuntimeError("training died")
        idx = torch.randint(0, 256, (2, 16), generator=gen)
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)


def _quiet_open(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return open_dump(path)


def test_second_writer_is_refused_naming_the_holder_and_the_lock_goes_with_the_first(tmp_path):
    path = tmp_path / "run.zarr"
    first = DumpWriter(path, {})
    with pytest.raises(DumpError,
                       match=rf"run.zarr is being written by another process \(pid {os.getpid()} on .*command: "):
        DumpWriter(path, {})
    first.write_array(0, 0, "q", torch.ones(1, 1, 4, 2))
    first.complete_step(0)
    first.close()
    assert not lock_path(path).exists()
    second = DumpWriter(path, {})  # free again
    second.close()


def test_capture_into_a_store_being_written_exits_with_a_user_error(tmp_path):
    path = tmp_path / "run.zarr"
    holder = DumpWriter(path, {})
    torch.manual_seed(0)
    with pytest.raises(UserError, match="is being written by another process"):
        with fa_forensics.capture(GPT(GPTConfig(**TINY)), out=path, steps=[0]):
            pass
    holder.close()


def test_a_store_keeps_to_one_model_unless_asked(tmp_path):
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    small = GPT(GPTConfig(**TINY))
    with fa_forensics.capture(small, out=path, steps=[0]) as cap:
        _train(small, cap, 1)
    fingerprint = _quiet_open(path).attrs["model"]["fingerprint"]
    again = GPT(GPTConfig(**TINY))  # same architecture, other weights: the same run continued
    with fa_forensics.capture(again, out=path, steps=[1]) as cap:
        _train(again, cap, 2)
    other = GPT(GPTConfig(**{**TINY, "n_embd": 32}))
    with pytest.raises(OtherModel,
                       match=rf"holds steps of GPT \(.*fingerprint {fingerprint}\), "
                             r"but this run's model is GPT ") as refused:
        with fa_forensics.capture(other, out=path, steps=[3]) as cap:
            _train(other, cap, 4)
    assert cli_line(refused.value).endswith("pass --allow-other-model to add its steps anyway")  # the CLI's wording
    assert _quiet_open(path).steps == [0, 1]
    with fa_forensics.capture(other, out=path, steps=[3], allow_other_model=True) as cap:
        _train(other, cap, 4)
    assert _quiet_open(path).steps == [0, 1, 3]


def test_overwrite_keeps_the_old_dump_when_the_new_run_fails(tmp_path, make_dump):
    path = make_dump("run.zarr", steps=(0, 1))
    old_q = open_dump(path).read(1, 0, "q")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(RuntimeError, match="training died"), pytest.warns(RuntimeWarning,
                                                                          match="replaced is kept at "
                                                                                ".*run.zarr.replaced-0"):
        with fa_forensics.capture(model, out=path, steps=[0, 5], overwrite=True) as cap:
            _train(model, cap, 10, fail_at=3)
    kept = tmp_path / "run.zarr.replaced-0"
    assert torch.equal(open_dump(kept).read(1, 0, "q"), old_q)  # the old dump, whole
    assert _quiet_open(path).steps == [0]  # the new run's finished step is kept too
    with fa_forensics.capture(model, out=path, steps=[0], overwrite=True) as cap:
        _train(model, cap, 1)
    assert kept.exists()  # an earlier kept dump is never the one replaced


def test_overwrite_deletes_the_old_dump_only_after_a_run_that_ended_well(tmp_path, make_dump):
    path = make_dump("run.zarr", steps=(0,))
    w = DumpWriter(path, {}, overwrite=True)
    w.write_array(4, 0, "q", torch.ones(1, 1, 4, 2))
    w.complete_step(4)
    assert (tmp_path / "run.zarr.replaced-0").is_dir()
    w.close()
    assert not (tmp_path / "run.zarr.replaced-0").exists() and open_dump(path).steps == [4]


def test_a_step_is_in_the_store_from_its_first_queued_array(tmp_path, monkeypatch):
    """While the writer thread is stuck, the steps training finished are already listed (as incomplete)."""
    import threading

    gate = threading.Event()
    real = DumpWriter.write_array

    def stuck(self, step, *args, **kwargs):
        if step >= 1:
            gate.wait(30)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(DumpWriter, "write_array", stuck)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    path = tmp_path / "run.zarr"
    with fa_forensics.capture(model, out=path, steps=[0, 1, 2, 3]) as cap:
        _train(model, cap, 4)
        d = _quiet_open(path)  # what a SIGKILL now would leave behind
        assert set(d.steps) | set(d.incomplete_steps) == {0, 1, 2, 3} and not {1, 2, 3} & set(d.steps)
        gate.set()
    assert _quiet_open(path).steps == [0, 1, 2, 3]
