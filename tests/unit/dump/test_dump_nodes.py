"""A store whose node has the other kind than the layout says (an array where a step group belongs, a group where
a tensor belongs) is a DumpError naming the node, never an attribute error further on."""
from __future__ import annotations

import pytest
import torch
import zarr

from fa_forensics.dump import DumpWriter
from fa_forensics.dump.nodes import child_array, child_group
from fa_forensics.dump.schema import layer_key, step_key
from fa_forensics.errors import DumpError


def _store_with_one_step(path):
    with DumpWriter(path, {"model": {"n": 1}}) as w:
        w.write_array(0, 0, "q", torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16))
        w.complete_step(0)


def test_a_writer_refuses_a_step_that_is_an_array_in_the_store(tmp_path):
    path = tmp_path / "d.zarr"
    _store_with_one_step(path)
    zarr.open_group(str(path), mode="r+").create_array(step_key(5), shape=(2,), dtype="uint8")
    with DumpWriter(path) as w, pytest.raises(DumpError, match="an array where the dump holds a group") as raised:
        w.register_step(5)
    assert str(path / step_key(5)) in str(raised.value)


def test_child_accessors_return_the_node_of_the_kind_asked_for_and_refuse_the_other(tmp_path):
    path = tmp_path / "d.zarr"
    _store_with_one_step(path)
    step = child_group(zarr.open_group(str(path), mode="r"), step_key(0))
    layer = child_group(step, layer_key(0))
    assert child_array(layer, "q").shape == (1, 2, 4, 8)
    with pytest.raises(DumpError, match="a group where the dump holds an array") as raised:
        child_array(step, layer_key(0))
    assert str(path / step_key(0) / layer_key(0)) in str(raised.value)
