"""CLI: info, import, export and synth end to end (typer's CliRunner, real stores)."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump

runner = CliRunner()


def test_info_json_and_tables(make_dump, tmp_path):
    path = make_dump(steps=(0, 5), incomplete=(9,), layers=(0, 1))
    r = runner.invoke(app, ["info", str(path), "--json", str(tmp_path / "i.json")])
    assert r.exit_code == 0, r.stderr
    s = json.loads((tmp_path / "i.json").read_text())
    assert s["steps"] == [0, 5] and s["incomplete_steps"] == [9] and s["layers"] == [0, 1]
    assert s["arrays"]["1"]["do"]["shape"] == [1, 2, 16, 8] and s["format_version"] == 1 and s["heads"]["0"] == [0, 1]
    assert "incomplete steps" in r.stdout and "9" in r.stdout and "IncompleteStepWarning" not in r.stderr
    assert s["warnings"] == []  # info lists the incomplete step in its table instead of warning
    r = runner.invoke(app, ["export", str(path), "--to", str(tmp_path / "e.safetensors"), "--json",
                            str(tmp_path / "e.json")])
    e = json.loads((tmp_path / "e.json").read_text())
    # the stderr line
    assert r.exit_code == 0 and len(e["warnings"]) == 1 and "step(s) 9 are incomplete" in e["warnings"][0]
    r = runner.invoke(app, ["info", str(path), "--step", "5", "--layer", "1", "--json", str(tmp_path / "j.json")])
    assert r.exit_code == 0 and json.loads((tmp_path / "j.json").read_text())["layers"] == [1]


def test_info_on_planted_shows_ground_truth(planted_dump, tmp_path):
    r = runner.invoke(app, ["info", str(planted_dump), "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0 and "ground truth" in r.stdout
    assert json.loads((tmp_path / "p.json").read_text())["warnings"] == []
    gt = json.loads((tmp_path / "p.json").read_text())["ground_truth"]
    assert gt["planted_heads"] == [1] and gt["ties"] == 2 and len(gt["standout_x_features"]) == 2


def test_import_export_round_trip_cli(tmp_path):
    t = {"step3.layer1.q": torch.randn(1, 2, 4, 8).bfloat16(),
         "step3.layer1.x": torch.randn(1, 4, 16).to(torch.float8_e4m3fn)}
    save_file(t, tmp_path / "a.safetensors", metadata={"causal": "false"})
    r = runner.invoke(app, ["import", str(tmp_path / "a.safetensors"), "--to", str(tmp_path / "d.zarr"), "--json",
                            str(tmp_path / "imp.json")])
    assert r.exit_code == 0, r.stderr
    assert json.loads((tmp_path / "imp.json").read_text())["steps"] == [3]
    assert open_dump(tmp_path / "d.zarr").layer_info(3, 1).causal is False
    r = runner.invoke(app, ["import", str(tmp_path / "a.safetensors"), "--to", str(tmp_path / "d.zarr")])
    assert r.exit_code == 2 and "already exists; pass --overwrite to replace it or choose another --to" in r.stderr
    r = runner.invoke(app, ["export", str(tmp_path / "d.zarr"), "--to", str(tmp_path / "b.safetensors")])
    assert r.exit_code == 0, r.stderr
    back = load_file(tmp_path / "b.safetensors")
    assert all(back[n].dtype == t[n].dtype and torch.equal(back[n].view(torch.uint8),
                                                           t[n].view(torch.uint8)) for n in t)


def test_import_bad_name_is_one_line(tmp_path):
    save_file({"attn.q": torch.zeros(1, 1, 2, 2)}, tmp_path / "a.safetensors")
    r = runner.invoke(app, ["import", str(tmp_path / "a.safetensors"), "--to", str(tmp_path / "d.zarr")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "step{S}.layer{L}.{q,k,v,o,do,x,mask}" in r.stderr and "Traceback" not in r.stderr


def test_synth_cli_writes_a_verified_planted_dump(tmp_path):
    out = tmp_path / "s.zarr"
    args = ["synth", "--out", str(out), "--seq", "64", "--heads", "2", "--head-dim", "16", "--batch", "2", "--steps",
            "2",
            "--ties", "2", "--planted-heads", "0", "--sink-strength", "6", "--seed", "3", "--previous-token-heads", "",
            "--json",
            str(tmp_path / "s.json")]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.stderr
    payload = json.loads((tmp_path / "s.json").read_text())
    assert payload["ground_truth"]["planted_heads"] == [0] and payload["ground_truth"]["sink_heads"] == [1]
    assert payload["ground_truth"]["previous_token_heads"] == []
    assert payload["check"]["o_bias_mean"] < 0 and payload["check"]["feature_rank"] >= 1
    d = open_dump(out)
    assert d.steps == [0, 1] and d.layer_info(0, 0).arrays["q"] == (2, 2, 64, 16)
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "already exists; pass --overwrite to replace it or choose another --out" in r.stderr
    r = runner.invoke(app, ["synth", "--out", str(tmp_path / "t.zarr"), "--planted-heads", "9"])
    assert r.exit_code == 2 and "not in 0..3" in r.stderr and not (tmp_path / "t.zarr").exists()
    r = runner.invoke(app, ["synth", "--out", str(tmp_path / "t.zarr"), "--previous-token-heads", "1"])
    assert r.exit_code == 2 and "--previous-token-heads: [1] not in 0..3 or planted" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.zarr").exists()


def test_the_cli_words_the_librarys_typed_errors_with_its_options(tmp_path):
    """The library says the facts (TargetExists, UnknownRank, InvalidSetting); the CLI names the option."""
    out = tmp_path / "s.zarr"
    assert runner.invoke(app, ["synth", "--out", str(out), "--seq", "64", "--heads", "2", "--head-dim", "16", "--steps",
                               "1"]).exit_code == 0
    r = runner.invoke(app, ["synth", "--out", str(out), "--seq", "64", "--heads", "2", "--head-dim", "16", "--steps",
                            "1"])
    assert r.exit_code == 2 and "already exists; pass --overwrite to replace it or choose another --out" in r.stderr
    r = runner.invoke(app, ["synth", "--out", str(tmp_path / "t.zarr"), "--head-dim", "2"])
    assert r.exit_code == 2 and "--head-dim: 2 is too small" in r.stderr
    r = runner.invoke(app, ["info", str(out), "--rank", "3"])
    assert r.exit_code == 2 and "rank 3 is not in" in r.stderr and "pick one of those with --rank" in r.stderr
