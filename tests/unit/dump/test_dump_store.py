"""Dump store format v1: writer, lazy reader, errors that say what exists."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import zarr

from fa_forensics.dump import FORMAT_VERSION, TENSOR_NAMES, DumpWriter, IncompleteStepWarning, LayerInfo, open_dump
from fa_forensics.errors import DumpError, UserError


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16,
                                   torch.float32])
def test_round_trip_is_bit_exact_and_keeps_dtype(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(2, 3, 8, 4, generator=g) * 100).to(dtype)  # (B, H, T, D), fp8 saturates/rounds
    # a NaN pattern where 1 byte
    q.view(torch.uint8)[0, 0, 0, :2] = 0xFF if dtype.itemsize == 1 else q.view(torch.uint8)[0, 0, 0, :2]
    x = torch.randn(2, 8, 12, generator=g).to(dtype)  # (B, T, C)
    w = DumpWriter(tmp_path / "d.zarr", {"model": {"n": 1}})
    w.write_array(3, 1, "q", q)
    w.write_array(3, 1, "x", x)
    w.complete_step(3)
    d = open_dump(tmp_path / "d.zarr")
    back = d.read(3, 1, "q")
    assert back.dtype == dtype and back.shape == q.shape
    assert torch.equal(_bits(back), _bits(q))
    assert torch.equal(_bits(d.read(3, 1, "x")), _bits(x))


def test_layout_chunks_codec_and_attrs(make_dump):
    path = make_dump(batch=2, heads=3, seq=16, head_dim=8)
    root = zarr.open_group(str(path), mode="r")
    meta = root.attrs["fa_forensics"]
    assert meta["format_version"] == FORMAT_VERSION == 1
    assert {"tool_version", "torch_version", "device", "amp_dtype", "model", "capture"} <= set(meta)
    layer = root["step_000000000"]["layer_000"]
    assert layer["q"].chunks == (1, 1, 16, 8)
    assert layer["x"].chunks == (1, 16, 24)
    assert layer["q"].dtype == "uint16" and layer["q"].attrs["dtype"] == "bfloat16"
    assert any(c.to_dict()["name"] == "zstd" for c in layer["q"].compressors)
    assert dict(layer.attrs)["arrays"] == list(TENSOR_NAMES)
    assert root["step_000000000"].attrs["complete"] is True


def test_read_selects_heads_and_batch_and_keeps_dims(make_dump):
    path = make_dump(batch=3, heads=4)
    d = open_dump(path)
    full = d.read(0, 0, "k")  # (B, H, T, D)
    assert torch.equal(d.read(0, 0, "k", heads=2), full[:, 2:3])
    assert torch.equal(d.read(0, 0, "k", heads=[3, 1]), full[:, [3, 1]])
    assert torch.equal(d.read(0, 0, "k", heads=slice(1, 3), batch=1), full[1:2, 1:3])
    assert torch.equal(d.read(0, 0, "x", heads=[0], batch=slice(0, 2)), d.read(0, 0, "x")[0:2])  # heads ignored for x
    with pytest.raises(DumpError, match=r"head 4 not in .* heads stored: 0, 1, 2, 3"):
        d.read(0, 0, "k", heads=4)
    with pytest.raises(DumpError, match="batch 5"):
        d.read(0, 0, "k", batch=5)


def test_incomplete_steps_are_listed_apart_with_a_warning(make_dump):
    path = make_dump(steps=(0, 2), incomplete=(1, 7))
    with pytest.warns(IncompleteStepWarning, match="1, 7"):
        d = open_dump(path)
    assert d.steps == [0, 2]
    assert d.incomplete_steps == [1, 7]
    with pytest.raises(DumpError, match="step 1 .* incomplete.*complete steps: 0, 2"):
        d.read(1, 0, "q")
    assert d.select() == [(0, 0, [0, 1]), (2, 0, [0, 1])]


def test_complete_flag_is_the_last_metadata_write(tmp_path, monkeypatch):
    """A writer killed just before its `complete` write leaves the step incomplete, its other attrs written."""
    from zarr.core.attributes import Attributes

    w = DumpWriter(tmp_path / "d.zarr", {})
    w.write_array(5, 0, "q", torch.zeros(1, 1, 4, 2, dtype=torch.bfloat16))
    w.complete_step(5, loss=2.5, lr=0.1)
    w.write_array(6, 0, "q", torch.zeros(1, 1, 4, 2, dtype=torch.bfloat16))
    real_setitem = Attributes.__setitem__

    def killed_at_complete(self, key, value):
        if key == "complete" and value is True:
            raise KeyboardInterrupt("killed")
        real_setitem(self, key, value)

    monkeypatch.setattr(Attributes, "__setitem__", killed_at_complete)
    with pytest.raises(KeyboardInterrupt):
        w.complete_step(6, loss=1.5)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteStepWarning)
        d = open_dump(tmp_path / "d.zarr")
    assert (d.steps, d.incomplete_steps) == ([5], [6])
    assert d.step_attrs(5)["loss"] == 2.5 and d.step_attrs(5)["lr"] == 0.1
    raw = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")["step_000000006"].attrs
    assert raw["loss"] == 1.5 and raw["complete"] is False  # everything but the flag was written


def test_open_reads_metadata_only(make_dump):
    """Garbage in every chunk file leaves open_dump, steps, layers, layer_info and summary working: none of them
    decodes a chunk."""
    path = make_dump(steps=(0, 1), layers=(0, 2))
    garbled = [p for p in path.rglob("c.*")]
    assert garbled
    for p in garbled:
        p.write_bytes(b"not zstd")
    d = open_dump(path)
    assert d.steps == [0, 1] and d.layers() == [0, 2] and d.heads(1, 2) == [0, 1]
    info = d.layer_info(1, 2)
    assert isinstance(info, LayerInfo) and info.arrays["q"] == (1, 2, 16, 8) and info.module == "blocks.2.attn"
    assert d.summary()["arrays"]["2"]["x"]["shape"] == [1, 16, 16]


def test_layer_info_defaults_and_explicit_settings(tmp_path):
    w = DumpWriter(tmp_path / "d.zarr", {})
    w.write_array(0, 0, "x", torch.zeros(1, 4, 6))  # x first: head settings filled in by q
    w.write_array(0, 0, "q", torch.zeros(1, 3, 4, 16, dtype=torch.bfloat16))
    w.write_array(0, 1, "q", torch.zeros(1, 2, 4, 8), layer_attrs={"causal": False, "scale": 0.5, "module": "m"})
    w.complete_step(0)
    d = open_dump(tmp_path / "d.zarr")
    a, b = d.layer_info(0, 0), d.layer_info(0, 1)
    assert (a.n_heads, a.head_dim, a.scale, a.causal, a.dtype) == (3, 16, 0.25, True, "bfloat16")
    assert (b.n_heads, b.head_dim, b.scale, b.causal, b.dtype, b.module) == (2, 8, 0.5, False, "float32", "m")


def test_missing_things_name_what_exists(make_dump):
    d = open_dump(make_dump(steps=(4, 8), layers=(1,), names=("q", "k", "v")))
    with pytest.raises(DumpError, match="step 5 is not in .*complete steps: 4, 8"):
        d.read(5, 1, "q")
    with pytest.raises(DumpError, match="layer 0 is not in step 4 .*layers: 1"):
        d.read(4, 0, "q")
    with pytest.raises(DumpError, match="array 'do' is not in step 4 layer 1 .*arrays there: q, k, v"):
        d.read(4, 1, "do")
    with pytest.raises(DumpError, match="unknown array name 'w'"):
        d.read(4, 1, "w")
    with pytest.raises(DumpError, match="head 9"):
        d.select(heads=[9])
    with pytest.raises(DumpError, match="step 12345"):
        d.select(steps=12345)
    assert d.has(4, 1, "q") and not d.has(4, 1, "o") and not d.has(99, 1, "q")
    assert d.select(steps=[8], layers=1, heads=[1]) == [(8, 1, [1])]


def test_damaged_dump_missing_array_is_reported(make_dump):
    """A complete step that lacks a listed array is damaged: listed apart, named, skipped; the other step still
    reads."""
    import shutil

    path = make_dump()
    shutil.rmtree(path / "step_000000001" / "layer_000" / "q")
    with pytest.warns(IncompleteStepWarning,
                      match=r"damaged: .*step_000000001/layer_000/q: array is missing .*step\(s\) 1 are damaged"):
        d = open_dump(path)
    assert d.steps == [0] and d.incomplete_steps == [1] and list(d.damage) == [1]
    assert d.summary()["damage"] == {"1": ["step 1 layer 0 array 'q': array is missing though the layer lists it"]}
    with pytest.raises(DumpError, match=r"step\(s\) 1 are damaged"):
        d.select(steps=1)
    assert [s for s, _, _ in d.select()] == [0]
    assert torch.equal(d.read(0, 0, "q"), d.read(0, 0, "q"))  # the undamaged step still reads


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("hello"), "is a file"),
        (lambda p: p.mkdir(), "empty folder"),
        (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x")), "not a zarr store"),
        (lambda p: zarr.open_group(str(p), mode="w").attrs.update({"other": 1}), "not an fa-forensics dump"),
    ],
)
def test_open_rejects_what_is_not_a_dump(tmp_path, setup, match):
    p = tmp_path / "thing.zarr"
    setup(p)
    with pytest.raises(DumpError, match=match) as exc:
        open_dump(p)
    assert isinstance(exc.value, UserError) and "\n" not in str(exc.value)


def test_unknown_format_version_is_refused(make_dump):
    path = make_dump()
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["fa_forensics"]["format_version"] = 99
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(DumpError, match="format_version 99"):
        open_dump(path)
    with pytest.raises(DumpError, match="format_version 99"):
        DumpWriter(path, {})


def test_writer_extends_an_existing_dump_and_refuses_to_clobber(make_dump, tmp_path):
    path = make_dump(steps=(0,))
    w = DumpWriter(path, {"model": {"ignored": True}})
    with pytest.raises(DumpError, match="already complete"):
        w.write_array(0, 0, "q", torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16))
    w.write_array(1, 0, "q", torch.ones(1, 2, 16, 8, dtype=torch.bfloat16))
    w.complete_step(1)
    w.close()
    d = open_dump(path)
    assert d.steps == [0, 1] and d.attrs["model"] == {"name": "test"}
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    with pytest.raises(DumpError, match="not an fa-forensics dump; refusing"):
        DumpWriter(other, {}, overwrite=True)
    assert (other / "keep.txt").read_text() == "precious"
    fresh = DumpWriter(path, {"model": {"new": 1}}, overwrite=True)
    fresh.write_array(9, 0, "q", torch.zeros(1, 1, 2, 2))
    fresh.complete_step(9)
    assert open_dump(path).steps == [9]


def test_timeline_appends_rows_and_backfills(tmp_path):
    w = DumpWriter(tmp_path / "d.zarr", {})
    w.append_timeline(10, loss=3.0, max_logit=torch.ones(2, 3))
    w.append_timeline(20, loss=2.0)
    w.append_timeline(30, loss=1.0, max_logit=torch.full((2, 3), 5.0), ties=4)
    w.write_array(30, 0, "q", torch.zeros(1, 1, 2, 2))
    w.complete_step(30)
    tl = open_dump(tmp_path / "d.zarr").timeline
    assert tl["step"].tolist() == [10, 20, 30]
    assert tl["loss"].tolist() == [3.0, 2.0, 1.0]
    assert tl["max_logit"].shape == (3, 2, 3) and math.isnan(tl["max_logit"][1, 0,
                                                                             0]) and tl["max_logit"][2, 1, 2] == 5.0
    assert math.isnan(tl["ties"][0]) and tl["ties"][2] == 4


def test_ranks_write_their_own_subtrees(tmp_path):
    path = tmp_path / "ddp.zarr"
    for r in (0, 1):
        w = DumpWriter(path, {"model": {}}, rank=r, world_size=2)
        w.write_array(0, 0, "q", torch.full((1, 1, 2, 2), float(r)))
        w.complete_step(0)
    assert (path / "rank_1" / "step_000000000").is_dir()
    d0, d1 = open_dump(path), open_dump(path, rank=1)
    assert d0.world_size == 2 and d0.read(0, 0, "q").sum() == 0 and d1.read(0, 0, "q").sum() == 4
    with pytest.raises(DumpError, match="rank 5 is not in .*ranks: 0, 1"):
        open_dump(path, rank=5)


def test_summary_keys(make_dump):
    path = make_dump(steps=(0, 1), incomplete=(2,))
    with pytest.warns(IncompleteStepWarning):
        s = open_dump(path).summary()
    assert {"steps", "incomplete_steps", "layers", "arrays", "heads", "format_version", "capture", "model",
            "ground_truth"} <= set(s)
    assert s["steps"] == [0, 1] and s["incomplete_steps"] == [2] and s["layers"] == [0]
    assert s["arrays"]["0"]["q"] == {"shape": [1, 2, 16, 8], "dtype": "bfloat16", "chunks": [1, 1, 16, 8]}
    assert s["heads"] == {"0": [0, 1]} and s["ground_truth"] is None and s["step_attrs"]["1"]["loss"] == 2.0


def test_heads_attribute_maps_model_head_numbers_to_stored_positions(tmp_path):
    """A capture of heads 1 and 3 only: reads and selections use the model's head numbers."""
    from fa_forensics.dump import DumpWriter, open_dump
    from fa_forensics.errors import DumpError

    q = torch.randn(1, 2, 8, 4).bfloat16()  # (B, 2 stored heads, T, D)
    w = DumpWriter(tmp_path / "h.zarr", {"capture": {"heads": [1, 3]}})
    w.write_array(0, 0, "q", q, layer_attrs={"heads": [1, 3]})
    w.complete_step(0)
    w.close()
    d = open_dump(tmp_path / "h.zarr")
    assert d.heads(0, 0) == [1, 3]
    assert torch.equal(d.read(0, 0, "q", heads=3), q[:, 1:2])
    assert torch.equal(d.read(0, 0, "q", heads=[3, 1]), q[:, [1, 0]])
    assert d.select(heads=[3]) == [(0, 0, [3])]
    with pytest.raises(DumpError, match="heads stored: 1, 3"):
        d.read(0, 0, "q", heads=0)
    with pytest.raises(DumpError, match="heads stored"):
        d.select(heads=[2])


def test_summary_heads_are_the_model_head_numbers_of_a_partial_capture(tmp_path):
    """info --json `heads` must list heads 1 and 3 (the stored ones), not positions 0 and 1."""
    w = DumpWriter(tmp_path / "h.zarr", {"capture": {"heads": [1, 3]}})
    w.write_array(0, 0, "q", torch.randn(1, 2, 8, 4).bfloat16(), layer_attrs={"heads": [1, 3]})
    w.complete_step(0)
    w.close()
    s = open_dump(tmp_path / "h.zarr").summary()
    assert s["heads"] == {"0": [1, 3]}
    assert s["layer_info"]["0"]["n_heads"] == 2


def test_overwrite_keeps_the_old_dump_until_the_new_writer_closes(tmp_path):
    """A capture --overwrite that dies before close() must not have destroyed the dump it replaces."""
    from fa_forensics.dump import DumpWriter, open_dump

    path = tmp_path / "run.zarr"
    old = torch.randn(1, 1, 4, 2).bfloat16()
    w = DumpWriter(path, {})
    w.write_array(0, 0, "q", old)
    w.complete_step(0)
    w.close()
    w = DumpWriter(path, {}, overwrite=True)
    w.write_array(5, 0, "q", torch.zeros(1, 1, 4, 2).bfloat16())
    aside = tmp_path / "run.zarr.replaced-0"
    assert torch.equal(open_dump(aside).read(0, 0, "q"), old)  # still there while the new run writes
    w.complete_step(5)
    w.close()
    assert not aside.exists() and open_dump(path).steps == [5]
