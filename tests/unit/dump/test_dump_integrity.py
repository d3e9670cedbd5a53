"""Integrity: every kind of damage is named (step, layer, array, chunk), only its step is skipped, and
`verify` exits 0 / 1 / 2. Each case damages a fresh two-step dump in one place, as a disk or a user might."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import DumpWriter, IncompleteStepWarning, open_dump
from fa_forensics.dump.verify import verify
from fa_forensics.errors import DumpError

LAYER = "step_000000001/layer_000"


def _truncate(p):
    c = p / LAYER / "q" / "c.0.1.0.0"
    c.write_bytes(c.read_bytes()[:10])


def _flip_bit(p):
    c = p / LAYER / "q" / "c.0.1.0.0"
    b = bytearray(c.read_bytes())
    b[len(b) // 2] ^= 0x40
    c.write_bytes(bytes(b))


def _edit_json(path, fn):
    meta = json.loads(path.read_text())
    fn(meta["attributes"])
    path.write_text(json.dumps(meta))


def _missing_chunk(p):
    (p / LAYER / "v" / "c.0.0.0.0").unlink()


def _chunk_dir(p):
    c = p / LAYER / "k" / "c.0.0.0.0"
    c.unlink()
    c.mkdir()


def _bad_step_json(p):
    (p / "step_000000001" / "zarr.json").write_text("{not json")


def _wrong_dtype_attr(p):
    _edit_json(p / LAYER / "q" / "zarr.json", lambda a: a.update(dtype="float32"))


def _string_scale(p):
    _edit_json(p / LAYER / "zarr.json", lambda a: a.update(scale="abc"))


def _zero_scale(p):
    _edit_json(p / LAYER / "zarr.json", lambda a: a.update(scale=0.0))


def _negative_scale(p):
    _edit_json(p / LAYER / "zarr.json", lambda a: a.update(scale=-0.125))


def _deleted_layer(p):
    shutil.rmtree(p / LAYER)


# case -> (damage, what the metadata check already finds (None: only decoding finds it), text naming it)
METADATA_CASES = {
    "missing-chunk": (_missing_chunk, "array 'v': 1 chunk missing (c.0.0.0.0)"),
    "chunk-is-a-folder": (_chunk_dir, "array 'k': 1 chunk replaced by a folder (c.0.0.0.0)"),
    "bad-step-zarr.json": (_bad_step_json, "step 1: zarr.json is not valid JSON"),
    "dtype-attr-does-not-fit": (_wrong_dtype_attr,
                                "dtype attribute 'float32' does not fit the stored data type uint16"),
    "string-in-numeric-attr": (_string_scale, "layer attribute scale='abc' is not a number"),
    "zero-scale": (_zero_scale, "layer attribute scale=0.0 is not a positive finite softmax scale"),
    "negative-scale": (_negative_scale, "layer attribute scale=-0.125 is not a positive finite softmax scale"),
    "deleted-layer-folder": (_deleted_layer, "layer 0: layer folder is missing though the step lists it"),
}
DATA_CASES = {
    "truncated-chunk": (_truncate, "chunk c.0.1.0.0 cannot be decoded"),
    "flipped-bit": (_flip_bit, "chunk c.0.1.0.0 cannot be decoded"),
}


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_metadata_damage_makes_only_its_step_incomplete_and_is_named(case, make_dump):
    damage, text = METADATA_CASES[case]
    path = make_dump(steps=(0, 1))
    damage(path)
    with pytest.warns(IncompleteStepWarning, match="^damaged: .*step_000000001.*; step\\(s\\) 1 are damaged"):
        d = open_dump(path)
    assert d.steps == [0] and list(d.damage) == [1]
    assert text in str(d.damage[1][0])
    assert d.damage[1][0].file.startswith("step_000000001")
    with pytest.raises(DumpError, match="^damaged: .*step_000000001.*; step\\(s\\) 1 are damaged"):
        d.read(1, 0, "q")
    assert d.read(0, 0, "q").shape == (1, 2, 16, 8)  # the other step reads


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_undecodable_chunk_is_named_on_read_and_by_verify(case, make_dump):
    damage, text = DATA_CASES[case]
    path = make_dump(steps=(0, 1))
    damage(path)
    d = open_dump(path)
    with pytest.raises(DumpError, match=r"^damaged: .*step_000000001/layer_000/q/c\.0\.1\.0\.0: chunk c\.0\.1\.0\.0 of "
                                        r"step 1 layer 0 array 'q' cannot be decoded"):
        d.read(1, 0, "q", heads=1)
    d.read(1, 0, "q", heads=0)  # the head beside it is intact
    report = verify(path)
    assert not report.ok and report.steps == [0] and report.damaged_steps == [1]
    assert [(p.step, p.layer, p.array) for p in report.problems] == [(1, 0, "q")] and text in report.problems[0].what


def test_missing_all_zero_chunk_is_damage_not_zeros(tmp_path):
    """The writer stores all-zero chunks, so one that is missing can never read back as zeros."""
    w = DumpWriter(tmp_path / "z.zarr", {})
    w.write_array(0, 0, "q", torch.zeros(1, 2, 4, 2, dtype=torch.bfloat16))
    w.complete_step(0)
    w.close()
    chunks = sorted(p.name for p in (tmp_path / "z.zarr" / "step_000000000" / "layer_000" / "q").glob("c.*"))
    assert chunks == ["c.0.0.0.0", "c.0.1.0.0"]
    (tmp_path / "z.zarr" / "step_000000000" / "layer_000" / "q" / "c.0.1.0.0").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = open_dump(tmp_path / "z.zarr")
    assert d.steps == [] and "1 chunk missing (c.0.1.0.0)" in str(d.damage[0][0])


def test_verify_cli_exit_codes(make_dump, tmp_path):
    runner = CliRunner()
    whole = make_dump("whole.zarr", steps=(0, 1))
    r = runner.invoke(app, ["verify", str(whole), "--json", str(tmp_path / "v.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "v.json").read_text())["ok"] is True
    cut = make_dump("cut.zarr", steps=(0,), incomplete=(1,))
    r = runner.invoke(app, ["verify", str(cut)])
    assert r.exit_code == 1 and "step 1 incomplete (cut off while writing)" in r.stderr
    damaged = make_dump("damaged.zarr", steps=(0, 1))
    _truncate(damaged)
    r = runner.invoke(app, ["verify", str(damaged), "--json", str(tmp_path / "d.json")])
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1
    problems = json.loads((tmp_path / "d.json").read_text())["problems"]
    assert problems[0]["step"] == 1 and problems[0]["array"] == "q" and "c.0.1.0.0" in problems[0]["what"]
    r = runner.invoke(app, ["verify", str(tmp_path / "nothing.zarr")])
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_sample_dumps_verify_whole():
    repo = Path(__file__).resolve().parents[3]
    for name in ("demo.zarr", "planted.zarr"):
        report = verify(repo / "sample_dumps" / name)
        assert report.ok, report.problems
