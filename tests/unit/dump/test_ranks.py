"""Multi-rank stores: rank 0 creates the store and writes its root attributes, other ranks wait for it and
write only their own trees; a rank's folder opens as that rank of the store."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from fa_forensics.dump import DumpWriter, open_dump
from fa_forensics.dump.lock import lock_path
from fa_forensics.dump.ranks import rank0_ready, store_ranks
from fa_forensics.errors import DumpError


def _attrs(rank: int) -> dict:
    return {"capture": {"rank": rank, "world_size": 2}}


def _write_step(writer: DumpWriter, value: float) -> None:
    writer.write_array(0, 0, "q", torch.full((1, 1, 2, 2), value))
    writer.complete_step(0)


def test_a_rank_above_zero_never_creates_the_store(tmp_path):
    with pytest.raises(DumpError, match="rank 1 found no dump at .* rank 0 creates the store"):
        DumpWriter(tmp_path / "run.zarr", _attrs(1), rank=1, world_size=2)
    assert not (tmp_path / "run.zarr").exists()


def test_rank_1_waits_for_rank_0_of_its_own_run_and_the_root_is_rank_0s(tmp_path):
    """Rank 1 starts first, against an old dump that rank 0 replaces: it waits until rank 0 of the same run
    id has opened the new store, so its tree lands there and the root attributes are rank 0's."""
    path = tmp_path / "run.zarr"
    with DumpWriter(path, {"capture": {"rank": 0, "old": True}}) as old:
        _write_step(old, 7.0)
    done: dict = {}

    def rank_1() -> None:
        try:
            with DumpWriter(path, _attrs(1), rank=1, world_size=2, run_id="run-b", rank0_wait=20) as w:
                _write_step(w, 1.0)
            done["ok"] = True
        except Exception as exc:  # reported by the assertion below
            done["error"] = exc

    waiting = threading.Thread(target=rank_1)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and not (path / "rank_1").exists()  # still waiting: the old store is not its run's
    with DumpWriter(path, _attrs(0), overwrite=True, rank=0, world_size=2, run_id="run-b") as w0:
        waiting.join(20)
        _write_step(w0, 0.0)
    assert done == {"ok": True}
    root = open_dump(path)
    assert root.attrs["capture"] == {"rank": 0, "world_size": 2} and root.ranks == [0, 1]
    assert root.read(0, 0, "q").sum() == 0 and open_dump(path, rank=1).read(0, 0, "q").sum() == 4
    assert not list(tmp_path.glob("run.zarr.replaced-*"))  # the old dump was replaced, rank 1's tree is in the new


def test_the_wait_is_bounded_and_a_stale_ready_line_is_not_taken(tmp_path):
    path = tmp_path / "run.zarr"
    with DumpWriter(path, _attrs(0)) as w:
        _write_step(w, 0.0)
        assert rank0_ready(path, None) and not rank0_ready(path, "another-run")
        t0 = time.monotonic()
        with pytest.raises(DumpError, match=r"rank 1 waited 0.3 s for rank 0 to create .*run.zarr"):
            DumpWriter(path, _attrs(1), rank=1, world_size=2, run_id="another-run", rank0_wait=0.3)
        assert time.monotonic() - t0 < 5
    assert not lock_path(path).exists() and not rank0_ready(path, None)  # released: nobody announces the store
    lock_path(path).write_text("pid 999999999 on " + __import__("socket").gethostname() + ", since x\nready -\n")
    assert not rank0_ready(path, None)  # a lock file its dead holder left: not ready


def test_a_rank_folder_opens_as_that_rank_of_the_store(tmp_path):
    path = tmp_path / "run.zarr"
    for r in (0, 1):
        with DumpWriter(path, _attrs(r), rank=r, world_size=2) as w:
            _write_step(w, float(r))
    d = open_dump(path / "rank_1")
    assert d.path == path and d.rank == 1 and d.read(0, 0, "q").sum() == 4 and d.ranks == [0, 1]
    assert store_ranks(path) == [0, 1]
    with pytest.raises(DumpError, match="is rank 1's tree of the dump .*run.zarr, not rank 0's"):
        open_dump(path / "rank_1", rank=0)


def test_a_failed_rank_0_keeps_the_trees_other_ranks_wrote(tmp_path):
    path = tmp_path / "run.zarr"
    w0 = DumpWriter(path, _attrs(0), rank=0, world_size=2)
    with DumpWriter(path, _attrs(1), rank=1, world_size=2) as w1:
        _write_step(w1, 1.0)
    w0.close(failed=True)  # rank 0 wrote nothing and failed: its store stays, rank 1's tree in it
    assert open_dump(path, rank=1).steps == [0]


def test_a_rank_folder_linking_out_of_the_store_is_never_a_rank(tmp_path):
    """rank_1 linked to a folder outside the store, rank_2 whose zarr.json links out, rank_3 linked inside it:
    only the one that stays inside is a rank; the others are named with where they point."""
    from fa_forensics.dump.ranks import rank_links_out

    store = tmp_path / "run.zarr"
    (store / "inner").mkdir(parents=True)
    outside = tmp_path / "other.zarr"
    outside.mkdir()
    (outside / "zarr.json").write_text("{}")
    (store / "rank_1").symlink_to(outside, target_is_directory=True)
    (store / "rank_2").mkdir()
    (store / "rank_2" / "zarr.json").symlink_to(outside / "zarr.json")
    (store / "rank_3").symlink_to(store / "inner", target_is_directory=True)
    real = os.path.realpath(outside)
    assert rank_links_out(store) == {1: f"rank_1 -> {real}",
                                     2: f"rank_2/zarr.json -> {os.path.join(real, 'zarr.json')}"}
    assert store_ranks(store) == [0, 3]
