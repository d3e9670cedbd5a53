"""GPU bits brought in with `fa-forensics import` (tests/data/h200_bits: cuDNN, FlashAttention-2 and the
memory-efficient kernel on one head of planted.zarr's step 0 layer 0, recorded on an H200): `import` records the
facts the file or the options give and nothing of the importing machine, and `match` reads them right."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.replay.gpu_fidelity import read_tensors

BITS = Path(__file__).resolve().parents[1] / "data" / "h200_bits" / "planted.s0l0.safetensors.xz"
KERNELS = {0: ("cudnn", "sdpa-cudnn-sm90@"), 1: ("flash", "sdpa-flash@"), 2: ("efficient", "sdpa-efficient@")}
runner = CliRunner()


def _file(path: Path, **metadata: str) -> Path:
    """One layer per kernel: the recorded q, k, v and that kernel's O (1 x 1 x 256 x 64 bf16, causal, scale 0.125)."""
    tensors, _ = read_tensors(BITS)
    out = {}
    for layer, (kernel, _) in KERNELS.items():
        for name in ("q", "k", "v"):
            out[f"step0.layer{layer}.{name}"] = tensors[f"planted.s0l0.{name}"].clone()
        out[f"step0.layer{layer}.o"] = tensors[f"planted.s0l0.{kernel}.o"].clone()
    save_file(out, path, metadata={"causal": "true", "scale": "0.125", **metadata})
    return path


def _invoke(args: list[str], tmp_path: Path, name: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    res = runner.invoke(app, [*args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


def _import_and_match(tmp_path: Path, file: Path, name: str, *options: str) -> tuple[dict, dict, str]:
    dump = tmp_path / f"{name}.zarr"
    imported, _ = _invoke(["import", str(file), "--to", str(dump), *options], tmp_path, f"{name}-import")
    matched, output = _invoke(["match", str(dump)], tmp_path, name)
    return imported, matched, output


def _named_kernels(matched: dict) -> None:
    for layer in matched["layers"]:
        best = layer["best"]
        assert best["preset"].startswith(KERNELS[layer["layer"]][1]) and best["accumulation"] == "tensor-core"
        assert best["o_bits_equal"] == 1.0
    assert matched["verdict"].startswith("stored O reproduced 100 % in every selected layer-step (3)")


def test_imported_gpu_bits_without_facts_record_unknown_and_every_recipe_is_tried(tmp_path):
    imported, matched, _ = _import_and_match(tmp_path, _file(tmp_path / "bits.safetensors"), "bare")
    assert imported["facts"] == {"device": "unknown", "kernel": "unknown", "autocast_dtype": "unknown",
                                 "softmax": "unknown"}
    d = open_dump(tmp_path / "bare.zarr")
    assert d.attrs["device"] == "unknown" and "device_type" not in dict(d._layer(0, 0).attrs)  # not this machine's
    _named_kernels(matched)
    assert any(n.startswith("the softmax variant is not recorded") for n in matched["notes"])


def test_facts_given_as_options_or_in_the_metadata_are_recorded_and_read(tmp_path):
    plain = _file(tmp_path / "bits.safetensors")
    _, by_option, _ = _import_and_match(tmp_path, plain, "options", "--device", "cuda", "--kernel", "sdpa",
                                        "--softmax", "standard", "--autocast-dtype", "bfloat16")
    _named_kernels(by_option)
    said = _file(tmp_path / "said.safetensors", device="cuda:0", kernel="sdpa", softmax="standard",
                 autocast_dtype="bfloat16")
    imported, by_metadata, _ = _import_and_match(tmp_path, said, "metadata")
    _named_kernels(by_metadata)
    assert imported["facts"] == {"device": "cuda:0", "kernel": "sdpa", "autocast_dtype": "bfloat16",
                                 "softmax": "standard"}
    # an SDPA run computes neither the paper's reference code nor the stabilized softmax: fewer recipes to try
    bare = _import_and_match(tmp_path, plain, "bare")[1]
    assert all(a["recipes_admitted"] < b["recipes_admitted"] for a, b in zip(by_metadata["layers"], bare["layers"]))
    assert not any(n.startswith("the softmax variant is not recorded") for n in by_metadata["notes"])
    _invoke(["export", str(tmp_path / "metadata.zarr"), "--to", str(tmp_path / "back.safetensors")], tmp_path, "exp")
    with safe_open(str(tmp_path / "back.safetensors"), framework="pt") as f:
        back = f.metadata()
    assert {k: back[k] for k in ("device", "kernel", "softmax", "autocast_dtype")} == {
        "device": "cuda", "kernel": "sdpa", "softmax": "standard", "autocast_dtype": "bfloat16"}


def test_a_wrong_device_fact_is_named_when_it_excluded_the_recipe_that_wins(tmp_path):
    plain = _file(tmp_path / "bits.safetensors")
    _, matched, output = _import_and_match(tmp_path, plain, "cpu", "--device", "cpu")
    assert all(layer["best"]["o_bits_equal"] < 1.0 for layer in matched["layers"])
    assert matched["verdict"].startswith("no known recipe reproduces")
    line = next(w for w in matched["warnings"] if "excluded" in w)
    assert "step 0 layer 0: the recorded device cpu excluded sdpa-cudnn-sm90@" in line and "match --all" in line
    winners = {layer["layer"]: layer["excluded_winner"] for layer in matched["layers"]}
    assert all(w["facts"] == ["device cpu"] and w["o_bits_equal"] == 1.0 for w in winners.values())
    assert "the recorded device cpu excluded sdpa-cudnn-sm90@" in output  # said on the terminal too

    everything, _ = _invoke(["match", str(tmp_path / "cpu.zarr"), "--all"], tmp_path, "all")
    _named_kernels(everything)
    assert all(layer["overridden"].get("device cpu", 0) > 0 for layer in everything["layers"])
    assert any("--all tried every recipe" in n and "device cpu" in n for n in everything["notes"])


@pytest.mark.parametrize("options, said", [
    (["--device", "cpu"], "--device 'cpu' disagrees with the file's metadata device='cuda'"),
    (["--softmax", "fancy"], "softmax='fancy' is not standard or stabilized"),
    (["--causal", "false"], "--causal false disagrees with the file's metadata causal='true'"),
])
def test_facts_that_disagree_or_make_no_sense_are_one_line(tmp_path, options, said):
    said_file = _file(tmp_path / "said.safetensors", device="cuda")
    res = runner.invoke(app, ["import", str(said_file), "--to", str(tmp_path / "x.zarr"), *options])
    assert res.exit_code == 2 and said in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x.zarr").exists()
