"""overlap(output, input): every way a path can name a dump's own files, and the paths beside it that do not."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fa_forensics.dump.output_overlap import overlap


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "run.zarr"
    (root / "step_000000000" / "layer_000" / "o").mkdir(parents=True)
    (root / "zarr.json").write_text("{}")
    (root / "step_000000000" / "layer_000" / "o" / "c.0.0.0.0").write_bytes(b"chunk")
    return root


def test_the_store_its_files_and_new_names_inside_it_overlap(store):
    assert overlap(store, store) == f"it is {store} itself"
    for inside in (store / "zarr.json", store / "step_000000000" / "layer_000" / "o" / "c.0.0.0.0",
                   store / "new" / "deeper" / "x.json"):
        assert overlap(inside, store) == f"it lies inside {store}"


def test_links_dotdot_and_hard_links_are_resolved(store, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(store, target_is_directory=True)
    assert overlap(alias / "out.json", store) == f"it lies inside {store}"
    (tmp_path / "sub").mkdir()
    assert overlap(tmp_path / "sub" / ".." / "run.zarr" / "x", store) == f"it lies inside {store}"
    file_link = tmp_path / "meta.json"
    file_link.symlink_to(store / "zarr.json")
    assert overlap(file_link, store) == f"it lies inside {store}"
    hard = tmp_path / "hard.json"
    os.link(store / "zarr.json", hard)
    assert overlap(hard, store) == f"it is another name (a hard link) of {store / 'zarr.json'}, a file of {store}"


def test_a_file_input_and_its_other_names(tmp_path):
    src = tmp_path / "in.safetensors"
    src.write_bytes(b"tensors")
    hard = tmp_path / "again.safetensors"
    os.link(src, hard)
    assert overlap(src, src) == f"it is {src} itself"
    assert overlap(hard, src) == f"it is {src} itself"
    assert overlap(tmp_path / "out.json", src) is None


def test_an_output_replaced_whole_may_not_hold_the_input(store, tmp_path):
    assert overlap(tmp_path, store) is None  # figures beside the dump are fine
    assert overlap(tmp_path, store, replaced=True) == f"{store} lies inside it and would be deleted when it is replaced"


def test_paths_beside_the_store_do_not_overlap(store, tmp_path):
    for beside in (tmp_path / "run.zarr.json", tmp_path / "run.zarr2" / "x", tmp_path / "out.json"):
        assert overlap(beside, store) is None
    other = tmp_path / "other.json"
    other.write_text("{}")
    os.link(other, tmp_path / "other2.json")  # a hard link, but of nothing in the store
    assert overlap(other, store) is None


def test_an_output_inside_one_not_written_yet(tmp_path):
    new = tmp_path / "new.zarr"
    assert overlap(new / "zarr.json", new) == f"it lies inside {new}"
    assert overlap(tmp_path / "new.zarr.json", new) is None
