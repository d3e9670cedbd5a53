"""`fa-forensics delta-bias` on the sample dumps: the planted positive δ bias and its feature."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump

DEMO = Path(__file__).resolve().parents[2] / "sample_dumps" / "demo.zarr"
runner = CliRunner()


def test_delta_bias_finds_planted_bias_and_feature(planted_dump, tmp_path):
    truth = open_dump(planted_dump).ground_truth
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--step", "0", "--json", str(tmp_path / "r.json"),
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    planted = [p for p in r["per_step"] if p["head"] in truth["planted_heads"]]
    # one step: its units are (batch row, tie group), a few dozen; the t-test over them
    assert planted and all(p["delta_err_sum"] > 0 and p["t_p_value"] < 0.01 for p in planted)
    assert {"step", "layer", "head", "delta_err_sum", "frac_positive", "p_value"} <= r["per_step"][0].keys()
    assert r["focus"]["head"] in truth["planted_heads"]
    assert truth["planted_feature"] in [f["feature"] for f in r["top_features"][:3]]
    top = r["top_features"][0]
    assert {"feature", "contribution", "sign_agreement"} <= top.keys() and top["sign_agreement"] > 0.5
    assert r["cumulative"] == pytest.approx(r["step_sums"])  # one step: cumulative = that step's sum
    assert (tmp_path / "delta_bias_cumulative.png").is_file() and (tmp_path / "delta_bias_top_token.png").is_file()


def test_delta_bias_cumulative_across_steps_of_planted_head(planted_dump, tmp_path):
    d = open_dump(planted_dump)
    head = d.ground_truth["planted_heads"][0]
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--head", str(head), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["steps"] == d.steps and len(r["cumulative"]) == len(d.steps)
    assert all(b > a for a, b in zip(r["cumulative"], r["cumulative"][1:]))  # Fig. 5a: grows every step
    assert r["total"]["delta_err_sum"] > 0 and r["total"]["p_value"] < 0.01


def test_delta_bias_on_the_demo_dump_adds_up(tmp_path):
    d = open_dump(DEMO)
    assert d.steps, "sample_dumps/demo.zarr has no complete step"
    res = runner.invoke(app, ["delta-bias", str(DEMO), "--step", str(d.steps[0]), "--layer",
                              str(d.layers(d.steps[0])[0]), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert len(r["per_step"]) == d.layer_info(d.steps[0], d.layers(d.steps[0])[0]).n_heads  # one row per head
    assert r["total"]["delta_err_sum"] == pytest.approx(sum(p["delta_err_sum"] for p in r["per_step"]), rel=1e-9,
                                                        abs=1e-12)
    assert r["total"]["n_tokens"] == sum(p["n_tokens"] for p in r["per_step"]) and r["total"]["se"] > 0


def test_delta_bias_under_the_papers_autocast_preset_finds_the_planted_bias(planted_dump, tmp_path):
    truth = open_dump(planted_dump).ground_truth
    head = truth["planted_heads"][0]
    r = {}
    for preset in ("bf16-autocast", "bf16"):
        res = runner.invoke(app, ["delta-bias", str(planted_dump), "--step", "0", "--head", str(head), "--preset",
                                  preset,
                                  "--json", str(tmp_path / f"{preset}.json")])
        assert res.exit_code == 0, res.output
        r[preset] = json.loads((tmp_path / f"{preset}.json").read_text())
        assert r[preset]["preset"] == preset and f"preset {preset}" in r[preset]["verdict"]
    auto = r["bf16-autocast"]
    (p,) = auto["per_step"]
    # one step of one head: about 40 units (batch row, tie group); its raw p, not a claim over the family
    assert p["delta_err_sum"] > 0 and min(p["t_p_value"], p["p_value"]) < 0.05 and auto["total"]["t_p_value"] < 0.05
    assert auto["top_features"][0]["feature"] == truth["planted_feature"]
    # the preset changes the numbers (same stored inputs, deterministic replays): bf16 scores, m, ℓ and
    # accumulator give another Σδ error (measured +1.55 ± 0.41 vs +2.45 ± 0.24 under bf16)
    assert abs(auto["total"]["delta_err_sum"] - r["bf16"]["total"]["delta_err_sum"]) > 0.1


def test_delta_bias_unknown_preset_is_one_line_exit_2(planted_dump):
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--preset", "bf17"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--preset 'bf17'" in res.output and "bf16-autocast" in res.output


def test_preset_equal_to_the_reference_says_there_is_no_difference(planted_dump, tmp_path):
    """--preset fp32 replays exactly the reference: no table of NaN shares, a plain verdict."""
    out = tmp_path / "db.json"
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--step", "1", "--head", "1", "--preset", "fp32",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["total"]["delta_err_sum"] == 0 and "no difference from the fp32 replay" in d["verdict"]
    assert "nan%" not in res.output
