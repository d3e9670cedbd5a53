"""safetensors import / export: bit-exact round trips, metadata, clear errors."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fa_forensics.dump import open_dump
from fa_forensics.dump.safetensors_io import export_safetensors, import_safetensors
from fa_forensics.errors import DumpError


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def _tensors(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for s in (7, 30):
        for l in (0, 2):
            for n in ("q", "k", "v", "o", "do"):
                t[f"step{s}.layer{l}.{n}"] = torch.randn(2, 3, 8, 4, generator=g).to(torch.bfloat16)  # (B, H, T, D)
            t[f"step{s}.layer{l}.x"] = torch.randn(2, 8, 12, generator=g).to(torch.bfloat16)  # (B, T, C)
    t["step30.layer2.q"] = (torch.randn(2, 3, 8, 4, generator=g) * 50).to(torch.float8_e4m3fn)
    t["step30.layer2.k"] = torch.randn(2, 3, 8, 4, generator=g).to(torch.float16)
    return t


def test_export_of_import_is_the_identity(tmp_path):
    src = tmp_path / "in.safetensors"
    tensors = _tensors()
    save_file(tensors, src, metadata={"causal": "false", "scale": "0.3"})
    res = import_safetensors(src, tmp_path / "d.zarr")
    assert res.steps == [7, 30] and res.layers == [0, 2] and res.n_tensors == len(tensors)
    d = open_dump(tmp_path / "d.zarr")
    info = d.layer_info(30, 2)
    assert info.causal is False and info.scale == 0.3 and info.dtype == "float8_e4m3fn"
    assert _same(d.read(30, 2, "q"), tensors["step30.layer2.q"])
    export_safetensors(tmp_path / "d.zarr", tmp_path / "out.safetensors")
    back = load_file(tmp_path / "out.safetensors")
    assert set(back) == set(tensors)
    assert all(_same(back[n], tensors[n]) for n in tensors)
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        assert f.metadata() == {"causal": "false", "scale": "0.3"}


def test_import_of_export_is_the_identity(make_dump, tmp_path):
    path = make_dump(steps=(0, 3), layers=(0, 1), batch=2)
    export_safetensors(path, tmp_path / "f.safetensors")
    import_safetensors(tmp_path / "f.safetensors", tmp_path / "again.zarr")
    a, b = open_dump(path), open_dump(tmp_path / "again.zarr")
    assert a.steps == b.steps and a.layers() == b.layers()
    for s, l, _ in a.select():
        assert a.layer_info(s, l).arrays == b.layer_info(s, l).arrays
        assert a.layer_info(s, l).scale == b.layer_info(s, l).scale
        for n in a.layer_info(s, l).arrays:
            assert _same(a.read(s, l, n), b.read(s, l, n))


def test_defaults_are_causal_and_inverse_sqrt_d(tmp_path):
    save_file({"step1.layer0.q": torch.zeros(1, 2, 4, 16)}, tmp_path / "f.safetensors")
    import_safetensors(tmp_path / "f.safetensors", tmp_path / "d.zarr")
    info = open_dump(tmp_path / "d.zarr").layer_info(1, 0)
    assert info.causal is True and info.scale == 0.25


def test_export_selection_and_refusals(make_dump, tmp_path):
    path = make_dump(steps=(0, 1), layers=(0, 1))
    res = export_safetensors(path, tmp_path / "one.safetensors", steps=1, layers=[0])
    names = sorted(("q", "k", "v", "o", "do", "x"))
    assert sorted(load_file(tmp_path / "one.safetensors")) == [f"step1.layer0.{n}" for n in names]
    assert res.n_tensors == 6
    with pytest.raises(DumpError, match="already exists; overwrite=True replaces it"):
        export_safetensors(path, tmp_path / "one.safetensors")
    with pytest.raises(DumpError, match="step 12345 is not in"):
        export_safetensors(path, tmp_path / "two.safetensors", steps=12345)
    assert not (tmp_path / "two.safetensors").exists()


@pytest.mark.parametrize(
    "tensors, metadata, match",
    [
        ({"layer0.q": torch.zeros(1, 1, 2, 2)}, None, r"does not match step\{S\}\.layer\{L\}\.\{q,k,v,o,do,x,mask\}"),
        ({"step1.layer0.w": torch.zeros(1, 1, 2, 2)}, None, "does not match"),
        ({"step1.layer0.q": torch.zeros(1, 2, 2)}, None, "expected 4 dims"),
        ({"step1.layer0.x": torch.zeros(1, 2, 2, 2)}, None, "expected 3 dims"),
        ({"step1.layer0.q": torch.zeros(1, 1, 2, 2)}, {"causal": "yes"}, "causal='yes'"),
        ({"step1.layer0.q": torch.zeros(1, 1, 2, 2)}, {"scale": "big"}, "scale='big' is not a number"),
        ({"step1234567890.layer0.q": torch.ones(1, 1, 2, 2)}, None, r"beyond what a dump holds \(steps 0..999999999"),
        ({"step1.layer1000.q": torch.ones(1, 1, 2, 2)}, None, r"layers 0..999\)"),
        ({"step1.layer0.q": torch.ones(1, 1, 2, 2), "step01.layer0.q": torch.ones(1, 1, 2, 2)}, None,
         "both name step 1 layer 0 q"),
        ({"step1.layer0.q": torch.ones(1, 1, 16, 4), "step1.layer0.k": torch.ones(1, 1, 8, 4)}, None,
         r"layer0.k has shape \(1, 1, 8, 4\), but q has"),
        ({"step1.layer0.q": torch.ones(1, 1, 16, 8), "step1.layer0.v": torch.ones(1, 1, 16, 4)}, None,
         r"layer0.v has shape"),
        ({"step1.layer0.q": torch.ones(1, 1, 16, 8), "step1.layer0.x": torch.ones(2, 16, 8)}, None,
         "x is \\(B, T, C\\)"),
        ({"step1.layer0.q": torch.ones(0, 1, 16, 8)}, None, "is empty"),
        ({"step1.layer0.q": torch.ones(1, 2, 2, 2)}, {"layer0.heads": "1,1"}, "distinct head numbers"),
        ({"step1.layer0.q": torch.ones(1, 2, 2, 2)}, {"layer0.heads": "-1,-2"}, "distinct head numbers >= 0"),
    ],
)
def test_bad_files_give_one_line_and_write_nothing(tmp_path, tensors, metadata, match):
    save_file(tensors, tmp_path / "f.safetensors", metadata=metadata)
    with pytest.raises(DumpError, match=match) as exc:
        import_safetensors(tmp_path / "f.safetensors", tmp_path / "d.zarr")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "d.zarr").exists() and [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]


def test_import_refuses_to_clobber(make_dump, tmp_path):
    save_file({"step1.layer0.q": torch.zeros(1, 1, 2, 2)}, tmp_path / "f.safetensors")
    path = make_dump()
    with pytest.raises(DumpError, match="already exists; overwrite=True replaces it"):
        import_safetensors(tmp_path / "f.safetensors", path)
    import_safetensors(tmp_path / "f.safetensors", path, overwrite=True)
    assert open_dump(path).steps == [1]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep")
    with pytest.raises(DumpError, match="not an fa-forensics dump"):
        import_safetensors(tmp_path / "f.safetensors", tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep"
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(DumpError, match="not a readable safetensors file"):
        import_safetensors(tmp_path / "junk.safetensors", tmp_path / "new.zarr")


def test_partial_head_capture_keeps_its_head_numbers_through_export_and_import(tmp_path):
    from fa_forensics.dump import DumpWriter, open_dump
    from fa_forensics.dump.safetensors_io import export_safetensors, import_safetensors

    q = torch.randn(1, 2, 8, 4).bfloat16()
    w = DumpWriter(tmp_path / "a.zarr", {})
    w.write_array(0, 0, "q", q, layer_attrs={"heads": [1, 3]})
    w.complete_step(0)
    w.close()
    export_safetensors(tmp_path / "a.zarr", tmp_path / "a.safetensors")
    import_safetensors(tmp_path / "a.safetensors", tmp_path / "b.zarr")
    b = open_dump(tmp_path / "b.zarr")
    assert b.heads(0, 0) == [1, 3]
    assert torch.equal(b.read(0, 0, "q", heads=3), q[:, 1:2])


def test_exported_file_has_the_usual_mode_and_a_readonly_destination_is_one_line(make_dump, tmp_path):
    import os
    import stat

    res = export_safetensors(make_dump(), tmp_path / "out.safetensors")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(res.destination).st_mode) == 0o666 & ~mask
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(DumpError, match="cannot write .*"):
            export_safetensors(make_dump("b.zarr"), ro / "out.safetensors")
